"""What every benchmark shares: the sizes, the machine, timing and FLOP counts.

Timing alternates the contenders round by round (``interleave``), after a
pause, each for at least ``MIN_ROUND_S`` (several calls of a short step), so
load from other jobs falls on all of them alike; it measures the foreign CPU
load of every timed window (:mod:`experiments.benchmark.load`) and runs a
disturbed round again. Memory is the peak growth of the process's resident
set (``PeakRSS``) and the device's own peak where it reports one. ``MatmulPeak`` measures the ``jnp.dot`` FLOP/s that MFU
is taken against; ``train_flops`` counts a train step's model FLOPs.
"""
from __future__ import annotations

import os
import platform
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmark import load as load_lib
from experiments.configs import toy
from xfmr_jax import config as config_lib

# The architecture fields a size sets; the rest are ModelConfig's defaults.
SIZE_FIELDS = ('d_model', 'num_heads', 'num_encoder_layers',
               'num_decoder_layers', 'd_ff', 'max_len')


def _toy_size(decode_batch: int) -> dict:
  """The 'toy' size: the model, batch and length of experiments/configs/toy.py
  (its dropout, dtype and attention are the benchmark's, as for every size)."""
  c = toy.get_config()
  return dict(model=dict(vocab_size=c.vocab_size,
                         **{k: c.model[k] for k in SIZE_FIELDS}),
              batch=c.batch_size, length=c.max_length,
              decode_batch=decode_batch)


# name: model config, batch, length (source = target), decode batch.
SIZES = {
    'tiny': dict(model=dict(vocab_size=64, d_model=32, num_heads=2,
                            num_encoder_layers=1, num_decoder_layers=1,
                            d_ff=64, max_len=64),
                 batch=4, length=16, decode_batch=2),
    'toy': _toy_size(decode_batch=8),
    'small': dict(model=dict(vocab_size=8000, d_model=256, num_heads=4,
                             num_encoder_layers=3, num_decoder_layers=3,
                             d_ff=1024, max_len=256),
                  batch=32, length=64, decode_batch=4),
    'base': dict(model=dict(vocab_size=32000, max_len=256),
                 batch=16, length=64, decode_batch=2),
    'big': dict(model=dict(vocab_size=32000, d_model=1024, num_heads=16,
                           d_ff=4096, max_len=256),
                batch=16, length=64, decode_batch=2),
}
DROPOUT = 0.1
LABEL_SMOOTHING = 0.1


def log(*args):
  print(*args, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ counting --

def train_flops(cfg: config_lib.ModelConfig, batch: int, src: int,
                tgt: int) -> float:
  """Model FLOPs of one train step (forward + backward = 3 x forward)."""
  d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
  enc = 8 * src * d * d + 4 * src * src * d + 4 * src * d * f
  dec = (8 * tgt * d * d + 4 * tgt * tgt * d          # self-attention
         + 4 * tgt * d * d + 4 * src * d * d          # cross: q, out; k, v
         + 4 * tgt * src * d + 4 * tgt * d * f)       # cross scores; FFN
  forward = (cfg.num_encoder_layers * enc + cfg.num_decoder_layers * dec
             + 2 * tgt * d * v)                       # output projection
  return 3.0 * batch * forward


# -------------------------------------------------------------------- memory --

def rss_bytes() -> int:
  try:
    import psutil  # pylint: disable=g-import-not-at-top
    return psutil.Process().memory_info().rss
  except ImportError:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


class PeakRSS:
  """Peak resident-set growth over a block, sampled every 2 ms."""

  def __enter__(self):
    self.start = self.peak = rss_bytes()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def _sample(self):
    while not self._stop.wait(0.002):
      self.peak = max(self.peak, rss_bytes())

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, rss_bytes())
    self.delta = self.peak - self.start


def device_peak_bytes():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get('peak_bytes_in_use')


# -------------------------------------------------------------------- timing --

