"""How a beam search lays out the decoding cache, so that beams never copy it.

A beam search over ``batch`` sentences with ``g`` beams each decodes ``batch
* g`` rows, sentence-major (rows ``r * g .. r * g + g - 1`` are sentence
``r``'s beams). Two rules keep its cache from moving at every step:

* **Cross-attention keys/values stay one row per sentence.** All beams of a
  sentence would hold the same copy, so the cache keeps it once and the
  beams' queries read it together (:func:`group_rows`): one read of the
  source per sentence, not per beam.
* **The self-attention cache is append-only.** A sentence's beams share one
  cache block ``[kv_heads, g * slots, head_dim]`` (their ``g`` parts of
  ``slots`` in turn); each beam writes its new
  keys/values to its own part and slot, and a ``cached_beam`` table ``[rows,
  g, slots]`` (bool) says which of the sentence's ``g`` parts holds slot
  ``j`` of beam ``r``'s history. When a beam takes over another's
  hypothesis, only its table row is copied (:func:`reorder`), and the
  sentence's beams attend together over the block's filled slots under the
  table (:func:`group_beams`): no gather and no transpose of the cache. Copying
  every layer's keys and values from the parent beam instead took a quarter
  of a beam step.

Local and linear attention keep a summary of the history (a ring buffer or
a running sum) that cannot be shared this way, so their whole state is
copied from the parent, as a plain beam search does.

:mod:`xfmr_jax.decode` and :mod:`xfmr_jax.hf_beam` build and reorder the
cache with :func:`expand` and :func:`reorder`;
:class:`xfmr_jax.layers.MultiHeadAttention` reads it with
:func:`group_rows` and :func:`group_beams`.
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp


def batch_axis(model) -> int:
  """Cache leaves are ``[batch, ...]``, or ``[layers, batch, ...]`` if scanned."""
  return 1 if model.config.scan_layers else 0


# ------------------------------------------------- the beam search's side --

def _map_moving(cache, fn, table=None):
  """``fn(name, leaf)`` applied to every cache leaf that follows its beam:
  all but the cross-attention keys/values and, in a self-attention cache
  with a ``cached_beam`` table, only the table. ``table(cached_key)``, if
  given, adds that table to self-attention caches that have none."""
  def walk(name, tree):
    if not isinstance(tree, Mapping):
      return fn(name, tree)
    if name == 'cross_attention':
      return tree
    if 'cached_beam' in tree:
      return {**tree, 'cached_beam': fn('cached_beam', tree['cached_beam'])}
    out = {key: walk(key, value) for key, value in tree.items()}
    if table is not None and name == 'self_attention' and 'cached_key' in tree:
      out['cached_beam'] = table(out['cached_key'])
    return out
  return walk(None, cache)


def expand(model, cache, g: int):
  """The sentences' cache ``[batch, ...]`` as the cache of ``batch * g`` beam
  rows.

  Cross-attention stays per sentence. With full self-attention, each
  self-attention cache's keys and values ``[batch, kv_heads, slots, d]``
  become the sentence's block ``[batch, kv_heads, g * slots, d]`` (every
  beam's history starts as a copy of the sentence's, e.g. a prompt) and the
  cache gets ``cached_beam [batch * g, g, slots]`` (``[layers, ...]`` when
  scanned): every beam's history is in its own part. Other leaves (local or
  linear attention's state, ALiBi's positions) repeat per beam row.
  """
  axis = batch_axis(model)
  full = model.config.attention_kind == 'full'

  def table(key):  # key: [(layers,) batch, kv_heads, g * slots, head_dim]
    rows, slots = key.shape[axis] * g, key.shape[-2] // g
    own = (jnp.arange(rows) % g)[:, None, None] == jnp.arange(g)[:, None]
    return jnp.broadcast_to(own, key.shape[:axis] + (rows, g, slots))

  def beams(name, x):
    if full and name in ('cached_key', 'cached_value'):
      x = jnp.expand_dims(x, -3)
      x = jnp.broadcast_to(x, x.shape[:-3] + (g,) + x.shape[-2:])
      return x.reshape(x.shape[:-3] + (-1, x.shape[-1]))
    return jnp.repeat(x, g, axis=axis)
  return _map_moving(cache, beams, table if full else None)


def reorder(model, cache, rows):
  """Each beam's cache taken from its parent beam: ``rows [batch * g]``
  indexes the cache rows (always of the same sentence). Moves the
  ``cached_beam`` tables, or local/linear attention's whole state."""
  axis = batch_axis(model)
  return _map_moving(cache, lambda _, x: jnp.take(x, rows, axis=axis))


# ------------------------------------------------------ the attention's side --

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


def group_beams(table, q, mask, positions, key_positions, step):
  """Self-attention of a sentence's beams over their shared cache block.

  Marks slots ``step .. step + n - 1`` of every beam as its own part's
  (where it has just written them), then groups: the ``g * n`` queries of a
  sentence attend together over all ``g * slots`` keys of its block, each
  seeing slot ``j`` only in the part its table names, which is exactly the
  attention over its own history.

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
