"""Every interruption and every damaged checkpoint ends in a run that finishes
as an uninterrupted one does: same parameters, optimiser state, step and data
position, bit for bit, and one metrics row per step.

In-process runs of the tiny config; SIGTERM comes from the run itself at a
named point (``training_loop.fault_hook``, see ``tests/fault_runner.py``), so
each case is deterministic. The subprocess SIGKILL cases are in
``test_resume.py``.
"""
import collections
import json
import os
import pathlib

import jax
import numpy as np
import pytest

from tests.fault_runner import stop_at
from tests.test_train import tiny_config
from xfmr_jax import checkpoint, optim, run_config, train_state, training_loop

STEPS = dict(num_train_steps=16, checkpoint_every=4, eval_every=8, log_every=4)


def run(data_dir, workdir, sigterm_at=None, **changes):
  """A run of the tiny config that sends itself SIGTERM at the point
  ``sigterm_at`` (None: runs to its end)."""
  training_loop.fault_hook = stop_at(sigterm_at) if sigterm_at else None
  try:
    return training_loop.train_and_evaluate(
        tiny_config(data_dir, **{**STEPS, **changes}), str(workdir))
  finally:
    training_loop.fault_hook = None


def saved_steps(workdir):
  d = pathlib.Path(workdir) / 'checkpoints'
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit())


def final_state(data_dir, workdir, step=16):
  """(train state, data-iterator state) of checkpoint ``step``."""
  cfg = tiny_config(data_dir)
  model, tx = run_config.build_model(cfg, 300), optim.from_config(cfg)
  abstract = jax.eval_shape(lambda: train_state.init_state(model, tx, 0))
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                 async_save=False)
  try:
    _, state, data_state, _ = ckpt.restore(abstract, step)
  finally:
    ckpt.close()
  return jax.device_get(state), data_state


def metric_rows(workdir):
  return [json.loads(l) for l in open(pathlib.Path(workdir) / 'metrics.jsonl')]


@pytest.fixture(scope='module')
def reference(data_dir, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('uninterrupted')
  final = run(data_dir, workdir)
  return workdir, final, final_state(data_dir, workdir)


def assert_same_run(data_dir, workdir, reference):
  ref_dir, ref_final, (ref_state, ref_data) = reference
  state, data_state = final_state(data_dir, workdir)
  assert data_state == ref_data
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    np.testing.assert_array_equal(a, b)
  final = json.load(open(pathlib.Path(workdir) / 'final_metrics.json'))
  for key in ('step', 'exact_match', 'bleu', 'eval_loss'):
    assert final[key] == ref_final[key], key
  rows = collections.Counter((r['step'], r['split'])
                             for r in metric_rows(workdir))
  assert max(rows.values()) == 1, rows  # one row per step and split
  assert set(rows) == {(r['step'], r['split']) for r in metric_rows(ref_dir)}


@pytest.mark.parametrize('point', ['step:6'] + [
    pytest.param(p, marks=pytest.mark.slow)
    for p in ('eval', 'final_save', 'final_eval')])
def test_sigterm_anywhere_then_resume_equals_uninterrupted(
    data_dir, tmp_path, reference, point):
  stopped = run(data_dir, tmp_path, sigterm_at=point)
  assert stopped['stopped_by'] == 'SIGTERM'
  assert not (tmp_path / 'final_metrics.json').exists()
  # Exactly the checkpoint of the step it stopped at, and no temporary folder.
  assert saved_steps(tmp_path)[-1] == stopped['step']
  assert not [p for p in (tmp_path / 'checkpoints').iterdir()
              if 'tmp' in p.name]
  run(data_dir, tmp_path)
  assert_same_run(data_dir, tmp_path, reference)


def _truncate(path):
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _zero_fill(path):
  path.write_bytes(b'\0' * path.stat().st_size)


def _damage(step_dir, kind):
  files = sorted((p for p in (step_dir / 'state').rglob('*')
                  if p.is_file() and p.stat().st_size > 0),
                 key=lambda p: -p.stat().st_size)
  if kind == 'metadata':
    (step_dir / 'state' / '_METADATA').unlink()
  else:
    (_truncate if kind == 'truncated' else _zero_fill)(files[0])


@pytest.mark.parametrize('kind', ['truncated'] + [
    pytest.param(k, marks=pytest.mark.slow) for k in ('metadata', 'zero_filled')])
def test_damaged_newest_checkpoint_is_moved_aside_and_the_run_finishes(
    data_dir, tmp_path, reference, kind):
  stopped = run(data_dir, tmp_path, sigterm_at='step:12')
  assert stopped['step'] == 12
  _damage(tmp_path / 'checkpoints' / '12', kind)
  run(data_dir, tmp_path)  # resumes from 8, trains through 12 again
  aside = [p.name for p in (tmp_path / 'checkpoints').iterdir()
           if p.name.startswith('12.damaged-')]
  assert len(aside) == 1, aside
  assert_same_run(data_dir, tmp_path, reference)


@pytest.mark.slow
def test_best_checkpoint_and_its_score_survive_a_restart(data_dir, tmp_path):
  changes = dict(keep_checkpoints=1, eval_every=4, checkpoint_every=4,
                 lr_scale=1.0)
  run(data_dir, tmp_path, sigterm_at='step:9', **changes)
  run(data_dir, tmp_path, **changes)  # a new process: scores come from disk
  logged = {r['step']: r['bleu'] for r in metric_rows(tmp_path)
            if r['split'] == 'eval'}
  assert sorted(logged) == [4, 8, 12]
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'checkpoints'))
  try:
    best = ckpt.best_step()
    kept = ckpt.steps()
    scored = {s: ckpt.metrics(s) for s in kept}
  finally:
    ckpt.close()
  assert best in kept and 16 in kept and len(kept) == 2, kept
  assert scored[best]['bleu'] == pytest.approx(max(logged.values()))
  assert scored[best]['bleu'] == pytest.approx(logged[best])
