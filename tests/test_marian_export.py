"""Exporting to Hugging Face Marian and on to CTranslate2.

A toy model trained with the Marian-compatible settings
(``experiments/configs/toy_marian.py``) is exported; transformers'
``MarianMTModel`` and ``MarianTokenizer`` load the export and produce this
library's tokens and ids, the importer gives its parameters back bit for bit,
and CTranslate2 (float32) decodes the converted export to the same greedy
tokens. These need torch and transformers (the ``marian-test`` extra), and
ctranslate2 for its test.
"""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip(
    'torch', reason='the Marian export tests run the export in PyTorch: '
    'pip install -c constraints.txt -e ".[marian-test]"')
transformers = pytest.importorskip(
    'transformers', reason='the Marian export tests need transformers: '
    'pip install -c constraints.txt -e ".[marian-test]"')

from tests.conftest import TRAINED, TRAINED_MODEL, built_once  # noqa: E402
from xfmr_jax import config as config_lib  # noqa: E402
from xfmr_jax import decode, hf_beam, marian, marian_export  # noqa: E402
from xfmr_jax import model as model_lib  # noqa: E402
from xfmr_jax.token_ids import EOS, PAD  # noqa: E402
from xfmr_jax.workdir import Workdir  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What experiments/configs/toy_marian.py changes in the toy model.
MARIAN_FIELDS = dict(sinusoid_layout='halves', layer_norm_epsilon=1e-5,
                     pad_embedding='zero')


