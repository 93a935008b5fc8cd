"""Importing a Hugging Face Marian model: the imported model computes what
the PyTorch model computes (logits, greedy and beam outputs, tokenization),
translates through the normal workdir path, and fine-tunes.

The model is a tiny random ``MarianMTModel`` built offline
(``tests/marian_fixture.py``); these tests need torch and transformers (the
``marian-test`` extra) and are skipped without them.
"""
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip(
    'torch', reason='the Marian import tests compare against PyTorch: '
    'pip install -c constraints.txt -e ".[marian-test]"')
transformers = pytest.importorskip(
    'transformers', reason='the Marian import tests need transformers: '
    'pip install -c constraints.txt -e ".[marian-test]"')

from tests.marian_fixture import make_hf_dir  # noqa: E402
from xfmr_jax import config as config_lib  # noqa: E402
from xfmr_jax import decode, hf_beam, marian, model as model_lib  # noqa: E402
from xfmr_jax import top_k as topk  # noqa: E402
from xfmr_jax.marian_tokenizer import MarianTokenizer  # noqa: E402
from xfmr_jax.token_ids import EOS, PAD  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ['The cat sees a big red house.', 'A bird eats.',
           'Small dog sleeps under the green tree near a blue house.',
           'Red apple.', 'The dog runs over the tree.']


@pytest.fixture(scope='module')
def hf(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('opus-mt-tiny'))
  info = make_hf_dir(path)
  hf_model = transformers.MarianMTModel.from_pretrained(path).eval()
  hf_tok = transformers.MarianTokenizer.from_pretrained(path)
  fields, params, tok, generation = marian.read_hf_dir(path)
  model = model_lib.build(config_lib.ModelConfig(vocab_size=tok.vocab_size,
                                                 **fields))
  return dict(info, path=path, model=hf_model, tok=hf_tok, ours=model,
              params=params, our_tok=tok, generation=generation)


def to_ours(hf, ids):
  """Marian ids (any shape) -> ours."""
  return np.argsort(hf['our_tok'].ours_to_marian)[np.asarray(ids)]


def hf_batch(hf, texts):
  batch = hf['tok'](texts, padding=True, return_tensors='pt')
  return batch, to_ours(hf, batch['input_ids'].numpy()).astype(np.int32)


def test_tokenizer_matches_hugging_face(hf):
  texts = SOURCES + ['>>fr<< The cat.', 'unknown words: zebra xylophone']
  for text in texts:
    ids = hf['tok'](text)['input_ids']
    assert hf['our_tok'].encode(text) + [EOS] == list(to_ours(hf, ids)), text
  for _, target in hf['pairs'][:50]:
    ids = hf['tok'](text_target=target)['input_ids']
    assert hf['our_tok'].encode_target(target) + [EOS] == list(
        to_ours(hf, ids))
    assert hf['our_tok'].decode(to_ours(hf, ids)) == hf['tok'].decode(
        ids, skip_special_tokens=True)


def test_logits_match_pytorch_on_a_padded_batch(hf):
  targets = [t for _, t in hf['pairs'][:len(SOURCES)]]
  batch = hf['tok'](SOURCES, text_target=targets, padding=True,
                    return_tensors='pt')
  with torch.no_grad():
    want = hf['model'](**batch).logits.numpy()   # [batch, t, marian vocab]
  inputs = to_ours(hf, batch['input_ids'].numpy()).astype(np.int32)
  labels = to_ours(hf, batch['labels'].numpy()).astype(np.int32)
  got = np.asarray(hf['ours'].apply({'params': hf['params']}, inputs, labels))
  real = labels != PAD
  assert (~real).any() and (inputs == PAD).any()   # the batch is padded
  want = want[..., hf['our_tok'].ours_to_marian]   # columns in our id order
  np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)


def test_greedy_matches_generate(hf):
  batch, inputs = hf_batch(hf, SOURCES)
  gen = hf['model'].generation_config
  gen.forced_eos_token_id = None  # ours does not force EOS at max length
  try:
    with torch.no_grad():
      out = hf['model'].generate(**batch, num_beams=1, do_sample=False,
                                 max_new_tokens=20).numpy()
  finally:
    gen.forced_eos_token_id = 0
  got = np.asarray(decode.greedy_decode(hf['ours'], hf['params'], inputs,
                                        max_decode_len=20))
  want = to_ours(hf, out[:, 1:])                   # drop the start symbol
  want[out[:, 1:] == hf['pad']] = PAD
  assert (want == EOS).any(axis=1).sum() >= 2      # some end before 20
  np.testing.assert_array_equal(got[:, :want.shape[1]], want)


