"""PyTorch's train step with its default OpenMP wait policy, in a child process.

The package sets ``OMP_WAIT_POLICY=PASSIVE`` before anything imports torch
(see ``experiments/benchmark/__init__.py``), and OpenMP reads the variable
once, when torch loads it. ``TorchTrainWorker`` therefore builds the same
:class:`~experiments.benchmark.torch_reference.TorchTrain` in a process
started with the 'spawn' method, which imports torch afresh under the
policy the user had (none: OpenMP's default, which spins a while before
sleeping). The parent drives it round by round over a pipe, so it alternates
with the other contenders in the same ``interleave`` rounds: ``repeat(n)``
runs n steps there and answers with the seconds they took. Its process id is
in ``pids``, so that its CPU time counts as ours, not as foreign load.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback

import experiments.benchmark as package

# How long the parent waits for the worker to build (import torch, two steps)
# and for one request.
START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 600


def apply_wait_policy(policy: str | None) -> None:
  """Set ``OMP_WAIT_POLICY`` to ``policy`` (None: unset, OpenMP's default)
  for a process that has not imported torch yet (OpenMP reads it once)."""
  if 'torch' in sys.modules:
    raise RuntimeError('torch was imported before the wait policy was set')
  # Importing this package ran its setdefault('PASSIVE') here too.
  os.environ.pop('OMP_WAIT_POLICY', None)
  if policy is not None:
    os.environ['OMP_WAIT_POLICY'] = policy


def _serve(conn, cfg, batch, sites, policy):
  """The worker: set the policy, import torch, build the step, answer."""
  try:
    apply_wait_policy(policy)
    from experiments.benchmark import torch_reference  # pylint: disable=g-import-not-at-top
    step = torch_reference.TorchTrain(cfg, batch, sites=sites)
  except Exception:  # pylint: disable=broad-except
    conn.send(('error', traceback.format_exc()))
    return
  conn.send(('ready', dict(first_step_s=step.first_step_s,
                           rss_delta=step.rss_delta,
                           omp_wait_policy=os.environ.get('OMP_WAIT_POLICY'),
                           threads=step.torch.get_num_threads())))
  while True:
    msg = conn.recv()
    if msg[0] != 'run':
      break
    t0 = time.perf_counter()
    for _ in range(msg[1]):
      step()
    conn.send(('done', time.perf_counter() - t0))
  conn.close()


class TorchTrainWorker:
  """``TorchTrain`` in a spawned child with the user's OpenMP wait policy
  (default: unset). Call it (one step) or ``repeat(n)``; ``close()`` ends it."""

  def __init__(self, cfg, batch: dict, sites: str = 'paper',
               policy: str | None = package.USER_OMP_WAIT_POLICY):
    ctx = multiprocessing.get_context('spawn')
    self._conn, child = ctx.Pipe()
    self._proc = ctx.Process(target=_serve, daemon=True,
                             args=(child, cfg, batch, sites, policy))
    self._proc.start()
    child.close()
    self.pids = (self._proc.pid,)
    kind, info = self._recv(START_TIMEOUT_S)
    if kind != 'ready':
      self.close()
      raise RuntimeError(f'torch worker failed:\n{info}')
    self.first_step_s = info['first_step_s']
    self.rss_delta = info['rss_delta']
    self.omp_wait_policy = info['omp_wait_policy']
    self.threads = info['threads']

  def _recv(self, timeout):
    if not self._conn.poll(timeout):
      self.close()
      raise TimeoutError(f'torch worker: no answer in {timeout} s')
    try:
      return self._conn.recv()
    except EOFError:
      self.close()
      raise RuntimeError('torch worker died') from None

  def repeat(self, n: int) -> float:
    """Run ``n`` train steps in the worker; the seconds they took there."""
    self._conn.send(('run', int(n)))
    return self._recv(REQUEST_TIMEOUT_S)[1]

  def __call__(self):
    return self.repeat(1)

  def close(self):
    if self._proc.is_alive():
      try:
        self._conn.send(('stop',))
      except (BrokenPipeError, OSError):
        pass
      self._proc.join(10)
      if self._proc.is_alive():
        self._proc.kill()
    self._proc.join()
    self._conn.close()
