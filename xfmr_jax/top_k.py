"""The ``k`` largest entries of a long last axis, found block by block.

A beam step ranks every token of the vocabulary (``[rows, vocab]``, up to
256 x 58,101 for a Marian batch) but keeps a handful. ``jax.lax.top_k``
scans each row in full and XLA's CPU backend runs it on one core, a good
share of the step at that shape (see docs/benchmarks.md). :func:`top_k`
gives the same values and indices in a fraction of the time:

1. cut each row into blocks of ``b`` entries and take every block's maximum
   (a streaming reduction, as cheap as one read of the row);
2. keep the ``k`` blocks with the largest maxima;
3. run ``lax.top_k`` over the ``k * b`` entries of those blocks only.

Why it is exact: an entry that ``lax.top_k`` returns lies in a block whose
maximum is at least that entry. If its block were not among the ``k`` kept,
``k`` other blocks would rank ahead of it (a larger maximum, or an equal one
at a lower index), and their maxima would be ``k`` entries that rank ahead
of the returned one (ties go to the lower index), so it could not have been
returned. The kept blocks are gathered in index order, so the final
``lax.top_k`` breaks ties by index exactly as a scan of the whole row does.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Fewer blocks than this many times k: blocks save nothing, scan the row.
MIN_BLOCKS_PER_K = 4


def block_size(length: int, k: int) -> int:
  """Entries per block: the power of two at or above ``sqrt(length / k)``,
  which balances the blocks' count (ranked in step 2) against the ``k * b``
  entries ranked in step 3. Measured at 256 x 58,101 with k = 8, blocks of
  128 (the rule's choice) were the fastest."""
  return 1 << max(0, math.ceil(math.log2(math.sqrt(length / k))))


def top_k(x: jnp.ndarray, k: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """``jax.lax.top_k(x, k)`` over the last axis, block by block when it is long.

  Args:
    x: ``[..., length]`` floating point, no NaN (``-inf`` is fine).
    k: static, ``1 <= k <= length``.

  Returns:
    ``(values [..., k], indices [..., k] int32)``, largest first; equal
    values in index order, as ``jax.lax.top_k`` returns them.
  """
  length = x.shape[-1]
  if not 1 <= k <= length:
    raise ValueError(f'top_k needs 1 <= k <= {length}, got k={k}')
  b = block_size(length, k)
  blocks = length // b
  if blocks < MIN_BLOCKS_PER_K * k:
    return jax.lax.top_k(x, k)
  lead = x.shape[:-1]
  rows = x.reshape(-1, length)
  n = rows.shape[0]
  whole = blocks * b
  # A window reduction rather than a max over rows[:, :whole] reshaped to
  # blocks: XLA's CPU backend wrote that slice out first, while the window
  # reads the row where it lies (also when the scores are made by an
  # elementwise op inside a loop, as in a beam step).
  maxima = jax.lax.reduce_window(rows, jnp.array(-jnp.inf, rows.dtype),
                                 jax.lax.max, (1, b), (1, b), 'VALID')
  if whole < length:  # the short last block
    tail = jnp.max(rows[:, whole:], axis=-1, keepdims=True)
    maxima = jnp.concatenate([maxima, tail], axis=1)
  _, kept = jax.lax.top_k(maxima, k)
  kept = jnp.sort(kept, axis=-1)                                 # [n, k]
  index = (kept[:, :, None] * b + jnp.arange(b)).reshape(n, k * b)
  # Past the row's end (the short last block) stands -inf: always last, so
  # never taken while k real entries are there.
  candidates = jnp.where(index < length, jnp.take_along_axis(
      rows, jnp.minimum(index, length - 1), axis=1), -jnp.inf)
  values, where = jax.lax.top_k(candidates, k)
  indices = jnp.take_along_axis(index, where, axis=1)
  return values.reshape(*lead, k), indices.reshape(*lead, k).astype(jnp.int32)