@pytest.mark.parametrize('max_new', [6, 25])
def test_beam_search_matches_generate(hf, max_new, monkeypatch):
  batch, inputs = hf_batch(hf, SOURCES)
  with torch.no_grad():
    out = hf['model'].generate(**batch, num_beams=4, do_sample=False,
                               max_new_tokens=max_new, length_penalty=1.0,
                               early_stopping=False, output_scores=True,
                               return_dict_in_generate=True)
  seqs = out.sequences.numpy()[:, 1:]
  want = to_ours(hf, seqs)
  want[seqs == hf['pad']] = PAD
  # As shipped (this small vocabulary is ranked in one scan), then with the
  # vocabulary ranked block by block, as large vocabularies are (top_k.py).
  for min_blocks in (topk.MIN_BLOCKS_PER_K, 1):
    monkeypatch.setattr(topk, 'MIN_BLOCKS_PER_K', min_blocks)
    jax.clear_caches()  # the constant is read while tracing
    tokens, scores = hf_beam.beam_search(hf['ours'], hf['params'], inputs,
                                         beam_size=4, alpha=1.0,
                                         max_decode_len=max_new)
    np.testing.assert_array_equal(np.asarray(tokens)[:, :want.shape[1]],
                                  want)
    np.testing.assert_allclose(np.asarray(scores),
                               out.sequences_scores.numpy(), atol=1e-4)


def test_anti_repetition_in_beam_search_matches_generate(hf):
  """generate's no_repeat_ngram_size and repetition_penalty act on each
  beam's log-probabilities; hf_beam's do too (outputs and scores equal)."""
  batch, inputs = hf_batch(hf, SOURCES)
  for settings in (dict(no_repeat_ngram_size=2),
                   dict(repetition_penalty=1.3)):
    with torch.no_grad():
      out = hf['model'].generate(**batch, num_beams=4, do_sample=False,
                                 max_new_tokens=25, length_penalty=1.0,
                                 early_stopping=False, output_scores=True,
                                 return_dict_in_generate=True, **settings)
    seqs = out.sequences.numpy()[:, 1:]
    want = to_ours(hf, seqs)
    want[seqs == hf['pad']] = PAD
    tokens, scores = hf_beam.beam_search(hf['ours'], hf['params'], inputs,
                                         beam_size=4, alpha=1.0,
                                         max_decode_len=25, **settings)
    np.testing.assert_array_equal(np.asarray(tokens)[:, :want.shape[1]],
                                  want, err_msg=str(settings))
    np.testing.assert_allclose(np.asarray(scores),
                               out.sequences_scores.numpy(), atol=1e-4)
  plain, _ = hf_beam.beam_search(hf['ours'], hf['params'], inputs,
                                 beam_size=4, alpha=1.0, max_decode_len=25)
  assert not np.array_equal(plain, tokens)  # the settings changed something


