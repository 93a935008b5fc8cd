"""Attention masks (paper section 3.2.3).

Every mask is boolean and broadcastable to ``[batch, heads, query_length,
key_length]``; ``True`` means "may attend". Masks combine with logical AND, so a
token attends to a key only if every mask allows it.
"""
from __future__ import annotations

import jax.numpy as jnp

PAD_ID = 0


def causal_mask(query_length: int, key_length: int | None = None) -> jnp.ndarray:
  """Lower-triangular mask ``[1, 1, q, k]``: query i sees keys 0..i.

  With ``key_length > query_length`` the queries are aligned to the *end* of the
  keys (the last query sees every key), which is what a decoder continuing a
  prefix needs.
  """
  key_length = query_length if key_length is None else key_length
  offset = key_length - query_length
  q = jnp.arange(query_length)[:, None]
  k = jnp.arange(key_length)[None, :]
  return (k <= q + offset)[None, None]


def padding_mask(query_tokens: jnp.ndarray, key_tokens: jnp.ndarray,
                 pad_id: int = PAD_ID) -> jnp.ndarray:
  """Mask ``[batch, 1, q, k]`` that hides padding keys and padding queries.

  Args:
    query_tokens: ``[batch, q]`` token ids.
    key_tokens: ``[batch, k]`` token ids.
  """
  q_ok = query_tokens != pad_id
  k_ok = key_tokens != pad_id
  return (q_ok[:, None, :, None] & k_ok[:, None, None, :])


def segment_mask(query_segments: jnp.ndarray,
                 key_segments: jnp.ndarray) -> jnp.ndarray:
  """Mask ``[batch, 1, q, k]`` for packed rows: attend only inside one's segment.

  Segment ids are ``1, 2, ...`` for the packed sequences and ``0`` for padding,
  which attends to nothing and is attended by nothing.
  """
  same = query_segments[:, :, None] == key_segments[:, None, :]
  real = (query_segments[:, :, None] > 0) & (key_segments[:, None, :] > 0)
  return (same & real)[:, None]


def combine_masks(*masks: jnp.ndarray | None) -> jnp.ndarray | None:
  """Logical AND of the masks that are not ``None`` (``None`` if all are)."""
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  out = masks[0]
  for m in masks[1:]:
    out = out & m
  return out