class MatmulPeak:
  """``jnp.dot`` of two n x n matrices: the FLOP/s ceiling for MFU."""

  def __init__(self, n: int, dtype=jnp.float32):
    self.n = n
    key_a, key_b = jax.random.split(jax.random.key(0))
    self.a = jax.random.normal(key_a, (n, n), dtype)
    self.b = jax.random.normal(key_b, (n, n), dtype)
    self.fn = jax.jit(jnp.dot)
    jax.block_until_ready(self.fn(self.a, self.b))
    self.flops = 2.0 * n ** 3

  def __call__(self):
    jax.block_until_ready(self.fn(self.a, self.b))


class CompiledStep:
  """A train step compiled ahead of time and run twice: its compile time,
  first-step time and memory. Subclasses call :meth:`_compile` and define
  ``__call__`` (one step on ``self.state``)."""

  def _compile(self, init_state, lower):
    """``init_state() -> state``; ``lower(state) -> jax Lowered``."""
    with PeakRSS() as mem:
      self.state = init_state()
      jax.block_until_ready(self.state)
      t0 = time.perf_counter()
      self.compiled = lower(self.state).compile()
      self.compile_s = time.perf_counter() - t0
      t0 = time.perf_counter()
      self()
      self.first_step_s = time.perf_counter() - t0
      self()
    self.rss_delta = mem.delta
    self.xla_bytes = None
    try:
      m = self.compiled.memory_analysis()
      self.xla_bytes = int(m.argument_size_in_bytes + m.output_size_in_bytes
                           - m.alias_size_in_bytes + m.temp_size_in_bytes)
    except Exception:  # pylint: disable=broad-except
      pass
    self.device_peak = device_peak_bytes()

  def memory(self) -> dict:
    return dict(device_peak_bytes=self.device_peak,
                xla_step_bytes=self.xla_bytes, rss_delta_bytes=self.rss_delta)


# The array the memory bandwidth is read from: far larger than any cache.
BANDWIDTH_BYTES = 256 * 2 ** 20


