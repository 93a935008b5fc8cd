"""End-to-end runs of ``python -m experiments.train_wmt`` as a subprocess:
SIGKILL-and-resume equals an uninterrupted run; SIGTERM leaves a checkpoint."""
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.test_train import tiny_config
from xfmr_jax import checkpoint, optim, run_config, train_state

ROOT = pathlib.Path(__file__).resolve().parents[1]


def command(data_dir, workdir, stop_at=None, **changes):
  """``python -m experiments.train_wmt`` of the tiny config; with
  ``stop_at``, the same run through ``tests/fault_runner.py``, which signals
  itself at that point."""
  cfg = tiny_config(data_dir, **changes)
  flags = [f'--config.{k}={v}' for k, v in cfg.items() if k != 'model']
  flags += [f'--config.model.{k}={v}' for k, v in cfg.model.items()]
  runner = (['tests.fault_runner', f'--stop_at={stop_at}'] if stop_at
            else ['experiments.train_wmt'])
  return [sys.executable, '-m', *runner, f'--workdir={workdir}', *flags]


def checkpoints(workdir):
  d = pathlib.Path(workdir) / 'checkpoints'
  return sorted(int(p.name) for p in d.iterdir()
                if p.name.isdigit()) if d.exists() else []


def start(cmd):
  return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def wait_for_checkpoint(proc, workdir, step, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if any(s >= step for s in checkpoints(workdir)):
      return
    assert proc.poll() is None, proc.stdout.read()
    time.sleep(0.2)
  raise TimeoutError(f'no checkpoint >= {step} in {workdir}')


def final_params(data_dir, workdir, step):
  cfg = tiny_config(data_dir)
  model, tx = run_config.build_model(cfg, 300), optim.from_config(cfg)
  abstract = jax.eval_shape(lambda: train_state.init_state(model, tx, 0))
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                 async_save=False)
  restored = ckpt.restore(abstract, step)
  ckpt.close()
  return jax.device_get(restored[1])


def test_sigkill_and_resume_equals_uninterrupted(data_dir, tmp_path):
  steps = dict(num_train_steps=40, checkpoint_every=4, log_every=4)
  whole, broken = tmp_path / 'whole', tmp_path / 'broken'
  run = subprocess.run(command(data_dir, whole, **steps), cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr

  proc = start(command(data_dir, broken, **steps))
  wait_for_checkpoint(proc, broken, 12)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed_at = max(checkpoints(broken))
  assert killed_at < 40
  rerun = subprocess.run(command(data_dir, broken, **steps), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
  assert rerun.returncode == 0, rerun.stdout + rerun.stderr

  a, b = final_params(data_dir, whole, 40), final_params(data_dir, broken, 40)
  assert int(a.step) == int(b.step) == 40
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)  # bitwise


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(data_dir, tmp_path):
  cmd = command(data_dir, tmp_path, num_train_steps=100000,
                checkpoint_every=100000, eval_every=100000, log_every=1)
  proc = start(cmd)
  deadline = time.time() + 240
  jsonl = tmp_path / 'metrics.jsonl'
  while not (jsonl.exists() and jsonl.read_text().count('\n') >= 3):
    assert proc.poll() is None and time.time() < deadline
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out
  saved = checkpoints(tmp_path)
  assert len(saved) == 1 and 3 <= saved[0] < 100000, (saved, out)
  assert 'SIGTERM' in out


def test_unknown_config_field_is_rejected_before_training(data_dir, tmp_path):
  cmd = command(data_dir, tmp_path) + ['--config.no_such_field=3']
  result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode != 0
  assert 'no_such_field' in result.stderr
  assert not (tmp_path / 'checkpoints').exists()


def test_bad_value_is_rejected_with_a_clear_message(data_dir, tmp_path):
  cmd = command(data_dir, tmp_path) + ['--config.model.num_heads=3']
  result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 2
  assert 'not divisible' in result.stderr
  assert not (tmp_path / 'checkpoints').exists()


@pytest.fixture(scope='module')
def whole_run(data_dir, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('whole')
  run = subprocess.run(command(data_dir, workdir, **KILL_STEPS), cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  return workdir


KILL_STEPS = dict(num_train_steps=16, checkpoint_every=4, log_every=4,
                  eval_every=8)


@pytest.mark.slow
@pytest.mark.parametrize('point', ['save:8', 'eval'])
def test_sigkill_during_a_save_or_an_evaluation_then_resume(
    data_dir, tmp_path, whole_run, point):
  killed = subprocess.run(
      command(data_dir, tmp_path, stop_at=f'kill:{point}', **KILL_STEPS),
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert killed.returncode == -signal.SIGKILL
  rerun = subprocess.run(command(data_dir, tmp_path, **KILL_STEPS), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
  assert rerun.returncode == 0, rerun.stdout + rerun.stderr
  assert not [p for p in (tmp_path / 'checkpoints').iterdir()
              if 'tmp' in p.name]  # the half-written save was cleaned up
  a, b = final_params(data_dir, whole_run, 16), final_params(data_dir,
                                                             tmp_path, 16)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)  # bitwise
