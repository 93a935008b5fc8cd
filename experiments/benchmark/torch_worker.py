"""Every PyTorch contender in a process of its own, driven round by round.

PyTorch and XLA in one process disturb each other: with torch built and
stepped beside them, our small train step ran 1.3x slower and the flax
example's 3.8x slower than without (glibc's heap and two thread pools are
shared), which made every ratio depend on who ran next to whom. So the
benchmark never imports torch itself: :class:`TorchWorker` builds one of
:mod:`~experiments.benchmark.torch_reference`'s contenders in a child started
with the 'spawn' method, which imports torch afresh under the OpenMP wait
policy asked for (OpenMP reads ``OMP_WAIT_POLICY`` once, when torch loads
it; the package sets PASSIVE, ``policy=USER_OMP_WAIT_POLICY`` is what the
user had, None being OpenMP's default that spins a while before sleeping).
The parent drives it over a pipe, so it alternates with the other contenders
in the same ``interleave`` rounds: ``repeat(n)`` runs n calls there and
answers with the seconds they took. Its process id is in ``pids``, so that
its CPU time counts as ours, not as foreign load.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback


# How long the parent waits for the worker to build (import torch, two steps)
# and for one request.
START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 600


def _serve(conn, kind, args, kwargs, policy):
  """The worker: set the policy, import torch, build the contender, answer."""
  # Importing this module ran the package's setdefault('PASSIVE') here too.
  os.environ.pop('OMP_WAIT_POLICY', None)
  if policy is not None:
    os.environ['OMP_WAIT_POLICY'] = policy
  try:
    if 'torch' in sys.modules:
      raise RuntimeError('torch was imported before the wait policy was set')
    from experiments.benchmark import torch_reference  # pylint: disable=g-import-not-at-top
    step = getattr(torch_reference, kind)(*args, **kwargs)
    if not hasattr(step, 'first_step_s'):  # warm up what has no build step
      t0 = time.perf_counter()
      step()
      step.first_step_s, step.rss_delta = time.perf_counter() - t0, None
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


class TorchWorker:
  """``torch_reference.<kind>(*args, **kwargs)`` in a spawned child with
  OpenMP wait policy ``policy`` (default PASSIVE, the package's). Call it
  (one call) or ``repeat(n)``; ``close()`` ends it."""

  def __init__(self, kind: str, *args, policy: str | None = 'PASSIVE',
               **kwargs):
    ctx = multiprocessing.get_context('spawn')
    self._conn, child = ctx.Pipe()
    self._proc = ctx.Process(target=_serve, daemon=True,
                             args=(child, kind, args, kwargs, policy))
    self._proc.start()
    child.close()
    self.pids = (self._proc.pid,)
    reply, info = self._recv(START_TIMEOUT_S)
    if reply != 'ready':
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


def TorchTrainWorker(cfg, batch: dict, sites: str = 'paper',  # pylint: disable=invalid-name
                     policy: str | None = 'PASSIVE') -> TorchWorker:
  """The PyTorch train step (``TorchTrain``) in its own process."""
  return TorchWorker('TorchTrain', cfg, batch, sites=sites, policy=policy)
