"""Foreign CPU load: how much of the machine other jobs used during a window.

A timed window's foreign load is the CPU time the whole machine spent busy
(``/proc/stat``: user + nice + system + irq + softirq + steal, in clock ticks)
minus the CPU time of this process, its waited-for children and the worker
processes it drives (``pids``, e.g. the PyTorch worker of
:mod:`experiments.benchmark.torch_worker`), over the same wall interval,
expressed in busy cores (foreign CPU seconds / wall seconds). ``interleave``
(in :mod:`experiments.benchmark.common`) measures it for every contender of
every round and retries a round in which it exceeded ``DISTURBED_LOAD``.

Where ``/proc/stat`` does not exist (macOS), the load is None and nothing is
retried.
"""
from __future__ import annotations

import os
import resource
import time

import numpy as np

# A round is disturbed when, during any of its contenders' timed windows,
# other jobs kept more than this many cores busy. A quarter of a core is well
# above the noise of tick-based accounting over a window of MIN_ROUND_S
# (about 0.03 core per tick of error at 100 Hz) and well below one busy job.
DISTURBED_LOAD = 0.25
# How many times a disturbed round is run again before the least disturbed
# attempt is kept anyway (and counted as kept while disturbed).
MAX_RETRIES = 3

_PROC_STAT = '/proc/stat'
# Fields of the 'cpu' line: user nice system idle iowait irq softirq steal
# guest guest_nice. Busy = all but idle and iowait (guest is inside user).
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def _tick_s() -> float:
  try:
    return 1.0 / os.sysconf('SC_CLK_TCK')
  except (AttributeError, ValueError, OSError):
    return 0.01


TICK_S = _tick_s()


def machine_busy_s(path: str = _PROC_STAT) -> float | None:
  """CPU seconds the whole machine has spent busy since boot (all cores),
  or None where there is no ``/proc/stat``."""
  try:
    with open(path) as f:
      fields = f.readline().split()
  except OSError:
    return None
  if not fields or fields[0] != 'cpu':
    return None
  values = [int(v) for v in fields[1:]]
  return sum(values[i] for i in _BUSY_FIELDS if i < len(values)) * TICK_S


def pid_cpu_s(pid: int) -> float:
  """User + system CPU seconds of process ``pid`` (all its threads) and its
  waited-for children; 0 once it has gone."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      stat = f.read()
  except OSError:
    return 0.0
  # The command name (field 2) may hold spaces; the rest follows its ')'.
  rest = stat[stat.rindex(')') + 2:].split()
  # Fields 14-17 of the file (utime stime cutime cstime) are rest[11:15].
  return sum(int(v) for v in rest[11:15]) * TICK_S


def own_cpu_s(pids=()) -> float:
  """CPU seconds of this process, its waited-for children and ``pids``."""
  total = 0.0
  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
    r = resource.getrusage(who)
    total += r.ru_utime + r.ru_stime
  return total + sum(pid_cpu_s(p) for p in pids)


def window(pids=()):
  """Start a measuring window; returns ``stop()``, which ends it and gives
  the foreign load in busy cores (None without ``/proc/stat``)."""
  busy0, own0, t0 = machine_busy_s(), own_cpu_s(pids), time.perf_counter()

  def stop() -> float | None:
    busy1, own1, t1 = machine_busy_s(), own_cpu_s(pids), time.perf_counter()
    if busy0 is None or busy1 is None or t1 <= t0:
      return None
    return ((busy1 - busy0) - (own1 - own0)) / (t1 - t0)

  return stop


def summary(loads) -> dict | None:
  """Median and max of per-round foreign loads (None if not measured)."""
  if not loads or any(x is None for x in loads):
    return None
  return dict(median=float(np.median(loads)), max=float(np.max(loads)))
