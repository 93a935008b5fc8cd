"""Orbax checkpoints: the train state, the data iterator position and the config.

Checkpoints live in ``<workdir>/checkpoints/<step>/``; each holds ``state``
(parameters, optimiser state, step, RNG; each process writes its own shards,
and :func:`xfmr_jax.sharding.abstract_state` restores them onto any mesh),
``data`` (the input iterator's state, JSON; with several processes one state
per process, see :func:`gather_data_state`) and ``config`` (JSON). The last ``keep`` are kept, plus the best by
validation BLEU, whose score is stored with it (orbax's ``metrics`` item) so
that a restarted run still knows it. Saving is asynchronous; a step that is
already saved is not saved again (a run is deterministic: the same step holds
the same state). Restoring walks from the newest step to older ones, one
warning line for each damaged or incomplete step it skips (the library's own
report of it is logged at debug level). A training run, once an older step has
restored, moves the skipped ones aside to ``<step>.damaged-<time>`` (never
deleted) so that they block no later save; when no step restores, nothing is
moved. A read-only checkpointer (translate, export) never renames, deletes or
creates anything. A checkpoint whose arrays have other shapes than the model
asks for is not damaged but belongs to another config: a
:class:`CheckpointMismatch`, raised before anything is read. Half-written
temporary folders of an interrupted save are removed when a writable
checkpointer opens.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
import time
from typing import Any

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies


class CheckpointError(RuntimeError):
  """No checkpoint in a directory could be restored."""


class CheckpointMismatch(CheckpointError):
  """A checkpoint holds arrays of other shapes than the model built from the
  config (the config or the tokenizer changed since it was written).

  Attributes:
    step: the checkpoint's step.
  """

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


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


class _ExpectedNotices(logging.Filter):
  """Drops orbax's notices of what this module asked for: that a step was
  saved without metrics (with ``best_fn`` set it comes at every save between
  evaluations) and that a read-only checkpointer will not save."""

  NOTICES = ('did not provide metrics', 'read_only=True, setting',
             'Given directory is read only')

  def filter(self, record):
    return not any(n in record.getMessage() for n in self.NOTICES)


logging.getLogger('absl').addFilter(_ExpectedNotices())


class _AbandonedReads(logging.Filter):
  """The leftovers of a restore that failed part-way, which would otherwise
  print a traceback each, seconds later and from other threads: TensorStore
  reads that finish after orbax closed their event loop, and orbax's
  coroutines, tasks and futures that are collected with an exception nobody
  read. Installed when a restore starts; everything else passes on to the
  hook it replaced."""

  def __init__(self, next_hook=None):
    super().__init__()
    self.next_hook = next_hook

  @staticmethod
  def _ours(exc, obj) -> bool:
    code = getattr(obj, 'cr_code', None)
    return ((isinstance(exc, RuntimeError) and 'Event loop is closed' in
             str(exc)) or (code is not None and 'orbax' in code.co_filename))

  def __call__(self, unraisable):  # as sys.unraisablehook
    if not self._ours(unraisable.exc_value, unraisable.object):
      self.next_hook(unraisable)

  def filter(self, record):  # on asyncio's logger
    if 'never retrieved' not in record.getMessage():
      return True
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None and 'orbax' not in tb.tb_frame.f_code.co_filename:
      tb = tb.tb_next
    return tb is None and not any(  # a TensorStore read's own future
        m in record.getMessage() for m in ('orbax', 'OCDBT', 'TensorStore'))


_ASYNCIO_FILTER = _AbandonedReads()


def _hide_abandoned_reads() -> None:
  # Checked each time: a test runner (pytest) puts its own hook back.
  if not isinstance(sys.unraisablehook, _AbandonedReads):
    sys.unraisablehook = _AbandonedReads(sys.unraisablehook)
  asyncio_log = logging.getLogger('asyncio')
  if _ASYNCIO_FILTER not in asyncio_log.filters:
    asyncio_log.addFilter(_ASYNCIO_FILTER)


def _leaf_name(path) -> str:
  """``params.decoder_0.mlp.kernel``: a leaf's path as orbax names it."""
  return '.'.join(str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name',
                                                                   k))))
                  for k in path)


