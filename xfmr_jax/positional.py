"""Positional encodings (paper section 3.5).

``PE(pos, 2i) = sin(pos / 10000^(2i / d_model))`` and
``PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))``: sine on even dimensions and
cosine on odd ones, interleaved exactly as in the paper (``layout='halves'``
puts all sines first and all cosines after them, as Marian does: the same
values, permuted). For every offset ``k``
there is a fixed block-diagonal rotation ``M_k`` with ``PE(pos + k) = M_k PE(pos)``
(see :func:`offset_matrix`), which is why the model can attend by relative position.

Two later schemes put relative position into attention itself instead of the
embeddings: :func:`rotary` (RoPE) rotates queries and keys, and
:func:`alibi_bias` (ALiBi) penalises attention scores by distance.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _inverse_frequencies(d_model: int, max_timescale: float) -> jnp.ndarray:
  """``1 / max_timescale^(2i / d_model)`` for ``i = 0 .. d_model/2 - 1``."""
  two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)
  return jnp.exp(-jnp.log(max_timescale) * two_i / d_model)


def sinusoidal_encoding(positions: jnp.ndarray, d_model: int,
                        max_timescale: float = 10_000.0,
                        layout: str = 'interleaved') -> jnp.ndarray:
  """Sinusoidal encoding of integer positions.

  Args:
    positions: integer array of any shape ``[...]`` (for example ``[length]`` or,
      for packed rows, ``[batch, length]`` of per-segment positions).
    d_model: even model width.
    layout: 'interleaved' (the paper) or 'halves' (Marian).

  Returns:
    float32 ``[..., d_model]`` with sin on even and cos on odd dimensions
    ('interleaved'), or ``[sin_0 .. sin_{d/2-1}, cos_0 .. cos_{d/2-1}]``
    ('halves').
  """
  if layout not in ('interleaved', 'halves'):
    raise ValueError(f"layout must be 'interleaved' or 'halves', got {layout!r}")
  if d_model % 2:
    raise ValueError(f'sinusoidal encoding needs an even d_model, got {d_model}')
  angles = positions.astype(jnp.float32)[..., None] * _inverse_frequencies(
      d_model, max_timescale)
  if layout == 'halves':
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
  # Stack then reshape interleaves: [sin0, cos0, sin1, cos1, ...].
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(
      *positions.shape, d_model)


def offset_matrix(k: int, d_model: int,
                  max_timescale: float = 10_000.0) -> np.ndarray:
  """The fixed matrix ``M_k`` with ``PE(pos + k) = M_k @ PE(pos)`` for all pos.

  Each (sin, cos) pair of frequency ``w`` is rotated by the angle ``k * w``:
  ``sin(a + b) = sin a cos b + cos a sin b``, ``cos(a + b) = cos a cos b - sin a sin b``.
  """
  w = max_timescale ** (-np.arange(0, d_model, 2) / d_model)  # float64
  m = np.zeros((d_model, d_model))
  for i, wi in enumerate(w):
    c, s = np.cos(k * wi), np.sin(k * wi)
    m[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[c, s], [-s, c]]
  return m


def rotary(x: jnp.ndarray, positions: jnp.ndarray,
           max_timescale: float = 10_000.0) -> jnp.ndarray:
  """RoPE (Su et al., 2021): rotate each dimension pair by its position.

  Pair ``(2i, 2i+1)`` of a head is rotated by the angle ``pos * w_i`` with the
  sinusoid's frequencies ``w_i = max_timescale^(-2i / head_dim)``. A rotation
  by ``a`` then the transpose of one by ``b`` is one by ``a - b``, so the dot
  product of a rotated query at ``m`` and key at ``n`` depends on ``m - n``
  only: attention sees relative positions, with nothing added to the values.

  Args:
    x: ``[batch, length, heads, head_dim]`` queries or keys, even head_dim.
    positions: integer ``[batch, length]`` (or ``[length]``).

  Returns:
    ``x`` rotated, same shape and dtype (the rotation runs in float32).
  """
  head_dim = x.shape[-1]
  angles = positions.astype(jnp.float32)[..., None] * _inverse_frequencies(
      head_dim, max_timescale)                       # [batch, length, d/2]
  cos = jnp.cos(angles)[..., None, :]                # broadcast over heads
  sin = jnp.sin(angles)[..., None, :]
  pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], head_dim // 2, 2)
  even, odd = pairs[..., 0], pairs[..., 1]
  rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], -1)
  return rotated.reshape(x.shape).astype(x.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi's per-head slopes (Press et al., 2022), float64 ``[num_heads]``.

  For ``n`` a power of two: the geometric sequence ``2^(-8/n), 2^(-16/n), ...,
  2^-8``. Otherwise the slopes of the largest power of two ``p < n`` followed by
  every other slope of ``2p`` heads, as in the paper.
  """
  def powers(n):
    return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)
  p = 2 ** int(np.floor(np.log2(num_heads)))
  if p == num_heads:
    return powers(p)
  return np.concatenate([powers(p), powers(2 * p)[0::2][:num_heads - p]])


def alibi_bias(query_positions: jnp.ndarray, key_positions: jnp.ndarray,
               num_heads: int) -> jnp.ndarray:
  """ALiBi attention bias ``-slope_h * |q - k|``, added to the scores.

  A far key is penalised linearly in its distance, more steeply in some heads
  than others; no positions enter the embeddings. The absolute distance makes
  it usable both in a bidirectional encoder and under a causal mask (where
  only ``k <= q`` survives and ``|q - k| = q - k``, the paper's form).

  Args:
    query_positions: integer ``[batch, q]``; key_positions: ``[batch, k]``.

  Returns:
    float32 ``[batch, heads, q, k]``.
  """
  distance = jnp.abs(query_positions[:, :, None] - key_positions[:, None, :])
  slopes = jnp.asarray(alibi_slopes(num_heads), jnp.float32)
  return -slopes[None, :, None, None] * distance[:, None].astype(jnp.float32)