def test_import_translate_and_finetune_end_to_end(hf, tmp_path):
  workdir = str(tmp_path / 'imported')
  run = subprocess.run(
      [sys.executable, '-m', 'experiments.import_marian',
       f'--hf_dir={hf["path"]}', f'--workdir={workdir}'],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  from xfmr_jax.translate import Translator
  translator = Translator.from_workdir(workdir, beam_size=4, batch_size=8)
  assert translator.beam_rules == 'hf' and translator.alpha == 1.0
  batch, _ = hf_batch(hf, SOURCES)
  extra = translator.max_decode_extra
  width = translator.bucket(batch['input_ids'].shape[1], 10 ** 6)
  with torch.no_grad():
    out = hf['model'].generate(**batch, num_beams=4, length_penalty=1.0,
                               max_new_tokens=width + extra)
  want = hf['tok'].batch_decode(out, skip_special_tokens=True)
  assert translator(SOURCES) == want
  # Exported, it runs under the same rules with the Marian tokenizer.
  from xfmr_jax import export, serving
  export.export_workdir(workdir, str(tmp_path / 'artifact'), beam_sizes=(4,),
                        batch_size=8, progress=lambda line: None)
  assert serving.load(str(tmp_path / 'artifact'))(SOURCES) == want
  run = subprocess.run(
      [sys.executable, '-m', 'experiments.translate', f'--workdir={workdir}'],
      input=''.join(s + '\n' for s in SOURCES + [''] + SOURCES[:1]), cwd=ROOT,
      capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  assert run.stdout.split('\n')[:-1] == want + [''] + want[:1]

  # Fine-tune 20 steps on a TSV of the fixture's pairs: the loss falls.
  data = tmp_path / 'data'
  data.mkdir()
  for split in ('train', 'validation', 'test'):
    pairs = hf['pairs'] if split == 'train' else hf['pairs'][:16]
    (data / f'{split}.tsv').write_text(
        ''.join(f'{s}\t{t}\n' for s, t in pairs), encoding='utf-8')
  from experiments.configs import finetune
  from xfmr_jax import training_loop
  config = finetune.get_config()
  config.update(dict(
      init_from=workdir, dataset=f'tsv:{data}/{{split}}.tsv',
      num_train_steps=20, warmup_steps=2, learning_rate=3e-3, batch_size=16,
      max_length=32, eval_max_length=32, log_every=5, eval_every=1000,
      checkpoint_every=1000, eval_batch_size=16, bleu_samples=0,
      test_samples=16, num_print_samples=0, async_checkpoints=False,
      beam_size=1))
  tuned = str(tmp_path / 'tuned')
  training_loop.train_and_evaluate(config, tuned)
  with open(os.path.join(tuned, 'metrics.jsonl')) as f:
    losses = [r['loss'] for r in map(json.loads, f) if r['split'] == 'train']
  assert len(losses) == 4 and losses[-1] < losses[0] - 0.05, losses
  assert os.path.isdir(os.path.join(tuned, 'marian_tokenizer'))
  assert len(Translator.from_workdir(tuned)(SOURCES)) == len(SOURCES)


def test_pytorch_bin_weights_give_the_same_parameters(hf, tmp_path):
  path = _copy(hf, tmp_path)
  os.remove(os.path.join(path, 'model.safetensors'))
  torch.save(hf['model'].state_dict(), os.path.join(path, 'pytorch_model.bin'))
  _, params, _, _ = marian.read_hf_dir(path)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(hf['params'])):
    np.testing.assert_array_equal(a, b)


def test_engines_benchmark_quick_runs_every_engine(tmp_path):
  """The engines benchmark on a tiny model: every engine translates every
  sentence, and each reports speed, model bytes and peak memory."""
  pytest.importorskip('ctranslate2', reason='pip install -c constraints.txt '
                      '-e ".[marian-test]"')
  from experiments.benchmark import engines
  res = engines.main(['--quick', '--json', str(tmp_path / 'b.json')])
  assert set(res['engines']) == set(engines.ENGINES)
  for name, e in res['engines'].items():
    assert len(e['tokens_per_sec']) == (1 if name == 'transformers' else 2)
    assert min(e['tokens_per_sec']) > 0 and e['model_bytes'] > 0, name
    # A loaded engine holds at least its model.
    assert e['peak_rss_bytes'] > e['model_bytes'], name
    assert 0 <= e['agreement_with_xfmr_jax'] <= 1
  # The same float32 model under the same rules: the same tokens.
  assert res['engines']['transformers']['agreement_with_xfmr_jax'] == 1.0
  assert json.loads((tmp_path / 'b.json').read_text())['size'] == 'opus_mt'


@pytest.mark.parametrize('user_policy', [None, 'ACTIVE'])
def test_benchmark_gives_transformers_the_users_openmp_policy(user_policy):
  """The package sets PASSIVE for its shared train rounds; the engines
  benchmark puts the user's setting back before torch (and OpenMP) load,
  and says which policy transformers ran under."""
  env = {k: v for k, v in os.environ.items() if k != 'OMP_WAIT_POLICY'}
  if user_policy:
    env['OMP_WAIT_POLICY'] = user_policy
  code = ('import os, sys\n'
          'from experiments.benchmark import engines\n'
          'assert os.environ["OMP_WAIT_POLICY"] == '
          f'{user_policy or "PASSIVE"!r}\n'
          'print(engines.user_omp_policy())\n'
          'print(os.environ.get("OMP_WAIT_POLICY"))\n'
          'import torch\n'
          'print(engines.user_omp_policy())\n')
  out = subprocess.run([sys.executable, '-c', code], env=env, text=True,
                       capture_output=True, check=True,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
  said, in_env, after_import = out.stdout.splitlines()[-3:]
  assert said == (user_policy or "OpenMP's default")
  assert in_env == str(user_policy)
  assert after_import.startswith('as set when OpenMP was first loaded')


# ------------------------------------------------------------ bad input --

def _copy(hf, tmp_path):
  path = str(tmp_path / 'hf')
  shutil.copytree(hf['path'], path)
  return path


@pytest.mark.parametrize('name', ['config.json', 'target.spm', 'vocab.json',
                                  'model.safetensors'])
def test_missing_file_is_named(hf, tmp_path, name):
  path = _copy(hf, tmp_path)
  os.remove(os.path.join(path, name))
  with pytest.raises(marian.MarianImportError,
                     match=name if name != 'model.safetensors' else
                     'no weights'):
    marian.read_hf_dir(path)


@pytest.mark.parametrize('field, value', [
    ('normalize_embedding', True), ('add_final_layer_norm', True),
    ('share_encoder_decoder_embeddings', False), ('scale_embedding', False),
    ('activation_function', 'mish'), ('decoder_ffn_dim', 7),
    ('d_model', None), ('model_type', 'bart')])
def test_unsupported_config_field_is_named(hf, tmp_path, field, value):
  path = _copy(hf, tmp_path)
  cfg_path = os.path.join(path, 'config.json')
  with open(cfg_path) as f:
    cfg = json.load(f)
  cfg[field] = value
  with open(cfg_path, 'w') as f:
    json.dump(cfg, f)
  with pytest.raises(marian.MarianImportError, match=field):
    marian.read_hf_dir(path)


def test_corrupted_weights_are_one_line_error(hf, tmp_path):
  path = _copy(hf, tmp_path)
  weights = os.path.join(path, 'model.safetensors')
  with open(weights, 'r+b') as f:
    f.truncate(os.path.getsize(weights) // 2)
  with pytest.raises(marian.MarianImportError, match='model.safetensors'):
    marian.read_hf_dir(path)
  run = subprocess.run(
      [sys.executable, '-m', 'experiments.import_marian', f'--hf_dir={path}',
       f'--workdir={tmp_path / "out"}'], cwd=ROOT, capture_output=True,
      text=True, timeout=300)
  assert run.returncode == 2
  assert run.stderr.strip().count('\n') == 0 and 'safetensors' in run.stderr


def test_tokenizer_round_trips_through_a_workdir(hf, tmp_path):
  hf['our_tok'].save(str(tmp_path))
  loaded = MarianTokenizer.load(str(tmp_path))
  ids = loaded.encode_target(hf['pairs'][0][1])
  assert loaded.decode(ids + [EOS]) == hf['pairs'][0][1]


def test_export_of_an_import_gives_back_the_original_files(hf, tmp_path):
  """import then export: every tensor the model uses, the config's sizes and
  ids, and the tokenizer files come back as they were."""
  from safetensors.numpy import load_file
  from experiments.configs import finetune
  from xfmr_jax import marian_export
  fields, params, tokenizer, generation = marian.read_hf_dir(hf['path'])
  workdir = str(tmp_path / 'imported')
  marian.write_workdir(workdir, finetune.for_imported(
      fields, tokenizer.vocab_size, generation), params, tokenizer)
  out = str(tmp_path / 'hf')
  info = marian_export.write_hf_dir(workdir, out)
  original = load_file(os.path.join(hf['path'], 'model.safetensors'))
  exported = load_file(os.path.join(out, 'model.safetensors'))
  assert info['parameters'] == sum(v.size for v in exported.values())
  for name, value in exported.items():
    np.testing.assert_array_equal(value, original[name], err_msg=name)
  with open(os.path.join(hf['path'], 'config.json')) as f:
    want = json.load(f)
  with open(os.path.join(out, 'config.json')) as f:
    got = json.load(f)
  for key in ('vocab_size', 'd_model', 'encoder_layers', 'decoder_layers',
              'encoder_attention_heads', 'encoder_ffn_dim', 'pad_token_id',
              'eos_token_id', 'decoder_start_token_id', 'activation_function',
              'max_position_embeddings'):
    assert got[key] == want[key], key
  for name in ('source.spm', 'target.spm', 'vocab.json'):
    with open(os.path.join(out, name), 'rb') as a, open(
        os.path.join(hf['path'], name), 'rb') as b:
      assert a.read() == b.read(), name
  reloaded = transformers.MarianMTModel.from_pretrained(out).eval()
  batch, _ = hf_batch(hf, SOURCES)
  with torch.no_grad():
    np.testing.assert_array_equal(
        reloaded.generate(**batch, num_beams=4, max_new_tokens=20).numpy(),
        hf['model'].generate(**batch, num_beams=4, max_new_tokens=20).numpy())
