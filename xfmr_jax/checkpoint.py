"""Orbax checkpoints: the train state, the data iterator position and the config.

Checkpoints live in ``<workdir>/checkpoints/<step>/``; each holds ``state``
(parameters, optimiser state, step, RNG; each process writes its own shards,
and :func:`xfmr_jax.sharding.abstract_state` restores them onto any mesh),
``data`` (the input iterator's state, JSON; with several processes one state
per process, see :func:`gather_data_state`) and ``config`` (JSON). The last ``keep`` are kept, plus the best by
validation BLEU, whose score is stored with it (orbax's ``metrics`` item) so
that a restarted run still knows it. Saving is asynchronous; a step that is
already saved is not saved again (a run is deterministic: the same step holds
the same state). Restoring walks from the newest step to older ones; a damaged
or incomplete step is moved aside to ``<step>.damaged-<time>`` (never deleted)
with a warning, so it blocks no later save. Half-written temporary folders of
an interrupted save are removed when the checkpointer opens.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies


class CheckpointError(RuntimeError):
  """No checkpoint in a directory could be restored."""


class CheckpointWriteError(OSError):
  """A checkpoint could not be written (full disk, unwritable folder)."""


@contextlib.contextmanager
def _quiet_libraries():
  """Hold back orbax's and asyncio's own error logs (tracebacks, TensorStore
  specs) while a restore is tried: its outcome is reported in one line."""
  loggers = [logging.getLogger(n) for n in ('absl', 'asyncio')]
  levels = [lg.level for lg in loggers]
  for lg in loggers:
    lg.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    for lg, level in zip(loggers, levels):
      lg.setLevel(level)


class _NoMetricsNotice(logging.Filter):
  """Drops orbax's notice that a step was saved without metrics: with
  ``best_fn`` set it comes at every save between evaluations, by design."""

  def filter(self, record):
    return 'did not provide metrics' not in record.getMessage()


logging.getLogger('absl').addFilter(_NoMetricsNotice())


def _bleu(metrics):
  return metrics.get('bleu') if metrics else None


class Checkpointer:
  """A thin wrapper over ``ocp.CheckpointManager`` for one training run."""

  def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    preserve = policies.AnyPreservationPolicy([
        policies.LatestN(n=keep),
        policies.BestN(get_metric_fn=_bleu, reverse=False, n=1,
                       keep_checkpoints_without_metrics=False)])
    # best_fn makes orbax write each step's metrics beside it (the policy
    # above, not best_fn, decides what is kept).
    options = ocp.CheckpointManagerOptions(
        preservation_policy=preserve, best_fn=_bleu, best_mode='max',
        enable_async_checkpointing=async_save, create=True,
        cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=('state', 'data', 'config'),
        options=options)

  def save(self, step: int, state, data_state: dict, config: dict,
           metrics: dict | None = None) -> bool:
    """Start saving ``step`` (returns before the write finishes); False if
    ``step`` is saved already."""
    if step in self.manager.all_steps():
      return False
    with self._write_errors():
      return self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=ocp.args.JsonSave(data_state),
          config=ocp.args.JsonSave(config)), metrics=metrics, force=True)

  @contextlib.contextmanager
  def _write_errors(self):
    """An asynchronous write that failed (full disk, unwritable folder)
    surfaces at the next save or wait: as a CheckpointWriteError."""
    try:
      yield
    except (OSError, ValueError) as e:
      if isinstance(e, ValueError) and not any(  # TensorStore's write errors
          code in str(e) for code in ('RESOURCE_EXHAUSTED', 'PERMISSION_DENIED',
                                      'Error writing')):
        raise
      self.manager.reload()
      kept = self.steps()
      raise CheckpointWriteError(
          f'cannot write a checkpoint in {self.directory}: {e}; the newest '
          f'complete one there is kept (step {kept[-1] if kept else None})'
      ) from e

  def wait(self) -> None:
    with self._write_errors():
      self.manager.wait_until_finished()

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def restore(self, abstract_state, step: int | None = None):
    """Newest restorable ``(step, state, data_state, config)``, or ``None``.

    Args:
      abstract_state: a pytree of ``jax.ShapeDtypeStruct`` (with shardings
        for a sharded restore) describing the state to restore into.
      step: restore exactly this step (errors are raised, not skipped).
    """
    candidates = [step] if step is not None else self.steps()[::-1]
    for s in candidates:
      try:
        with _quiet_libraries():
          out = self.manager.restore(s, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract_state),
              data=ocp.args.JsonRestore(), config=ocp.args.JsonRestore()))
        return s, out['state'], out['data'], out['config']
      except Exception as e:  # a damaged checkpoint fails in many ways
        if step is not None:
          raise CheckpointError(
              f'checkpoint {s} in {self.directory} cannot be restored: '
              f'{type(e).__name__}: {e}') from e
        first_line = (str(e).splitlines() or [''])[0][:200]
        reason = f'{type(e).__name__}: {first_line}'
        aside = self._move_aside(s)
        logging.warning('checkpoint %d in %s is damaged or incomplete (%s); '
                        'moved to %s, trying the previous one', s,
                        self.directory, reason, aside)
    if candidates:
      raise CheckpointError(f'no checkpoint in {self.directory} could be '
                            f'restored (tried steps {candidates})')
    return None

  def _move_aside(self, step: int) -> str:
    """Rename the folder of ``step`` to ``<step>.damaged-<time>``; return it."""
    src = os.path.join(self.directory, str(step))
    dst = f'{src}.damaged-{time.strftime("%Y%m%d-%H%M%S")}'
    if jax.process_index() == 0 and os.path.isdir(src):
      os.replace(src, dst)
    self.manager.reload()
    return dst

  def best_step(self) -> int | None:
    """The kept step with the highest validation BLEU (None if none has one)."""
    return self.manager.best_step()

  def metrics(self, step: int) -> dict | None:
    """The metrics saved with ``step`` (None if it was saved without)."""
    return self.manager.metrics(step)

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()


def abstract_like(tree) -> Any:
  """``ShapeDtypeStruct`` pytree (keeping shardings) of a concrete pytree."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def gather_data_state(local: dict) -> dict:
  """The data-iterator state to save: ``local`` itself with one process, else
  ``{'per_process': [state of process 0, 1, ...]}`` gathered from all of them
  (each process reads its own shard of the data). Call on every process."""
  if jax.process_count() == 1:
    return local
  from jax.experimental import multihost_utils
  blob = np.frombuffer(json.dumps(local).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.int32(blob.size)))
  buf = np.zeros(int(sizes.max()), np.uint8)
  buf[:blob.size] = blob
  blobs = np.asarray(multihost_utils.process_allgather(buf))
  return {'per_process': [json.loads(blobs[i, :sizes[i]].tobytes())
                          for i in range(len(sizes))]}


def process_data_state(saved: dict) -> dict | None:
  """This process's data-iterator state from a saved one (see
  :func:`gather_data_state`), or ``None`` (with a warning) when the checkpoint
  was written by a different number of processes: the data shards differ, so
  the input pipeline starts afresh."""
  states = saved['per_process'] if 'per_process' in saved else [saved]
  if len(states) != jax.process_count():
    logging.warning('checkpoint data position was saved by %d processes, this '
                    'run has %d: the input pipeline starts from its beginning',
                    len(states), jax.process_count())
    return None
  return states[jax.process_index()]
