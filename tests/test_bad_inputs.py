"""Bad input to the entry points: one line on stderr that names the problem,
exit code 2, no traceback, and the workdir left as it was.

Each case runs the real command line in a subprocess (a few seconds each).
"""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest

from tests.conftest import TRAINED, TRAINED_MODEL
from tests.test_train import tiny_config
from xfmr_jax import checkpoint, optim, run_config, train_state

ROOT = pathlib.Path(__file__).resolve().parents[1]


def train_command(data_dir, workdir, *extra, **changes):
  cfg = tiny_config(data_dir, **changes)
  flags = [f'--config.{k}={v}' for k, v in cfg.items() if k != 'model']
  flags += [f'--config.model.{k}={v}' for k, v in cfg.model.items()]
  return [sys.executable, '-m', 'experiments.train_wmt',
          f'--workdir={workdir}', *flags, *extra]


def snapshot(path: pathlib.Path) -> dict:
  if not path.exists():
    return {}
  if path.is_file():
    return {path: path.read_bytes()}
  return {p: p.read_bytes() for p in sorted(path.rglob('*')) if p.is_file()}


def assert_rejected(cmd, workdir, expected, stdin=b''):
  before = snapshot(workdir)
  result = subprocess.run(cmd, cwd=ROOT, input=stdin, capture_output=True,
                          timeout=300)
  err = result.stderr.decode()
  lines = [l for l in err.splitlines() if l.strip()]
  errors = [l for l in lines if l.startswith('error: ')]
  assert result.returncode == 2, err
  assert 'Traceback' not in err, err
  # One error line, last (a warning about what was skipped may precede it).
  assert len(errors) == 1 and lines[-1] == errors[0], err
  assert expected in errors[0], err
  assert snapshot(workdir) == before  # nothing written, nothing lost
  assert result.stdout == b''


def _tsv(tmp_path, name, text):
  (tmp_path / name).write_bytes(text)
  return f'tsv:{tmp_path}/{{split}}.tsv'


GOOD = b'hallo welt\thello world\neins\tone\n' * 20


@pytest.mark.parametrize('case, expected', [
    (dict(extra=['--config.no_such_field=3']), "unknown config field 'no_such_field'"),
    (dict(extra=['--config=/nonexistent/toy.py']), "'/nonexistent/toy.py' does not exist"),
    (dict(dataset='toy_translatex'), "config.dataset='toy_translatex' is unknown"),
    (dict(dataset='toy_translate/huge'), 'huge'),
    (dict(dataset='wmt14_translate/fr-en'), "unknown dataset 'wmt14_translate/fr-en'"),
    (dict(dataset='wmt14_translate/de-en'), 'is not prepared as array_record'),
    (dict(tsv={'train': b'no tab here\n'}), 'expected source<TAB>target'),
    (dict(tsv={'train': b'a\tb\tc\n'}), 'expected source<TAB>target'),
    (dict(tsv={'train': b'\xff\xfe\tx\n'}), 'invalid UTF-8'),
    (dict(tsv={'train': GOOD, 'validation': GOOD}), 'test.tsv'),
    (dict(tsv={'train': b'\n\n', 'validation': GOOD, 'test': GOOD}), 'train'),
    (dict(eval_batches=0), 'config.eval_batches must be a positive integer'),
    (dict(max_decode_extra=-1), 'config.max_decode_extra'),
    (dict(lr_scale=-1.0), 'config.lr_scale must be > 0'),
    (dict(garbage_tokenizer=True), 'not a SentencePiece model'),
    (dict(workdir_is_file=True), 'is a file, not a directory'),
])
def test_train_wmt_rejects_bad_input(data_dir, tmp_path, case, expected):
  workdir = tmp_path / 'run'
  changes = {k: v for k, v in case.items()
             if k not in ('extra', 'tsv', 'garbage_tokenizer',
                          'workdir_is_file')}
  if 'tsv' in case:
    for split, text in case['tsv'].items():
      changes['dataset'] = _tsv(tmp_path, f'{split}.tsv', text)
  if case.get('garbage_tokenizer'):
    (tmp_path / 'bad.model').write_bytes(b'not a model')
    changes['tokenizer_path'] = str(tmp_path / 'bad.model')
  if case.get('workdir_is_file'):
    workdir.write_text('a file')
  cmd = train_command(data_dir, workdir, **changes)
  extra = case.get('extra', [])
  cmd = cmd[:3] + extra + cmd[3:]  # as a user writes it: --config first
  assert_rejected(cmd, workdir, expected)