class MemoryBandwidth:
  """A jitted ``jnp.sum`` over a float32 array of ``nbytes``: each call reads
  them once, so bytes / seconds is the bandwidth XLA reads memory at."""

  def __init__(self, nbytes: int = BANDWIDTH_BYTES):
    self.x = jnp.ones((nbytes // 4,), jnp.float32)
    self.nbytes = self.x.nbytes
    self.fn = jax.jit(jnp.sum)
    jax.block_until_ready(self.fn(self.x))

  def __call__(self):
    jax.block_until_ready(self.fn(self.x))


def random_batch(vocab: int, batch: int, length: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  # Ids >= 2: no padding (0) and no EOS (1), so every position is a real token.
  return {k: rng.integers(2, vocab, (batch, length)).astype(np.int32)
          for k in ('inputs', 'targets')}


# Pause before each timed run. XLA's worker threads keep spinning for some
# milliseconds after a computation; whatever ran next shared the cores with
# them and ran measurably slower, while after a short idle pause it ran at
# full speed.
SETTLE_S = 0.1
# Each contender's timed window in a round lasts at least this long: a runner
# whose call is shorter is called several times in a row (the count is fixed
# in the first round) and its time is the window over the count, so that one
# scheduling hiccup moves a short step by a fraction of a percent, not 10%.
MIN_ROUND_S = 0.3


# The rows every other train row is compared with.
REFERENCES = ('torch', 'torch_default', 'torch_active', 'flax_wmt')


def ratios_vs(seconds: dict, refs=REFERENCES) -> dict:
  """``{'ratio_vs_<ref>': {name: median over rounds of ref / name}}`` for
  each ``ref`` in ``seconds`` (name -> seconds per round, the same rounds):
  per round, then the median, since both sides ran in the same round."""
  return {f'ratio_vs_{ref}': {
      name: float(np.median(np.array(seconds[ref]) / np.array(ts)))
      for name, ts in seconds.items() if name != ref}
          for ref in refs if ref in seconds}


class Timings(dict):
  """``interleave``'s result: name -> seconds per call, one per kept round.

  Also ``load`` (name -> foreign busy cores per kept round, None where not
  measured), ``calls`` (name -> calls per round), ``retried`` (disturbed
  attempts run again), ``disturbed_kept`` (kept rounds still disturbed after
  the retries) and ``threshold``.
  """

  def load_summary(self, name) -> dict | None:
    return load_lib.summary(self.load.get(name))

  def rounds_info(self) -> dict:
    return dict(rounds=len(next(iter(self.values()), [])),
                measured=all(x is not None for ls in self.load.values()
                             for x in ls),
                threshold=self.threshold, retried=self.retried,
                disturbed_kept=self.disturbed_kept,
                max_foreign_load=max((x for ls in self.load.values()
                                      for x in ls if x is not None),
                                     default=None))


def timed(run, calls: int | None, min_s: float):
  """Seconds of ``calls`` calls of ``run``; with ``calls=None``, as many as
  make up ``min_s`` (doubling batches). A runner with ``repeat(n)`` (a worker
  in another process) does a batch in one request. Returns (calls, seconds)."""
  batch = getattr(run, 'repeat', None) or (
      lambda n: [run() for _ in range(n)])
  t0 = time.perf_counter()
  if calls is not None:
    batch(calls)
    return calls, time.perf_counter() - t0
  done, n = 0, 1
  while True:
    batch(n)
    done += n
    elapsed = time.perf_counter() - t0
    if elapsed >= min_s:
      return done, elapsed
    n = done


def interleave(runners: dict, rounds: int, settle_s: float = SETTLE_S, *,
               min_round_s: float = MIN_ROUND_S,
               threshold: float = load_lib.DISTURBED_LOAD,
               retries: int = load_lib.MAX_RETRIES,
               measure=load_lib.window) -> Timings:
  """Run each runner once per round, in turn, each after ``settle_s`` idle and
  for at least ``min_round_s`` (several calls); per-runner lists of seconds
  per call (a :class:`Timings`).

  ``measure(pids)`` starts a window and returns ``stop() -> foreign busy
  cores or None`` (default :func:`load.window`; ``pids``: the runners'
  worker processes, whose CPU time is ours). A round in which any
  contender's window saw more than ``threshold`` is run again, all
  contenders, up to ``retries`` times; then the least disturbed attempt is
  kept. Without a measurement (None) nothing is retried."""
  out = Timings({name: [] for name in runners})
  out.load = {name: [] for name in runners}
  out.calls, out.threshold = {}, threshold
  out.retried = out.disturbed_kept = 0
  pids = [p for r in runners.values() for p in getattr(r, 'pids', ())]
  for _ in range(rounds):
    best = None
    for attempt in range(retries + 1):
      secs, loads = {}, {}
      for name, run in runners.items():
        time.sleep(settle_s)
        stop = measure(pids)
        n, elapsed = timed(run, out.calls.get(name), min_round_s)
        loads[name] = stop()
        out.calls[name], secs[name] = n, elapsed / n
      worst = (None if any(x is None for x in loads.values())
               else max(loads.values(), default=0.0))
      if best is None or (worst is not None and worst < best[0]):
        best = (worst, secs, loads)
      if worst is None or worst <= threshold:
        break
      if attempt < retries:
        out.retried += 1
    worst, secs, loads = best
    out.disturbed_kept += worst is not None and worst > threshold
    for name in runners:
      out[name].append(secs[name])
      out.load[name].append(loads[name])
  return out


# ------------------------------------------------------------------- machine --

def machine() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          cpu = line.split(':', 1)[1].strip()
          break
  except OSError:
    pass
  dev = jax.devices()[0]
  return (f'{dev.platform}:{dev.device_kind}, {cpu}, {os.cpu_count()} cores, '
          f'jax {jax.__version__}')
