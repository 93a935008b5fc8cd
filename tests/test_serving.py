"""The exported translator: export, loading without model code, damage checks."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from xfmr_jax import data, serving
from xfmr_jax.translate import Translator

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Run in a fresh interpreter in which the model code cannot be imported.
NO_MODEL_CODE = r'''
import importlib.abc, json, sys
BLOCKED = ('flax', 'optax', 'orbax', 'tensorflow_datasets', 'grain',
           'xfmr_jax.model', 'xfmr_jax.encoder_decoder', 'xfmr_jax.blocks',
           'xfmr_jax.layers', 'xfmr_jax.attention', 'xfmr_jax.decode',
           'xfmr_jax.translate', 'xfmr_jax.config', 'xfmr_jax.export')

class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name in BLOCKED or name.startswith(tuple(b + '.' for b in BLOCKED)):
      raise ImportError(f'{name} is blocked in this test')

sys.meta_path.insert(0, Block())
from xfmr_jax import serving
artifact, texts = sys.argv[1], json.load(open(sys.argv[2]))
translate = serving.load(artifact)
out = {str(b): translate(texts, beam_size=b) for b in translate.beam_sizes}
assert not any(m.split('.')[0] in ('flax', 'optax', 'orbax')
               for m in sys.modules), sorted(sys.modules)
print(json.dumps(out))
'''


@pytest.fixture(scope='module')
def artifact(exported_artifact):
  return exported_artifact


@pytest.fixture(scope='module')
def sources(data_dir):
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  texts = [test[i][0] for i in range(24)]
  return texts[:5] + ['', '  '] + texts[5:] + ['drag ' * 80]  # last: truncated


def test_artifact_layout_and_manifest(artifact, trained_workdir):
  manifest = json.loads((artifact / 'manifest.json').read_text())
  assert manifest['beam_sizes'] == [4, 1]
  assert manifest['buckets'] == [16, 32, 64, 128]  # max_len 128
  assert manifest['platforms'] == ['cpu']
  names = {f'translate_b{b}_s{w}.jaxexport' for b in (4, 1)
           for w in manifest['buckets']}
  assert set(manifest['modules']) == names
  assert set(manifest['sha256']) == names | {'params.npz', 'tokenizer.model'}
  assert not (artifact.parent / 'artifact.tmp').exists()
  # The parameters are beside the modules, not inside them: a module that
  # held the float32 weights would be larger than they are (the largest,
  # beam 4 at width 128, is about 160 KB; the weights are about 820 KB).
  params = np.load(artifact / 'params.npz')
  n_params = sum(params[k].size for k in params.files)
  assert n_params * 4 > 3 * max(os.path.getsize(artifact / n) for n in names)


def test_loaded_without_model_code_equals_translator(artifact, trained_workdir,
                                                     sources, tmp_path):
  texts_file = tmp_path / 'texts.json'
  texts_file.write_text(json.dumps(sources))
  run = subprocess.run(
      [sys.executable, '-c', NO_MODEL_CODE, str(artifact), str(texts_file)],
      capture_output=True, text=True, cwd=ROOT, timeout=300,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert run.returncode == 0, run.stderr[-3000:]
  exported = json.loads(run.stdout.strip().splitlines()[-1])
  for beam in (4, 1):
    reference = Translator.from_workdir(str(trained_workdir), beam_size=beam,
                                        batch_size=8)(sources)
    assert exported[str(beam)] == reference
  assert exported['4'][5] == exported['4'][6] == ''


def test_output_ids_equal_translator_token_for_token(artifact, trained_workdir,
                                                     sources):
  from xfmr_jax import source_batches
  loaded = serving.load(str(artifact))
  for beam in (4, 1):
    translator = Translator.from_workdir(str(trained_workdir), beam_size=beam,
                                         batch_size=8)
    rows = [loaded.encode(t, too_long='truncate') for t in sources[7:15]]
    width = loaded.bucket(max(len(r) for r in rows))
    inputs = source_batches.pad_rows(rows, width, 8)
    np.testing.assert_array_equal(loaded.decode_ids(inputs, beam),
                                  translator.decode_ids(inputs))


def test_a_batch_of_known_size_drops_finished_sentences(trained_workdir,
                                                        sources, tmp_path):
  """From 16 rows on, a beam search of known batch compacts, which a symbolic
  batch cannot: the artifact carries a module for exactly 16 rows, and it
  gives the compacting Translator's ids, as the any-batch module does for 8."""
  from xfmr_jax import export, source_batches
  out = tmp_path / 'art'
  manifest = export.export_workdir(str(trained_workdir), str(out),
                                   beam_sizes=(4,), batch_size=16,
                                   buckets=(16,), progress=lambda line: None)
  assert {n: m['rows'] for n, m in manifest['modules'].items()} == {
      'translate_b4_s16.jaxexport': None, 'translate_b4_s16_r16.jaxexport': 16}
  loaded = serving.load(str(out))
  translator = Translator.from_workdir(str(trained_workdir), beam_size=4,
                                       batch_size=16)
  rows = [loaded.encode(t, too_long='truncate') for t in sources if t.strip()]
  for n in (16, 8):
    inputs = source_batches.pad_rows(rows[:n], 16, 16)
    np.testing.assert_array_equal(loaded.decode_ids(inputs, 4),
                                  translator.decode_ids(inputs))


