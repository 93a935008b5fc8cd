"""The decoding cache of an attention layer, and how the layer reads it.

Incremental decoding keeps an attention layer's keys and values in the
``cache`` collection, heads first (``[rows, kv_heads, slots, head_dim]``,
``kv_layout='bhkd'`` of :func:`xfmr_jax.attention.dot_product_attention`): a
decoding step's attention then reads the cache as it lies, with no transpose.

* **Cross-attention** (:func:`write_cross`, :func:`read_cross`): the keys and
  values of the encoder output, ``cached_key``/``cached_value`` ``[rows,
  kv_heads, source_length, head_dim]``, written on the first step and read
  back on the others, so each step projects only its new queries. The cache
  may hold fewer rows than the queries: ``g`` consecutive query rows with
  the same source share one cached row and read it together
  (:func:`group_rows`), one read of the source per cached row.
* **Self-attention** (:func:`update_self`): ``cached_key``/``cached_value``
  ``[rows, kv_heads, cache_len, head_dim]`` (keys already rotated under
  RoPE; under ALiBi also ``cached_position`` ``[rows, cache_len]``). The
  ``q`` new tokens are written at slots ``step .. step + q - 1`` and each
  attends to the slots up to its own.
* **A self-attention block shared by g rows**: ``g`` consecutive rows may
  keep their histories in one block ``[rows / g, kv_heads, g * slots,
  head_dim]``, the ``g`` parts of ``slots`` in turn, with a table
  ``cached_beam`` ``[rows, g, slots]`` (bool) that says which part holds
  slot ``j`` of row ``r``'s history. Each row appends to its own part, and
  the ``g`` rows attend together over the whole block, each seeing slot
  ``j`` only in the part its table names (:func:`group_beams`): a row can
  take over another row's history by copying only its table row, never the
  keys and values. The block is kept merged, as the attention reads it:
  kept as ``[..., g, slots, ...]`` and merged for each read, XLA's CPU
  backend wrote it twice per step and copied it three times.

A beam search (a sentence's ``g`` beams are the ``g`` rows) builds the shared
cross-attention rows and the shared block, and moves the tables when beams
take over each other's hypotheses: :mod:`xfmr_jax.beam_cache`. Local and
linear attention keep other state (:mod:`xfmr_jax.long_attention`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xfmr_jax import masks


def write_cross(module, k, v):
  """Store cross-attention keys and values ``[rows, k, kv_heads, head_dim]``
  in ``module``'s cache, heads first; returns them as stored."""
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  module.put_variable('cache', 'cached_key', k)
  module.put_variable('cache', 'cached_value', v)
  return k, v


def read_cross(module):
  """``module``'s cached cross-attention keys and values ``[cached_rows,
  kv_heads, source_length, head_dim]``."""
  k = module.get_variable('cache', 'cached_key')
  v = module.get_variable('cache', 'cached_value')
  if k is None:
    raise ValueError('cross-attention cache is empty: pass the encoder '
                     'output on the first decoding step')
  return k, v


def group_rows(q, mask, cached_rows: int):
  """The queries of ``g = rows / cached_rows`` consecutive rows as the
  queries of one row, to read that row's cached cross-attention K/V.

  q: ``[rows, n, heads, head_dim] -> [cached_rows, g * n, heads, head_dim]``;
  mask (or None): ``[rows or 1, 1, n or 1, s] -> [cached_rows or 1, 1, g * n
  or 1, s]``. The attention's output ``[cached_rows, g * n, ...]`` reshapes
  back to ``[rows, n, ...]``.
  """
  rows, n = q.shape[:2]
  if rows % cached_rows:
    raise ValueError(f'{rows} query rows cannot share a cross-attention cache '
                     f'of {cached_rows} rows')
  g = rows // cached_rows
  q = q.reshape(cached_rows, g * n, *q.shape[2:])
  if mask is not None and mask.shape[0] != 1:
    mask = jnp.broadcast_to(mask, (rows, 1, n, mask.shape[-1]))
    mask = mask.reshape(cached_rows, 1, g * n, -1)
  return q, mask


