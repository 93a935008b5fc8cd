"""Sliding-window (local) attention with optional global tokens (Longformer).

Query i sees key j when both are in the same segment and ``|i - j| <= window``
(causal: ``0 <= i - j <= window``), counted in slots of the row. The first
``global_tokens`` slots of a row are global: they see every key of their
segment and every query of their segment sees them (causal: still only
earlier ones).

Computed blockwise, so memory is O(n * window), never O(n^2): the row is cut
into chunks of ``window`` slots; a chunk's queries can only reach keys in the
chunk itself and its neighbours (the previous one when causal), so each chunk
runs dense attention (:func:`xfmr_jax.attention.dot_product_attention`, chunks
folded into the batch) over ``3 * window`` keys (``2 * window`` causal) plus
the global keys. Global queries get full rows of their own (O(n * global)).

Cached decoding keeps the global slots and a ring buffer of the last
``window`` keys, so the cache does not grow with the output
(:func:`cached_attention`).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from xfmr_jax import attention

# (query_positions [B, q], key_positions [B, k]) -> bias [B, heads, q, k].
BiasFn = Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray]


def visible(q_slots, k_slots, q_segments, k_segments, *, window: int,
            causal: bool, global_tokens: int = 0):
  """The local mask ``[..., q, k]`` between slots and their segment ids.

  Args:
    q_slots: ``[..., q]`` int slot of each query; k_slots ``[..., k]``.
    q_segments, k_segments: segment ids of the same shapes (0 = padding).
  """
  dist = q_slots[..., :, None] - k_slots[..., None, :]
  near = dist <= window if causal else jnp.abs(dist) <= window
  if global_tokens:
    glob = (q_slots[..., :, None] < global_tokens) | (
        k_slots[..., None, :] < global_tokens)
    near = near | (glob if not causal else glob & (dist >= 0))
  if causal:
    near = near & (dist >= 0)
  same = q_segments[..., :, None] == k_segments[..., None, :]
  return near & same & (q_segments[..., :, None] > 0) & (
      k_segments[..., None, :] > 0)


def _chunks(x, chunk: int, causal: bool):
  """``[b, n, ...] -> [b, n / chunk, keys, ...]``: each chunk's neighbourhood,
  ``keys = 2 * chunk`` (previous + own) or ``3 * chunk`` (+ next)."""
  b, n = x.shape[:2]
  blocks = x.reshape(b, n // chunk, chunk, *x.shape[2:])
  pad = [(0, 0), (1, 1)] + [(0, 0)] * (blocks.ndim - 2)
  padded = jnp.pad(blocks, pad)  # zero segments: the edge chunks see nothing
  parts = [padded[:, :-2], padded[:, 1:-1]] + ([] if causal else
                                               [padded[:, 2:]])
  return jnp.concatenate(parts, axis=2)


def local_attention(query, key, value, segments, *, window: int,
                    causal: bool, global_tokens: int = 0, positions=None,
                    bias_fn: BiasFn | None = None, dropout_rate: float = 0.0,
                    dropout_rng=None):
  """Blockwise local attention (see the module docstring).

  Args:
    query: ``[batch, n, heads, head_dim]``.
    key, value: ``[batch, n, kv_heads, head_dim]``.
    segments: ``[batch, n]`` int segment ids (0 = padding: sees nothing and
      is seen by nothing).
    window: keys on each side (causal: before) a query sees, >= 1.
    positions: ``[batch, n]`` positions handed to ``bias_fn`` (e.g. ALiBi).
    dropout_rate, dropout_rng: dropout on the attention weights.

  Returns:
    ``[batch, n, heads, head_dim]``; queries without a visible key get 0.
  """
  b, n = segments.shape
  chunk = min(window, n)
  padded = -(-n // chunk) * chunk
  pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - n)] +
                          [(0, 0)] * (x.ndim - 2))
  q, k, v, seg = map(pad, (query, key, value, segments))
  slots = jnp.broadcast_to(jnp.arange(padded), (b, padded))
  pos = slots if positions is None else pad(positions)
  nc = padded // chunk
  fold = lambda x: x.reshape(b * nc, *x.shape[2:])
  qb = fold(q.reshape(b, nc, chunk, *q.shape[2:]))
  q_slots, q_seg, q_pos = (x.reshape(b, nc, chunk) for x in (slots, seg, pos))
  # The zero-padded edge chunks have segment 0: they hide themselves.
  k_slots, k_seg, k_pos, kb, vb = (_chunks(x, chunk, causal)
                                   for x in (slots, seg, pos, k, v))
  # Global keys are attended through their own copy below; inside the band
  # they are hidden so that no key is counted twice.
  k_seg_band = jnp.where(k_slots < global_tokens, 0, k_seg)
  if global_tokens:
    def prepend_globals(row, per_chunk):  # [b, n', ...], [b, nc, keys, ...]
      first = row[:, None, :global_tokens]
      return jnp.concatenate(
          [jnp.broadcast_to(first, (b, nc) + first.shape[2:]), per_chunk], 2)
    kb, vb, k_slots, k_pos, k_seg_band = (
        prepend_globals(row, per_chunk) for row, per_chunk in
        ((k, kb), (v, vb), (slots, k_slots), (pos, k_pos), (seg, k_seg_band)))
  mask = visible(q_slots, k_slots, q_seg, k_seg_band, window=window,
                 causal=causal, global_tokens=global_tokens)
  bias = None if bias_fn is None else bias_fn(fold(q_pos), fold(k_pos))
  out = attention.dot_product_attention(
      qb, fold(kb), fold(vb), fold(mask)[:, None], bias,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  out = out.reshape(b, padded, *out.shape[2:])[:, :n]
  if global_tokens:  # global queries: full rows over the whole sequence
    g = min(global_tokens, n)
    g_mask = visible(slots[:, :g], slots[:, :n], segments[:, :g], segments,
                     window=window, causal=causal, global_tokens=global_tokens)
    g_bias = None if bias_fn is None else bias_fn(pos[:, :g], pos[:, :n])
    out_g = attention.dot_product_attention(
        query[:, :g], key, value, g_mask[:, None], g_bias,
        dropout_rate=dropout_rate,
        dropout_rng=None if dropout_rng is None else jax.random.fold_in(
            dropout_rng, 1))
    out = out.at[:, :g].set(out_g)
  return out


def fused_local_attention(query, key, value, segments, *, window: int,
                          causal: bool, bias=None, implementation: str):
  """Local attention through ``jax.nn.dot_product_attention(local_window_size=
  ...)`` ('xla', or 'cudnn' on NVIDIA GPUs); no global tokens. The segment
  mask is passed dense, as that function takes it."""
  mask = jnp.broadcast_to(
      (segments[:, :, None] == segments[:, None, :]) & (segments > 0)[:, :, None]
      & (segments > 0)[:, None, :], segments.shape + segments.shape[1:])
  return attention.dot_product_attention(
      query, key, value, mask[:, None], bias, implementation=implementation,
      local_window=(window, 0 if causal else window))


# ---------------------------------------------------------------- decoding --

def init_cache(batch: int, kv_heads: int, head_dim: int, *, window: int,
               global_tokens: int, dtype) -> dict:
  """An empty decoding cache of ``global_tokens + window`` slots.

  ``key``/``value`` ``[batch, slots, kv_heads, head_dim]``; ``slot`` ``[batch,
  slots]`` the row slot each entry holds (-1: empty); ``visible`` ``[batch,
  slots]`` whether its key may be seen; ``position`` ``[batch, slots]`` its
  position (for a bias). Entries ``0 .. global_tokens - 1`` hold the global
  slots, the rest a ring buffer of the last ``window`` slots.
  """
  size = global_tokens + window
  return dict(key=jnp.zeros((batch, size, kv_heads, head_dim), dtype),
              value=jnp.zeros((batch, size, kv_heads, head_dim), dtype),
              slot=jnp.full((batch, size), -1, jnp.int32),
              visible=jnp.zeros((batch, size), bool),
              position=jnp.zeros((batch, size), jnp.int32))


def cached_attention(cache: dict, query, key, value, keys_visible, positions,
                     step, *, window: int, global_tokens: int = 0,
                     bias_fn: BiasFn | None = None):
  """Causal local attention of ``q`` new tokens at slots ``step .. step+q-1``
  over the cache and themselves; returns ``(out [batch, q, heads, head_dim],
  updated cache)``.

  Args:
    cache: see :func:`init_cache`.
    query: ``[batch, q, heads, head_dim]``; key, value ``[batch, q, kv_heads,
      head_dim]``.
    keys_visible: ``[batch, q]`` whether each new key may be seen.
    positions: ``[batch, q]`` positions of the new tokens (for ``bias_fn``).
    step: int32 scalar, the slot of the first new token.
  """
  q = query.shape[1]
  if q == 0:
    return query, cache
  size = cache['slot'].shape[1]
  new_slots = step + jnp.broadcast_to(jnp.arange(q), keys_visible.shape)
  k_slots = jnp.concatenate([cache['slot'], new_slots], axis=1)
  # A ring entry of a global slot duplicates the global entry: hide it.
  ring = jnp.arange(size) >= global_tokens
  stale = ring & (cache['slot'] < global_tokens)
  k_vis = jnp.concatenate([cache['visible'] & ~stale & (cache['slot'] >= 0),
                           keys_visible], axis=1)
  mask = visible(new_slots, k_slots, jnp.ones_like(new_slots),
                 k_vis.astype(jnp.int32), window=window, causal=True,
                 global_tokens=global_tokens)
  keys = jnp.concatenate([cache['key'], key.astype(cache['key'].dtype)], 1)
  values = jnp.concatenate([cache['value'],
                            value.astype(cache['value'].dtype)], 1)
  bias = None if bias_fn is None else bias_fn(
      positions, jnp.concatenate([cache['position'], positions], axis=1))
  out = attention.dot_product_attention(query, keys, values, mask[:, None],
                                        bias)
  # Which new slot each entry holds next: global entry e holds slot e; ring
  # entry r the newest slot s with (s - global_tokens) % window == r.
  last = step + q - 1
  r = jnp.arange(size) - global_tokens
  target = jnp.where(ring, last - (last - global_tokens - r) % window,
                     jnp.arange(size))
  take = (target >= step) & (target <= last)
  index = jnp.clip(target - step, 0, q - 1)
  pick = lambda old, new: jnp.where(
      take.reshape((1, size) + (1,) * (old.ndim - 2)), new[:, index], old)
  updated = dict(key=pick(cache['key'], key), value=pick(cache['value'], value),
                 slot=pick(cache['slot'], new_slots),
                 visible=pick(cache['visible'], keys_visible),
                 position=pick(cache['position'], positions.astype(jnp.int32)))
  return out, updated
