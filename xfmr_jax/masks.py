"""Attention masks (paper section 3.2.3), and the masks each model assembles
from them.

Every mask is boolean and broadcastable to ``[batch, heads, query_length,
key_length]``; ``True`` means "may attend". Masks combine with logical AND, so a
token attends to a key only if every mask allows it.

Self-attention masks are first built as a :class:`SelfMask` (segment ids and
causality, O(n) memory): full attention materialises it with
:meth:`SelfMask.dense`, while local and linear attention read the segments
directly and never form an ``n x n`` mask.
"""
from __future__ import annotations

from flax import struct
import jax.numpy as jnp

from xfmr_jax.token_ids import PAD


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
                 pad_id: int = PAD) -> jnp.ndarray:
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


# ------------------------------------------------ masks the models assemble --

@struct.dataclass
class SelfMask:
  """Who sees whom in one self-attention, in O(n) memory.

  Query i sees key j iff ``segments[i] == segments[j] != 0`` and, when
  ``causal``, ``j <= i``. ``segments`` ``[batch, n]``: 1, 2, ... per packed
  sequence (1 everywhere in an unpacked row), 0 for padding.
  """
  segments: jnp.ndarray
  causal: bool = struct.field(pytree_node=False, default=False)

  def dense(self) -> jnp.ndarray:
    """The same mask as an array ``[batch, 1, n, n]``."""
    return combine_masks(
        causal_mask(self.segments.shape[1]) if self.causal else None,
        segment_mask(self.segments, self.segments))


def self_mask(tokens, segmentation=None, causal: bool = False) -> SelfMask:
  """The :class:`SelfMask` of ``tokens`` ``[batch, n]``: padding ids hidden
  and, in packed rows, the other segments."""
  real = tokens != PAD
  segments = real.astype(jnp.int32) if segmentation is None else jnp.where(
      real, segmentation, 0)
  return SelfMask(segments, causal)


def encoder_mask(inputs, inputs_segmentation=None):
  """Encoder self-attention ``[batch, 1, s, s]``: padding (and, in packed
  rows, other segments) hidden. inputs: ``[batch, s]`` ids."""
  return self_mask(inputs, inputs_segmentation).dense()


def decoder_masks(inputs, targets, inputs_segmentation=None,
                  targets_segmentation=None):
  """``(self_mask [batch, 1, t, t], cross_mask [batch, 1, t, s])`` of the
  teacher-forced decoder.

  The shifted decoder inputs start with the pad id, so padding is read off the
  unshifted ``targets`` ``[batch, t]``; ``inputs`` ``[batch, s]`` are the source.
  """
  return (self_mask(targets, targets_segmentation, causal=True).dense(),
          cross_mask(inputs, targets, inputs_segmentation,
                     targets_segmentation))


def cross_mask(inputs, targets, inputs_segmentation=None,
               targets_segmentation=None):
  """Teacher-forced cross-attention ``[batch, 1, t, s]``: target padding
  queries and source padding keys hidden, and other segments in packed rows."""
  return combine_masks(
      padding_mask(targets, inputs),
      None if targets_segmentation is None else
      segment_mask(targets_segmentation, inputs_segmentation))


def key_mask(keys_visible):
  """``[batch, k]`` booleans -> ``[batch, 1, 1, k]``: which keys any query sees."""
  return keys_visible[:, None, None, :]


def source_key_mask(inputs):
  """Cross-attention while decoding ``[batch, 1, 1, s]``: source padding hidden."""
  return key_mask(inputs != PAD)


def prefix_lm_mask(segments):
  """Causal attention within each segment of one sequence ``[batch, n]``
  (segment ids, 0 = padding): the decoder-only model over ``source EOS target``."""
  return SelfMask(segments, causal=True).dense()


def cache_mask(step, query_length: int, cache_len: int):
  """``[1, 1, q, cache_len]`` over a decoding cache: the new token in slot
  ``step + i`` sees slots ``0 .. step + i``."""
  slots = step + jnp.arange(query_length)
  keys = jnp.arange(cache_len)
  return (keys[None, :] <= slots[:, None])[None, None]