def update_self(module, k, v, positions, cache_len, step):
  """Write ``[rows, q, kv_heads, head_dim]`` new K/V at ``step`` into
  ``module``'s self-attention cache (created on the first call, of
  ``cache_len`` slots).

  Returns the cached keys and values ``[rows, kv_heads, cache_len,
  head_dim]`` (with a shared block, ``[rows / g, kv_heads, g * slots,
  head_dim]``: the ``g`` rows' parts in turn), the cached key positions
  ``[rows, cache_len]`` (when ``positions`` of the new tokens are given,
  for ALiBi; else None) and the causal mask ``[1, 1, q, cache_len]`` over a
  row's slots (new slot ``step + i`` sees slots ``0 .. step + i``).
  """
  rows, length, heads, head_dim = k.shape
  if not module.has_variable('cache', 'cached_key') and cache_len is None:
    raise ValueError("the first cache='self' call needs cache_len")
  shape = (rows, heads, cache_len, head_dim)
  cached_key = module.variable('cache', 'cached_key', jnp.zeros, shape,
                               k.dtype)
  cached_value = module.variable('cache', 'cached_value', jnp.zeros, shape,
                                 v.dtype)
  slots = cached_key.value.shape[-2]
  if module.has_variable('cache', 'cached_beam'):
    # A shared block: [rows / g, heads, g * slots, d], each row's part in turn.
    g, slots = module.get_variable('cache', 'cached_beam').shape[-2:]
    batch = rows // g
    # One in-place update per part: updated through a [..., g, slots, ...]
    # view, the block made XLA's CPU backend copy it whole at every step
    # once the attention reads it in a lax.switch.
    for var, x in ((cached_key, k), (cached_value, v)):
      x = x.reshape(batch, g, length, heads, head_dim).transpose(0, 1, 3, 2, 4)
      for part in range(g):
        var.value = jax.lax.dynamic_update_slice(
            var.value, x[:, part], (0, 0, part * slots + step, 0))
  else:
    for var, x in ((cached_key, k), (cached_value, v)):
      var.value = jax.lax.dynamic_update_slice(
          var.value, x.transpose(0, 2, 1, 3), (0, 0, step, 0))
  key_positions = None
  if positions is not None and module.config.positional == 'alibi':
    cached_position = module.variable('cache', 'cached_position', jnp.zeros,
                                      (rows, slots), jnp.int32)
    cached_position.value = jax.lax.dynamic_update_slice(
        cached_position.value, positions.astype(jnp.int32), (0, step))
    key_positions = cached_position.value
  mask = masks.cache_mask(step, length, slots)
  return cached_key.value, cached_value.value, key_positions, mask


def group_shared(module, q, mask, positions, key_positions, step):
  """:func:`group_beams` on ``module``'s ``cached_beam`` table, which it
  updates.

  Returns ``(g, (q, mask, positions, key_positions))``: the block's parts
  and the grouped arguments; a cache with no table (each row's own) gives
  ``1`` and the arguments unchanged.
  """
  if not module.has_variable('cache', 'cached_beam'):
    return 1, (q, mask, positions, key_positions)
  table, grouped = group_beams(module.get_variable('cache', 'cached_beam'), q,
                               mask, positions, key_positions, step)
  module.put_variable('cache', 'cached_beam', table)
  return table.shape[-2], grouped


def group_beams(table, q, mask, positions, key_positions, step):
  """Self-attention of ``g`` rows over the cache block they share.

  Marks slots ``step .. step + n - 1`` of every row as its own part's
  (where it has just written them), then groups: the ``g * n`` queries of
  the ``g`` rows attend together over all ``g * slots`` keys of their
  block, each seeing slot ``j`` only in the part its table names, which is
  exactly the attention over its own history.

  Args:
    table: ``cached_beam`` ``[rows, g, slots]`` bool.
    q: ``[rows, n, heads, head_dim]``.
    mask: ``[rows or 1, 1, n or 1, slots]``, the slots each query may see.
    positions: ``[rows, n]`` or None; key_positions: ``[rows, slots]`` or None.

  Returns:
    the updated table and ``(q, mask, positions, key_positions)`` grouped to
    ``[rows / g, g * n, ...]``, mask ``[rows / g, 1, g * n, g * slots]``,
    key positions ``[rows / g, g * slots]`` (the order of the block's keys);
    the attention's output ``[rows / g, g * n, ...]`` reshapes back to
    ``[rows, n, ...]``.
  """
  rows, g, slots = table.shape
  n = q.shape[1]
  own = (jnp.arange(rows) % g)[:, None] == jnp.arange(g)[None, :]
  table = jax.lax.dynamic_update_slice(
      table, jnp.broadcast_to(own[:, :, None], (rows, g, n)), (0, 0, step))
  batch = rows // g
  mask = jnp.broadcast_to(mask, (rows, 1, n, slots)).reshape(batch, g, n, 1,
                                                             slots)
  mask = mask & table.reshape(batch, g, 1, g, slots)
  group = lambda x: None if x is None else x.reshape(
      batch, g * x.shape[1], *x.shape[2:])
  return table, (group(q), mask.reshape(batch, 1, g * n, g * slots),
                 group(positions), group(key_positions))