@pytest.mark.slow
def test_resuming_with_another_model_names_the_fields(data_dir, tmp_path):
  workdir = tmp_path / 'run'
  ok = subprocess.run(train_command(data_dir, workdir, num_train_steps=4,
                                    checkpoint_every=4, log_every=2),
                      cwd=ROOT, capture_output=True, timeout=300)
  assert ok.returncode == 0, ok.stderr.decode()
  cmd = train_command(data_dir, workdir, '--config.model.d_model=48',
                      '--config.vocab_size=200', num_train_steps=8)
  assert_rejected(cmd, workdir, 'model.d_model (32 there, 48 here)')
  assert_rejected(cmd, workdir, 'vocab_size (300 there, 200 here)')


@pytest.mark.parametrize('flags, expected', [
    (['--batch_size=-3'], '--batch_size must be at least 1, got -3'),
    (['--batch_size=0'], '--batch_size must be at least 1, got 0'),
    (['--beam_size=0'], '--beam_size must be at least 1'),
    (['--max_decode_extra=-100'], '--max_decode_extra must be at least 0'),
    (['--top_p=0'], '--top_p must be in (0, 1]'),
    (['--nbest=5'], '--nbest 5 is more than --beam_size 4'),
    (['--repetition_penalty=0'], '--repetition_penalty must be > 0'),
    (['--nbest=2', '--temperature=0.5'], '--nbest needs beam search'),
    (['--nbest=2', '--alignments'], '--alignments and --nbest cannot be'),
    (['--prefixes=/nonexistent/p.txt'], "--prefixes '/nonexistent/p.txt' is "
     'not a file'),
    (['--document', '--alignments'], '--document translates a whole text'),
    (['--score=/etc/hostname', '--nbest=2'], '--score scores given '
     'translations; it cannot be combined'),
    (['--constraints=/etc/hostname', '--beam_size=1'], '--constraints needs '
     'beam search'),
    (['--workdir=/nonexistent/run'], 'is not a directory'),
])
def test_translate_rejects_bad_flags(trained_workdir, flags, expected):
  cmd = [sys.executable, '-m', 'experiments.translate',
         f'--workdir={trained_workdir}',
         *flags]
  assert_rejected(cmd, trained_workdir, expected, stdin=b'eins\nzwei\n')


def test_translate_names_a_damaged_config_file(trained_workdir, tmp_path):
  broken = tmp_path / 'broken'
  broken.mkdir()
  for p in trained_workdir.iterdir():
    if p.is_file():
      (broken / p.name).write_bytes(p.read_bytes())
  (broken / 'checkpoints').symlink_to(trained_workdir / 'checkpoints')
  (broken / 'config.json').write_text('{not json')
  cmd = [sys.executable, '-m', 'experiments.translate', f'--workdir={broken}']
  assert_rejected(cmd, broken, 'config.json cannot be read as JSON',
                  stdin=b'eins\n')


def _translate_command(workdir):
  return [sys.executable, '-m', 'experiments.translate', f'--workdir={workdir}']


def _zero_fill_largest(step_dir):
  """Zeros over a step's largest array file (its metadata stays readable, so
  the restore fails part-way, with reads in flight)."""
  f = max((p for p in (step_dir / 'state').rglob('*') if p.is_file()),
          key=lambda p: p.stat().st_size)
  f.write_bytes(b'\0' * f.stat().st_size)