@pytest.fixture(scope='module')
def trained(data_dir, tmp_path_factory):
  """A toy model with the Marian settings, trained briefly (it ends its
  outputs at varied lengths), and its export."""
  from experiments.configs import toy_marian
  from tests.test_train import tiny_config
  from xfmr_jax import training_loop
  for field, value in MARIAN_FIELDS.items():
    assert toy_marian.get_config().model[field] == value

  def train(wd):
    cfg = tiny_config(data_dir, **dict(TRAINED, num_train_steps=250,
                                       checkpoint_every=250))
    cfg.model.update(TRAINED_MODEL, **MARIAN_FIELDS)
    training_loop.train_and_evaluate(cfg, str(wd))
  workdir = built_once(tmp_path_factory, 'trained_marian', train)
  out = str(tmp_path_factory.mktemp('export') / 'hf')
  run = subprocess.run(
      [sys.executable, '-m', 'experiments.export_hf', f'--workdir={workdir}',
       f'--out={out}'], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  assert 'exported' in run.stdout and 'note:' not in run.stdout  # PAD row 0
  ours = Workdir(str(workdir)).load()
  sources = [ours.tokenizer.decode(ours.tokenizer.encode(line))
             for line in _test_sources(data_dir)]
  return dict(workdir=str(workdir), out=out, ours=ours, sources=sources)


def _test_sources(data_dir, n=12):
  from xfmr_jax import data
  pairs = data.get_source('toy_translate/small', 'test', str(data_dir))
  return [pairs[i][0] for i in range(n)]


def _batch(trained):
  tok = trained['ours'].tokenizer
  ids = [tok.encode(s) + [EOS] for s in trained['sources']]
  width = max(map(len, ids))
  return np.array([i + [PAD] * (width - len(i)) for i in ids], np.int32)


def _until_eos(row):
  row = list(np.asarray(row))
  return row[:row.index(EOS)] if EOS in row else row



def test_import_of_the_export_gives_the_parameters_bit_for_bit(trained):
  _, params, tokenizer, generation = marian.read_hf_dir(trained['out'])
  want = trained['ours'].params
  flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
  for path, leaf in flat_want:
    got = params
    for key in path:
      got = got[key.key]
    np.testing.assert_array_equal(got, np.asarray(leaf), err_msg=str(path))
  np.testing.assert_array_equal(params.pop('logits')['bias'], 0)  # no bias
  assert len(jax.tree.leaves(params)) == len(flat_want)
  assert (np.asarray(params['source_embed']['embedding'][PAD]) == 0).all()
  assert tokenizer.vocab_size == trained['ours'].tokenizer.vocab_size
  config = trained['ours'].config   # generate has no length penalty at beam 1
  assert generation == dict(beam_size=config.beam_size, beam_alpha=(
      config.beam_alpha if config.beam_size > 1 else 1.0))


def test_marian_tokenizer_gives_the_same_ids_and_text(trained):
  hf_tok = transformers.MarianTokenizer.from_pretrained(trained['out'])
  ours = trained['ours'].tokenizer
  order = np.argsort(marian_export.marian_ids(ours))  # Marian id -> ours
  for text in trained['sources'] + ['zzq unknown ### text']:
    ids = hf_tok(text)['input_ids']
    assert list(order[ids]) == ours.encode(text) + [EOS], text
  for text in trained['sources']:  # (unknown pieces: HF drops them)
    ids = hf_tok(text)['input_ids']
    assert hf_tok.decode(ids, skip_special_tokens=True) == ours.decode(
        order[ids]), text


def _generate(trained, **kwargs):
  model = transformers.MarianMTModel.from_pretrained(trained['out']).eval()
  hf_tok = transformers.MarianTokenizer.from_pretrained(trained['out'])
  batch = hf_tok(trained['sources'], padding=True, return_tensors='pt')
  with torch.no_grad():
    out = model.generate(**batch, do_sample=False, **kwargs)
  seqs = out.sequences if hasattr(out, 'sequences') else out
  order = np.argsort(marian_export.marian_ids(trained['ours'].tokenizer))
  return [_until_eos(order[row[1:]]) for row in seqs.numpy()], out


def test_generate_on_the_export_gives_this_librarys_tokens(trained):
  ours = trained['ours']
  inputs = _batch(trained)
  want, _ = _generate(trained, num_beams=1, max_new_tokens=40)
  got = decode.greedy_decode(ours.model, ours.params, inputs,
                             max_decode_len=40)
  assert [_until_eos(r) for r in np.asarray(got)] == want
  assert len({len(w) for w in want}) >= 4  # varied lengths, most finished
  assert sum(len(w) < 39 for w in want) >= len(want) - 3

  want, out = _generate(trained, num_beams=4, length_penalty=1.0,
                        early_stopping=False, max_new_tokens=40,
                        output_scores=True, return_dict_in_generate=True)
  tokens, scores = hf_beam.beam_search(ours.model, ours.params, inputs,
                                       beam_size=4, alpha=1.0,
                                       max_decode_len=40, force_eos=False)
  assert [_until_eos(r) for r in np.asarray(tokens)] == want
  np.testing.assert_allclose(np.asarray(scores),
                             out.sequences_scores.numpy(), atol=1e-4)


def test_ctranslate2_float32_gives_the_same_greedy_tokens(trained, tmp_path):
  ctranslate2 = pytest.importorskip(
      'ctranslate2', reason='pip install -c constraints.txt -e '
      '".[marian-test]"')
  ct2_dir = str(tmp_path / 'ct2')
  run = subprocess.run(
      ['ct2-transformers-converter', '--model', trained['out'],
       '--output_dir', ct2_dir], capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  ours = trained['ours']
  tok = ours.tokenizer
  translator = ctranslate2.Translator(ct2_dir, device='cpu',
                                      compute_type='float32')
  source = [[tok.id_to_piece(i) for i in tok.encode(s)] + ['</s>']
            for s in trained['sources']]
  results = translator.translate_batch(source, beam_size=1,
                                       max_decoding_length=40)
  got = decode.greedy_decode(ours.model, ours.params, _batch(trained),
                             max_decode_len=40)
  want = [[tok.id_to_piece(i) for i in _until_eos(r)] for r in np.asarray(got)]
  assert [r.hypotheses[0] for r in results] == want


# ------------------------------------------------------- what cannot go --

@pytest.mark.parametrize('change, field', [
    (dict(positional='rope', sinusoid_layout='interleaved'), 'positional'),
    (dict(norm_position='pre'), 'norm_position'),
    (dict(num_kv_heads=1), 'num_kv_heads'),
    (dict(activation='swiglu'), 'activation'),
    (dict(sinusoid_layout='interleaved'), 'sinusoid_layout'),
    (dict(layer_norm_epsilon=1e-6), 'layer_norm_epsilon'),
    (dict(share_embeddings=False), 'share_embeddings'),
    (dict(model_kind='decoder_only'), 'model_kind')])
def test_a_model_marian_cannot_represent_names_the_field(change, field):
  cfg = config_lib.toy(**{**MARIAN_FIELDS, **change})
  with pytest.raises(marian_export.MarianExportError, match=f'model.{field}='):
    marian_export.check_exportable(cfg)


def test_default_toy_workdir_is_refused_in_one_line(trained_workdir, tmp_path):
  out = tmp_path / 'hf'
  run = subprocess.run(
      [sys.executable, '-m', 'experiments.export_hf',
       f'--workdir={trained_workdir}', f'--out={out}'], cwd=ROOT,
      capture_output=True, text=True, timeout=300)
  assert run.returncode == 2
  assert run.stderr.strip().count('\n') == 0, run.stderr
  assert "model.sinusoid_layout='interleaved'" in run.stderr
  assert not out.exists() and not (tmp_path / 'hf.tmp').exists()


def test_a_non_empty_output_folder_is_left_alone(trained, tmp_path):
  out = tmp_path / 'hf'
  out.mkdir()
  (out / 'keep.txt').write_text('mine')
  with pytest.raises(marian_export.MarianExportError, match='not an empty'):
    marian_export.write_hf_dir(trained['workdir'], str(out))
  assert os.listdir(out) == ['keep.txt']


def test_scanned_layers_export_the_same_model():
  """A scan_layers model's stacked parameters become the same per-layer
  tensors: the unscanned model on the imported tensors computes the scanned
  model's logits."""
  cfg = config_lib.toy(vocab_size=40, d_model=16, num_heads=2, d_ff=32,
                       scan_layers=True, **MARIAN_FIELDS)
  scanned = model_lib.build(cfg)
  x = jnp.array([[5, 6, 7, EOS], [8, 9, EOS, PAD]], jnp.int32)
  y = jnp.array([[10, 11, EOS], [12, EOS, PAD]], jnp.int32)
  params = scanned.init(jax.random.key(3), x, y)['params']
  ids = marian_export.id_permutation(39, 0, 1, 40)
  tensors = marian_export.hf_tensors(params, cfg, ids)
  fields = {f: getattr(cfg, f) for f in (
      'd_model', 'd_ff', 'num_encoder_layers', 'num_decoder_layers')}
  back = marian.convert_params(tensors, fields, 40, ids)
  flat = model_lib.build(config_lib.toy(
      vocab_size=40, d_model=16, num_heads=2, d_ff=32, logits_bias='fixed',
      **MARIAN_FIELDS))
  np.testing.assert_allclose(flat.apply({'params': back}, x, y),
                             scanned.apply({'params': params}, x, y),
                             atol=1e-6, rtol=0)