def _model_params_tokenizer(workdir):
  from xfmr_jax.workdir import Workdir
  trained = Workdir(workdir).load()
  return trained.model, trained.params, trained.tokenizer


def _copy(artifact, tmp_path):
  dst = tmp_path / 'copy'
  shutil.copytree(artifact, dst)
  return dst


def _edit_manifest(path, **changes):
  manifest = json.loads((path / 'manifest.json').read_text())
  manifest.update(changes)
  (path / 'manifest.json').write_text(json.dumps(manifest))


@pytest.mark.parametrize('damage, message', [
    ('no_manifest', 'manifest.json is missing'),
    ('bad_manifest', 'manifest.json is damaged'),
    ('flipped_module', 'translate_b4_s16.jaxexport is damaged'),
    ('truncated_params', 'params.npz is damaged'),
    ('missing_tokenizer', 'tokenizer.model is missing'),
    ('newer_jax', 'export it again with this jax'),
    ('other_platform', 'export it with --platforms=cpu'),
    ('future_format', 'artifact format 99'),
])
def test_damaged_or_incompatible_artifact_is_a_clear_error(
    artifact, tmp_path, damage, message):
  path = _copy(artifact, tmp_path)
  if damage == 'no_manifest':
    (path / 'manifest.json').unlink()
  elif damage == 'bad_manifest':
    (path / 'manifest.json').write_text('{"format": 1, "sha256": ')
  elif damage == 'flipped_module':
    blob = bytearray((path / 'translate_b4_s16.jaxexport').read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (path / 'translate_b4_s16.jaxexport').write_bytes(bytes(blob))
  elif damage == 'truncated_params':
    blob = (path / 'params.npz').read_bytes()
    (path / 'params.npz').write_bytes(blob[:len(blob) // 2])
  elif damage == 'missing_tokenizer':
    (path / 'tokenizer.model').unlink()
  elif damage == 'newer_jax':
    _edit_manifest(path, calling_convention_version=999, jax_version='9.0')
  elif damage == 'other_platform':
    _edit_manifest(path, platforms=['tpu'])
  elif damage == 'future_format':
    _edit_manifest(path, format=99)
  with pytest.raises(serving.ArtifactError, match=message):
    serving.load(str(path))


def test_unexported_beam_size_and_missing_artifact(artifact, tmp_path):
  with pytest.raises(ValueError, match=r'beam_size 2 was not exported; this '
                                       r'artifact has \[4, 1\]'):
    serving.load(str(artifact))(['drag'], beam_size=2)
  with pytest.raises(serving.ArtifactError, match='no exported translator'):
    serving.load(str(tmp_path / 'nothing'))


def test_export_cli_and_its_errors(trained_workdir, tmp_path):
  def cli(*args):
    return subprocess.run([sys.executable, '-m', 'experiments.export', *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
  out = tmp_path / 'art'
  run = cli(f'--workdir={trained_workdir}', f'--out={out}', '--beam_sizes=1',
            '--platforms=cpu,cuda,tpu')  # lowering needs no such device
  assert run.returncode == 0, run.stderr[-2000:]
  assert 'wrote' in run.stdout and (out / 'translate_b1_s16.jaxexport').exists()
  manifest = json.loads((out / 'manifest.json').read_text())
  assert manifest['platforms'] == ['cpu', 'cuda', 'tpu']
  assert serving.load(str(out))(['drag'], beam_size=1)[0] == Translator(
      *_model_params_tokenizer(trained_workdir))(['drag'])[0]
  # Without --alpha the artifact scores beams as the workdir's config says.
  workdir = tmp_path / 'workdir'
  shutil.copytree(trained_workdir, workdir)
  config = json.loads((workdir / 'config.json').read_text())
  (workdir / 'config.json').write_text(json.dumps({**config, 'beam_alpha': 0.9}))
  run = cli(f'--workdir={workdir}', f'--out={tmp_path}/art2', '--beam_sizes=1',
            '--platforms=cpu')
  assert run.returncode == 0, run.stderr[-2000:]
  assert json.loads((tmp_path / 'art2' / 'manifest.json').read_text())[
      'alpha'] == 0.9
  for args, message in [
      ([f'--workdir={tmp_path}/none'], 'is not a directory'),
      ([f'--workdir={tmp_path}'], 'is not a training workdir'),
      ([f'--workdir={trained_workdir}', '--beam_sizes=0'], 'beam sizes must'),
      ([f'--workdir={trained_workdir}', '--platforms=gpu'], 'unknown platforms'),
  ]:
    run = cli(*args, f'--out={tmp_path}/x')
    assert run.returncode == 2, run.stderr[-2000:]
    assert message in run.stderr and 'Traceback' not in run.stderr


@pytest.mark.slow
def test_warm_up_compiles_every_batch_size_once(artifact, sources):
  loaded = serving.load(str(artifact))
  assert loaded.row_counts() == [1, 2, 4, 8]  # exported with batch_size 8
  assert loaded.warm_up(beam_sizes=[1], widths=[16, 32]) == 8
  assert loaded.warm_up(beam_sizes=[1], widths=[16, 32]) == 0
  short = [t for t in sources if t.strip() and len(loaded.encode(t)) <= 32]
  for n in (1, 3, 8, len(short)):
    loaded(short[:n], beam_size=1)
  assert len(loaded._executables) == 8  # nothing compiled after the warm-up
