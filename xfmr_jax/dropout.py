"""Dropout (paper section 5.4) from cheap counter-hashed random bits.

Masks are a pure function of a PRNG key and the array's shape, like
``jax.random.bernoulli``, but drawn from a two-round integer hash of each
element's index instead of threefry: on a CPU, drawing dropout masks with
threefry is a large share of a whole train step.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp


# Dropout keeps an element when 16 random bits are at or above
# ``round(rate * 2**16)``: the rate is honoured to 2**-16, and each 32-bit
# word serves two elements.
_DROPOUT_BITS = 16


def _mix32(x):
  """A bijection of uint32 with full avalanche (Wellons' "lowbias32" hash):
  every input bit flips each output bit with probability close to 1/2."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def random_words(rng: jax.Array, shape) -> jnp.ndarray:
  """Uniform uint32 words of ``shape``: each element's flat index hashed under
  two key words drawn from ``rng``.

  Counter-based like threefry, and as much a pure function of ``(rng,
  shape)``, but much cheaper per word on a CPU (two multiply-xorshift rounds
  instead of twenty threefry rounds), where threefry-drawn dropout masks are a
  large share of a train step. Good for dropout masks, not for cryptography.
  """
  k = jax.random.bits(rng, (2,), jnp.uint32)
  index = jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape)
  return _mix32(_mix32(index ^ k[0]) + k[1])


def dropout(x, rate: float, rng: jax.Array):
  """Inverted dropout: zero each element with probability ``rate`` and scale
  the kept ones by ``1 / (1 - rate)``.

  Args:
    x: any shape (at most 2**32 elements).
    rate: the drop probability, in ``[0, 1)``.
    rng: a PRNG key; the mask is a pure function of it and ``x.shape``.
  """
  if rate == 0.0:
    return x
  if not 0.0 < rate < 1.0:
    raise ValueError(f'dropout rate must be in [0, 1), got {rate!r}')
  threshold = jnp.uint32(round(rate * 2 ** _DROPOUT_BITS))
  lo = lambda w: (w & jnp.uint32(0xFFFF)) >= threshold
  hi = lambda w: (w >> 16) >= threshold
  if x.ndim and x.shape[-1] % 2 == 0:
    # Word i of a row drops element i (low bits) and i + width/2 (high bits).
    words = random_words(rng, (*x.shape[:-1], x.shape[-1] // 2))
    keep = jnp.concatenate([lo(words), hi(words)], axis=-1)
  else:
    words = random_words(rng, ((x.size + 1) // 2,))
    keep = jnp.stack([lo(words), hi(words)], -1).reshape(-1)[:x.size]
    keep = keep.reshape(x.shape)
  scale = jnp.asarray(1.0 / (1.0 - rate), x.dtype)
  return jnp.where(keep, x * scale, jnp.zeros_like(x))


class Dropout(nn.Module):
  """Dropout on ``x`` unless ``deterministic``; draws from the ``dropout`` rng."""
  rate: float

  @nn.compact
  def __call__(self, x, deterministic: bool):
    if deterministic or self.rate == 0.0:
      return x
    return dropout(x, self.rate, self.make_rng('dropout'))