@pytest.fixture
def garbage_workdir(trained_workdir, tmp_path):
  """A copy of ``trained_workdir`` whose only checkpoint is unreadable."""
  wd = tmp_path / 'garbage'
  shutil.copytree(trained_workdir, wd)
  _zero_fill_largest(wd / 'checkpoints' / '380')
  return wd


def test_translate_with_an_edited_config_names_the_field(trained_workdir,
                                                         tmp_path):
  """A config that no longer matches the checkpoints is a config error, not
  damage: translate (a read-only command) renames nothing."""
  wd = tmp_path / 'edited'
  shutil.copytree(trained_workdir, wd)
  config = json.loads((wd / 'config.json').read_text())
  config['model']['d_model'] = 96
  (wd / 'config.json').write_text(json.dumps(config))
  assert_rejected(_translate_command(wd), wd,
                  'config.json does not match checkpoint 380: model.d_model '
                  '(64 there, 96 here)', stdin=b'eins\n')


def test_translate_when_no_checkpoint_restores_changes_nothing(
    garbage_workdir):
  assert_rejected(_translate_command(garbage_workdir), garbage_workdir,
                  'no checkpoint in', stdin=b'eins\n')


def test_training_when_no_checkpoint_restores_changes_nothing(
    data_dir, garbage_workdir):
  model = [f'--config.model.{k}={v}' for k, v in TRAINED_MODEL.items()]
  cmd = train_command(data_dir, garbage_workdir, *model,
                      **{**TRAINED, 'num_train_steps': 400})
  assert_rejected(cmd, garbage_workdir, 'nothing was moved or deleted')


def test_translate_skips_a_damaged_newest_checkpoint_in_one_line(
    trained_workdir, tmp_path):
  """The newest step is damaged: one warning line names it, the one before
  translates, and the read-only command leaves the damaged step in place."""
  wd = tmp_path / 'damaged'
  shutil.copytree(trained_workdir, wd)
  shutil.copytree(wd / 'checkpoints' / '380', wd / 'checkpoints' / '400')
  _zero_fill_largest(wd / 'checkpoints' / '400')
  before = snapshot(wd)
  result = subprocess.run(_translate_command(wd), cwd=ROOT,
                          input=b'eins\nzwei\n', capture_output=True,
                          timeout=300)
  err = result.stderr.decode()
  assert result.returncode == 0, err
  assert len(result.stdout.decode().splitlines()) == 2
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1, err[-3000:]
  assert 'checkpoint 400' in lines[0] and 'damaged' in lines[0], err
  assert 'TensorStore details' not in lines[0]
  assert snapshot(wd) == before


def test_a_failed_run_ends_in_its_own_line_while_threads_still_print():
  """Writer threads of a failed run (orbax's, after a full disk) may go on
  printing half lines; the error is still the last line, on its own."""
  script = """
import sys, threading, time
from experiments import entry
def chatter():
  while True:
    sys.stderr.write('    ')
    time.sleep(0.0001)
    sys.stderr.write('RuntimeError: Event loop is closed\\n')
for _ in range(4):
  threading.Thread(target=chatter, daemon=True).start()
sys.stderr.write('train:  30%|###   | 12/40')  # a progress bar's half line
time.sleep(0.05)
entry.fail('cannot write a checkpoint in /x: full', entry.FAILED)
"""
  for _ in range(5):
    result = subprocess.run([sys.executable, '-c', script], cwd=ROOT,
                            capture_output=True, timeout=60)
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert err.splitlines()[-1] == 'error: cannot write a checkpoint in /x: ' \
        'full', err[-500:]
    assert err.endswith('\n')


@pytest.fixture
def small_disk(tmp_path):
  """A 1.2 MB tmpfs: room for one tiny checkpoint, not for three."""
  mount = tmp_path / 'disk'
  mount.mkdir()
  if subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1200k', 'tmpfs',
                     str(mount)], capture_output=True).returncode:
    pytest.skip('cannot mount a small tmpfs here (needs root)')
  yield mount
  subprocess.run(['umount', str(mount)], check=False)


