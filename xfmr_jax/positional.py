"""Positional encodings (paper section 3.5).

``PE(pos, 2i) = sin(pos / 10000^(2i / d_model))`` and
``PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))``: sine on even dimensions and
cosine on odd ones, interleaved exactly as in the paper. For every offset ``k``
there is a fixed block-diagonal rotation ``M_k`` with ``PE(pos + k) = M_k PE(pos)``
(see :func:`offset_matrix`), which is why the model can attend by relative position.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _inverse_frequencies(d_model: int, max_timescale: float) -> jnp.ndarray:
  """``1 / max_timescale^(2i / d_model)`` for ``i = 0 .. d_model/2 - 1``."""
  two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)
  return jnp.exp(-jnp.log(max_timescale) * two_i / d_model)


def sinusoidal_encoding(positions: jnp.ndarray, d_model: int,
                        max_timescale: float = 10_000.0) -> jnp.ndarray:
  """Sinusoidal encoding of integer positions.

  Args:
    positions: integer array of any shape ``[...]`` (for example ``[length]`` or,
      for packed rows, ``[batch, length]`` of per-segment positions).
    d_model: even model width.

  Returns:
    float32 ``[..., d_model]`` with sin on even and cos on odd dimensions.
  """
  if d_model % 2:
    raise ValueError(f'sinusoidal encoding needs an even d_model, got {d_model}')
  angles = positions.astype(jnp.float32)[..., None] * _inverse_frequencies(
      d_model, max_timescale)
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