def _shapes(tree) -> dict:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {_leaf_name(p): tuple(leaf.shape) for p, leaf in leaves}


def _bleu(metrics):
  return metrics.get('bleu') if metrics else None


class Checkpointer:
  """A thin wrapper over ``ocp.CheckpointManager`` for one training run."""

  def __init__(self, directory: str, keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    self.directory = os.path.abspath(directory)
    self.read_only = read_only
    preserve = policies.AnyPreservationPolicy([
        policies.LatestN(n=keep),
        policies.BestN(get_metric_fn=_bleu, reverse=False, n=1,
                       keep_checkpoints_without_metrics=False)])
    # best_fn makes orbax write each step's metrics beside it (the policy
    # above, not best_fn, decides what is kept).
    options = ocp.CheckpointManagerOptions(
        preservation_policy=preserve, best_fn=_bleu, best_mode='max',
        enable_async_checkpointing=async_save, create=not read_only,
        cleanup_tmp_directories=not read_only, read_only=read_only)
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

    Raises:
      CheckpointMismatch: a step's arrays have other shapes than
        ``abstract_state`` (nothing is skipped or moved for it).
      CheckpointError: no step restores (nothing is moved either).
    """
    candidates = [step] if step is not None else self.steps()[::-1]
    skipped = []
    for s in candidates:
      try:
        with _quiet_libraries():
          _hide_abandoned_reads()  # before: some arrive while it fails
          self._check_shapes(s, abstract_state)
          out = self.manager.restore(s, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract_state),
              data=ocp.args.JsonRestore(), config=ocp.args.JsonRestore()))
      except CheckpointMismatch:
        raise
      except Exception as e:  # a damaged checkpoint fails in many ways
        with _quiet_libraries():
          gc.collect()  # its abandoned coroutines, while their logs are held
        logging.debug('restoring checkpoint %d failed', s, exc_info=e)
        if step is not None:
          raise CheckpointError(
              f'checkpoint {s} in {self.directory} cannot be restored: '
              f'{_reason(e)}') from e
        logging.warning('checkpoint %d in %s is damaged or incomplete (%s); '
                        'trying the previous one', s, self.directory,
                        _reason(e))
        skipped.append(s)
        continue
      if not self.read_only:
        for bad in skipped:  # out of the way of this run's later saves
          logging.warning('moved damaged checkpoint %d to %s', bad,
                          self._move_aside(bad))
      return s, out['state'], out['data'], out['config']
    if candidates:
      raise CheckpointError(
          f'no checkpoint in {self.directory} could be restored (tried steps '
          f'{candidates}); nothing was moved or deleted (move the folder '
          'away to start afresh, or put back a good copy)')
    return None

  def _check_shapes(self, step: int, abstract_state) -> None:
    """A CheckpointMismatch if ``step`` holds arrays of other shapes than
    ``abstract_state``; reads only the step's metadata (whose own errors are
    damage, left to the restore that follows)."""
    path = epath.Path(self.directory) / str(step) / 'state'
    try:
      saved = _shapes(ocp.StandardCheckpointHandler().metadata(path).tree)
    except Exception:  # pylint: disable=broad-except
      return
    wanted = _shapes(abstract_state)
    differ = [k for k in wanted if k in saved and saved[k] != wanted[k]]
    if differ:
      k = differ[0]
      raise CheckpointMismatch(
          f'checkpoint {step} in {self.directory} holds {k} of shape '
          f'{saved[k]}, the model asks for {wanted[k]} ({len(differ)} arrays '
          'differ): it was written for another config or tokenizer', step)

  def saved_config(self, step: int) -> dict:
    """The config saved with ``step`` (the one it was trained with)."""
    with _quiet_libraries():
      return self.manager.restore(step, args=ocp.args.Composite(
          config=ocp.args.JsonRestore()))['config']

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


def _reason(e: Exception) -> str:
  """The first line of a restore error, without TensorStore's spec dump."""
  line = (str(e).splitlines() or [''])[0].split(' See full TensorStore')[0]
  return f'{type(e).__name__}: {line[:200]}'


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
