"""Preparing WMT without TensorFlow, offline: a miniature of the WMT14 downloads
(tests/wmt_miniature.py) goes through TFDS's own builder and download manager,
is read back with ``tfds.data_source`` and trains the model.
"""
import http.server
import importlib.util
import json
import pathlib
import subprocess
import sys
import threading

import pytest
import sacrebleu

from tests import wmt_miniature
from tests.test_train import tiny_config
from xfmr_jax.data import DataError, wmt_prepare

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = 'wmt14_translate/de-en'


def _expect_checksums(monkeypatch, url_infos):
  """TFDS validates the wmt14 downloads against ``url_infos``."""
  from tensorflow_datasets.translate import wmt14
  monkeypatch.setattr(wmt14.Wmt14Translate, 'url_infos', url_infos,
                      raising=False)


def _state(folder: pathlib.Path) -> dict:
  """(inode, mtime) of every file under folder: rewritten files change it."""
  return {p: (p.stat().st_ino, p.stat().st_mtime_ns)
          for p in folder.rglob('*') if p.is_file()}


def test_wmt14_prepares_without_tensorflow_reads_back_and_trains(
    tmp_path, monkeypatch):
  # TensorFlow absent is what makes this test prove anything: with it, TFDS
  # would quietly use it.
  assert importlib.util.find_spec('tensorflow') is None, (
      'run in the TensorFlow-free install: this test shows TFDS preparation '
      'works without TensorFlow')
  data_dir, manual = tmp_path / 'tfds', tmp_path / 'archives'
  # The README's command, as a user runs it (with TFDS told the miniature
  # archives' checksums, which differ from the real ones).
  command = [sys.executable, '-m', 'tests.wmt_miniature', str(manual),
             f'--dataset={NAME}', f'--data_dir={data_dir}',
             f'--manual_dir={manual}']
  run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'tensorflow imported: False' in run.stderr
  assert 'Generating examples from: europarl_v7' in run.stderr  # progress
  expected = wmt_miniature.split_pairs()
  assert (f'ready in {data_dir}: train {len(expected["train"])} pairs, '
          f'validation {len(expected["validation"])} pairs, test '
          f'{len(expected["test"])} pairs') in run.stdout

  import tensorflow_datasets as tfds
  sources = tfds.data_source(NAME, data_dir=str(data_dir))
  for split, pairs in expected.items():
    got = {(e['de'].decode(), e['en'].decode()) for e in sources[split]}
    assert got == pairs, split

  # Interrupted after extracting (the built dataset is gone): the next run
  # builds again from the extracted files without extracting them again.
  extracted = _state(data_dir / 'downloads' / 'extracted')
  assert len(extracted) == 10  # 2 files each in 3 archives, 4 in dev.tgz
  built = data_dir / 'wmt14_translate' / 'de-en' / '1.0.0'
  for f in built.iterdir():
    f.unlink()
  built.rmdir()
  _expect_checksums(monkeypatch, wmt_miniature.url_infos(manual))
  counts = wmt_prepare.prepare(NAME, str(data_dir), manual_dir=str(manual))
  assert counts == {s: len(p) for s, p in expected.items()}
  assert _state(data_dir / 'downloads' / 'extracted') == extracted
  finished = _state(built)
  assert wmt_prepare.prepare(NAME, str(data_dir)) == counts  # nothing to do
  assert _state(built) == finished

  # The normal trainer, English to German as in the paper; the final metrics
  # carry the sacreBLEU signature of the newstest2014 score.
  from xfmr_jax import training_loop
  cfg = tiny_config(data_dir, dataset='wmt14_translate/en-de',
                    num_train_steps=4, checkpoint_every=4, vocab_size=120,
                    test_samples=0, bleu_samples=4)
  workdir = tmp_path / 'run'
  metrics = training_loop.train_and_evaluate(cfg, str(workdir))
  saved = json.loads((workdir / 'final_metrics.json').read_text())
  assert saved['step'] == 4 and saved['test_sentences'] == len(
      expected['test'])
  assert saved['bleu_signature'] == metrics['bleu_signature']
  assert saved['bleu_signature'].startswith('nrefs:1|case:mixed|eff:no|tok:13a')
  assert saved['bleu_signature'].endswith(f'version:{sacrebleu.__version__}')
  assert 'tensorflow' not in sys.modules


def test_a_damaged_archive_is_named(tmp_path, monkeypatch):
  manual = tmp_path / 'archives'
  infos = wmt_miniature.write_archives(manual)
  dev = manual / 'dev.tgz'
  dev.write_bytes(dev.read_bytes()[:200])  # cut short, as a broken download
  url = 'http://data.statmt.org/wmt19/translation-task/dev.tgz'
  infos[url] = wmt_miniature.url_info(dev)  # its checksum passes: damaged
  _expect_checksums(monkeypatch, infos)
  with pytest.raises(DataError, match=f'damaged archive {dev}'):
    wmt_prepare.prepare(NAME, str(tmp_path / 'tfds'), manual_dir=str(manual))
  # Nothing half-extracted is left to be reused by the next run.
  extracted = tmp_path / 'tfds' / 'downloads' / 'extracted'
  assert not list(extracted.glob('*dev.tgz*'))


def test_a_file_that_differs_from_the_registered_one_is_named(tmp_path):
  # The miniature archives against TFDS's real registered checksums.
  manual = tmp_path / 'archives'
  wmt_miniature.write_archives(manual)
  with pytest.raises(DataError, match=r'Artifact http://\S+\.tgz, downloaded'
                     f' to {manual}/\\S+, has wrong checksum'):
    wmt_prepare.prepare(NAME, str(tmp_path / 'tfds'), manual_dir=str(manual))


class _NotFound(http.server.BaseHTTPRequestHandler):
  def do_GET(self):  # pylint: disable=invalid-name
    self.send_error(404)

  def log_message(self, *args):
    pass


def test_an_unreachable_url_is_named(tmp_path, monkeypatch):
  # Every request goes to a local proxy that answers 404: no network used.
  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _NotFound)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    monkeypatch.setenv('HTTP_PROXY', f'http://127.0.0.1:{server.server_port}')
    for name in ('NO_PROXY', 'no_proxy', 'http_proxy'):
      monkeypatch.delenv(name, raising=False)
    with pytest.raises(wmt_prepare.DownloadFailed,
                       match=r'http://www\.statmt\.org/\S+\.tgz'):
      wmt_prepare.prepare(NAME, str(tmp_path / 'tfds'),
                          manual_dir=str(tmp_path / 'empty'))
  finally:
    server.shutdown()


@pytest.mark.parametrize('flags, expected', [
    (['--dataset=wmt19_translate/de-en', '--data_dir={tmp}'],
     "unknown dataset 'wmt19_translate/de-en'; prepare_data builds"),
    (['--data_dir={tmp}/a_file/tfds'], 'is not writable'),
    ([], '--data_dir is required'),
])
def test_prepare_data_rejects_bad_input_in_one_line(tmp_path, flags, expected):
  (tmp_path / 'a_file').write_text('not a folder')
  flags = [f.format(tmp=tmp_path) for f in flags]
  run = subprocess.run([sys.executable, '-m', 'experiments.prepare_data',
                        *flags], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
  lines = [l for l in run.stderr.splitlines() if l.strip()]
  assert run.returncode == 2, run.stderr
  assert 'Traceback' not in run.stderr
  assert lines[-1].startswith('error: ') and expected in lines[-1], run.stderr
