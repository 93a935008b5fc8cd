"""Orbax checkpoints: the train state, the data iterator position and the config.

Checkpoints live in ``<workdir>/checkpoints/<step>/``; each holds ``state``
(parameters, optimiser state, step, RNG; each process writes its own shards,
and :func:`xfmr_jax.sharding.abstract_state` restores them onto any mesh),
``data`` (the input iterator's state, JSON; with several processes one state
per process, see :func:`gather_data_state`) and ``config`` (JSON). The last ``keep`` are kept, plus the best by
validation BLEU. Saving is asynchronous. Restoring walks from the newest step to
older ones and skips a damaged or incomplete checkpoint with a warning.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies


class CheckpointError(RuntimeError):
  """No checkpoint in a directory could be restored."""


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
    options = ocp.CheckpointManagerOptions(
        preservation_policy=preserve, enable_async_checkpointing=async_save,
        create=True)
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=('state', 'data', 'config'),
        options=options)

  def save(self, step: int, state, data_state: dict, config: dict,
           metrics: dict | None = None) -> None:
    """Start saving ``step`` (returns before the write finishes)."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(config)), metrics=metrics, force=True)

  def wait(self) -> None:
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
        out = self.manager.restore(s, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(), config=ocp.args.JsonRestore()))
        return s, out['state'], out['data'], out['config']
      except Exception as e:  # a damaged checkpoint fails in many ways
        if step is not None:
          raise CheckpointError(
              f'checkpoint {s} in {self.directory} cannot be restored: '
              f'{type(e).__name__}: {e}') from e
        logging.warning('checkpoint %d in %s is damaged or incomplete (%s: '
                        '%s); trying the previous one', s, self.directory,
                        type(e).__name__, str(e).splitlines()[0][:200])
    if candidates:
      raise CheckpointError(f'no checkpoint in {self.directory} could be '
                            f'restored (tried steps {candidates})')
    return None

  def close(self) -> None:
    self.manager.wait_until_finished()
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
