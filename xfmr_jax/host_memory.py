"""Host memory: let glibc's malloc keep freed memory for reuse.

On the CPU backend XLA allocates each executable's scratch buffer when it is
called and frees it when the call ends; for the toy train step that buffer is
about 200 MB (``jax.jit(f).lower(...).compile().memory_analysis()``). glibc
serves a request that large with a fresh ``mmap`` and gives it back with
``munmap``, so every step faults all those pages in again and the kernel
zeroes them: on a 2-core machine a fifth of the train step's CPU time went to
that. :func:`reuse_freed_memory` makes glibc serve every request from its
main heap and keep what is freed, so each call reuses the previous call's
pages. Numerics are unchanged; the process keeps its peak memory.

One heap means one lock, which the small allocations of all threads then
share: cached decoding, whose scratch buffers are small, ran 11-16% slower
with these settings (docs/benchmarks.md). So the trainer,
``python -m experiments.train_wmt``, uses them, and translation and serving
keep glibc's defaults.

The settings only reach threads that have not allocated yet, so call it
before importing jax. It does nothing off glibc (macOS, musl) or when the
environment already sets glibc's malloc tunables, which then win.
"""
from __future__ import annotations

import ctypes
import os
import sys

# mallopt parameters of glibc's <malloc.h>.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_SETTINGS = (
    (_M_ARENA_MAX, 1),            # one heap for all threads: the main one
    (_M_MMAP_MAX, 0),             # large requests from the heap, not mmap
    (_M_TRIM_THRESHOLD, 2**31 - 1),  # keep freed memory (up to 2 GiB free)
)
_TUNABLE_ENV = ('GLIBC_TUNABLES', 'MALLOC_ARENA_MAX', 'MALLOC_MMAP_MAX_',
                'MALLOC_TRIM_THRESHOLD_', 'MALLOC_MMAP_THRESHOLD_')


def reuse_freed_memory() -> bool:
  """Configure glibc's malloc as described above; ``True`` if it was done."""
  if not sys.platform.startswith('linux'):
    return False
  if any(name in os.environ for name in _TUNABLE_ENV):
    return False
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # only glibc has it (musl has mallopt too)
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  return all(mallopt(param, value) == 1 for param, value in _SETTINGS)