def test_full_disk_ends_in_one_line_and_keeps_the_last_checkpoint(
    data_dir, small_disk):
  workdir = small_disk / 'run'
  cmd = train_command(data_dir, workdir, num_train_steps=40,
                      checkpoint_every=4, log_every=4, keep_checkpoints=100)
  result = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=300)
  err = result.stderr.decode()
  assert result.returncode == 1, err
  # (Orbax's writer threads may log their own tracebacks before this line.)
  last = err.strip().splitlines()[-1]
  # Whichever write finds the disk full first (a checkpoint's file, a
  # TensorStore chunk, metrics.jsonl) is named.
  assert re.match(r'error: .*cannot write (a checkpoint|the metrics) in ',
                  last), err
  assert 'No space left on device' in last or 'RESOURCE_EXHAUSTED' in last, \
      last
  kept = max(int(p.name) for p in (workdir / 'checkpoints').iterdir()
             if p.name.isdigit())
  cfg = tiny_config(data_dir)
  model, tx = run_config.build_model(cfg, 300), optim.from_config(cfg)
  abstract = jax.eval_shape(lambda: train_state.init_state(model, tx, 0))
  ckpt = checkpoint.Checkpointer(str(workdir / 'checkpoints'),
                                 async_save=False)
  try:
    assert ckpt.restore(abstract)[0] == kept  # the newest complete one
  finally:
    ckpt.close()


@pytest.fixture
def shared_dir():
  """A folder that another user can reach (pytest's own are root-only)."""
  path = pathlib.Path(tempfile.mkdtemp(prefix='xfmr-shared-'))
  os.chmod(path, 0o755)
  yield path
  shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_unwritable_checkpoint_folder_keeps_the_last_checkpoint(
    data_dir, shared_dir):
  """As a user who may not write the checkpoint folder (root may write
  anywhere, so the run is made as 'nobody')."""
  as_nobody = ['setpriv', '--reuid=65534', '--regid=65534', '--clear-groups']
  if os.geteuid() != 0 or not shutil.which('setpriv'):
    pytest.skip('needs root and setpriv to run as another user')
  if subprocess.run(as_nobody + [sys.executable, '-c', 'import xfmr_jax'],
                    cwd=ROOT, capture_output=True).returncode:
    pytest.skip('this Python environment is not readable by another user')
  shared = shared_dir
  shutil.copytree(data_dir, shared / 'data')
  (shared / 'home').mkdir()
  workdir = shared / 'run'
  for p in [shared, *shared.rglob('*')]:
    os.chown(p, 65534, 65534)
  # Without the suite's compilation cache: its folder is root's.
  env = {**{k: v for k, v in os.environ.items()
            if not k.startswith('JAX_COMPILATION_CACHE')},
         'HOME': str(shared / 'home')}
  steps = dict(checkpoint_every=4, log_every=4, async_checkpoints=False)
  first = subprocess.run(
      as_nobody + train_command(shared / 'data', workdir, num_train_steps=4,
                                **steps),
      cwd=ROOT, env=env, capture_output=True, timeout=300)
  assert first.returncode == 0, first.stderr.decode()
  os.chown(workdir / 'checkpoints', 0, 0)  # now read-only for the run
  second = subprocess.run(
      as_nobody + train_command(shared / 'data', workdir, num_train_steps=12,
                                **steps),
      cwd=ROOT, env=env, capture_output=True, timeout=300)
  err = second.stderr.decode()
  assert second.returncode == 1, err
  last = err.strip().splitlines()[-1]
  assert last.startswith('error: cannot write a checkpoint in '), err
  assert 'step 4' in last, last
  assert sorted(p.name for p in (workdir / 'checkpoints').iterdir()) == ['4']
