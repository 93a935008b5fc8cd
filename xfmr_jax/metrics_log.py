"""What a training run reports: metrics rows on disk and training throughput."""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np


class MetricsWriter:
  """JSON lines (``metrics.jsonl``) and TensorBoard events, on process 0 only.

  A run resumed from the checkpoint of ``resume_step`` redoes the steps after
  it, so the rows written after that step by the interrupted run (and its
  test rows) are dropped first: each step has one row per split however
  often the run was resumed.
  """

  def __init__(self, workdir: str, resume_step: int = 0):
    self.enabled = jax.process_index() == 0
    self._workdir = workdir
    if self.enabled:
      from tensorboardX import SummaryWriter  # heavy; only where it writes
      path = os.path.join(workdir, 'metrics.jsonl')
      _drop_rows_after(path, resume_step)
      self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))
      self._jsonl = open(path, 'a')

  def write(self, step: int, prefix: str, metrics: dict) -> None:
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in metrics.items()
               if isinstance(v, (int, float, np.floating, np.integer))}
    try:
      self._jsonl.write(json.dumps({'step': step, 'split': prefix, **scalars})
                        + '\n')
      self._jsonl.flush()
      for k, v in scalars.items():
        self._tb.add_scalar(f'{prefix}/{k}', v, step)
      self._tb.flush()
    except OSError as e:  # a full disk: say which file
      raise OSError(e.errno, f'cannot write the metrics in {self._workdir}: '
                    f'{e.strerror}') from e

  def close(self):
    if self.enabled:
      self._tb.close()
      self._jsonl.close()


def _drop_rows_after(path: str, step: int) -> None:
  """Rewrite ``path`` (atomically) without rows after ``step`` or of 'test'."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = f.readlines()
  keep = []
  for line in lines:
    try:
      row = json.loads(line)
    except ValueError:  # a line cut short by a kill
      continue
    if row.get('step', 0) <= step and row.get('split') != 'test':
      keep.append(line if line.endswith('\n') else line + '\n')
  if len(keep) != len(lines):
    with open(path + '.tmp', 'w') as f:
      f.writelines(keep)
    os.replace(path + '.tmp', path)


class Throughput:
  """Training tokens per second, over the whole run and since the last look.

  The first step of a process compiles, so its time and tokens are left out;
  so is time spent in :meth:`pause` (evaluation). Call :meth:`step` once per
  completed step.
  """

  def __init__(self):
    self.start = None          # end of the first step
    self.tokens = 0            # after the first step
    self.steps = 0
    self.paused = 0.0
    self._interval_start, self._interval_tokens = None, 0

  def step(self, tokens: int) -> None:
    now = time.time()
    if self.start is None:
      self.start = self._interval_start = now
      return
    self.tokens += tokens
    self.steps += 1
    self._interval_tokens += tokens

  def pause(self, seconds: float) -> None:
    self.paused += seconds
    if self._interval_start is not None:
      self._interval_start += seconds

  def interval_rate(self) -> float:
    """Tokens/s since the previous call (or the first step); restarts it."""
    if self._interval_start is None:
      return 0.0
    now = time.time()
    rate = self._interval_tokens / max(now - self._interval_start, 1e-9)
    self._interval_start, self._interval_tokens = now, 0
    return rate

  def overall_rate(self) -> tuple[float | None, float | None]:
    """``(tokens/s, steps/s)`` over the run so far (None if this process
    timed no step after its first)."""
    if not self.steps:
      return None, None
    seconds = max(time.time() - self.start - self.paused, 1e-9)
    return self.tokens / seconds, self.steps / seconds
