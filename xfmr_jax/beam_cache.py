"""How a beam search lays out the decoding cache, so that beams never copy it.

A beam search over ``batch`` sentences with ``g`` beams each decodes ``batch
* g`` rows, sentence-major (rows ``r * g .. r * g + g - 1`` are sentence
``r``'s beams). Two rules keep its cache from moving at every step:

* **Cross-attention keys/values stay one row per sentence.** All beams of a
  sentence would hold the same copy, so the cache keeps it once and the
  beams' queries read it together: one read of the source per sentence, not
  per beam.
* **The self-attention cache is append-only.** A sentence's beams share one
  cache block ``[kv_heads, g * slots, head_dim]`` (their ``g`` parts of
  ``slots`` in turn); each beam writes its new keys/values to its own part
  and slot, and a ``cached_beam`` table ``[rows, g, slots]`` (bool) says
  which of the sentence's ``g`` parts holds slot ``j`` of beam ``r``'s
  history. When a beam takes over another's hypothesis, only its table row
  is copied (:func:`reorder`), and the sentence's beams attend together over
  the block's filled slots under the table: no gather and no transpose of
  the cache, where copying every layer's keys and values from the parent
  beam took a large part of a beam step (``docs/benchmarks.md``, "What made
  beam search faster").

Local and linear attention keep a summary of the history (a ring buffer or
a running sum) that cannot be shared this way, so their whole state is
copied from the parent, as a plain beam search does.

This module is the decoding side: the beam search loop
(:func:`xfmr_jax.beam_search.loop`, under every rule set) builds and reorders
the cache with :func:`expand` and :func:`reorder`, and keeps only the
sentences still decoding with :func:`select`. The reading side, how an attention layer attends over rows
that share a cache row or block, is the model's: :mod:`xfmr_jax.kv_cache`
(``group_rows``, ``group_beams``).
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


def select(model, cache, sentences, g: int):
  """The beam cache of the sentences ``sentences [n]`` (int32 indices) alone,
  their beams' rows in the same order: how a search drops the sentences that
  are done. Leaves held per sentence (cross-attention, a full self-attention
  block) take ``sentences``; per beam row (a ``cached_beam`` table, local or
  linear attention's state) take the sentences' ``g`` rows each."""
  axis = batch_axis(model)
  rows = (sentences[:, None] * g + jnp.arange(g)).reshape(-1)
  take = lambda index: lambda x: jnp.take(x, index, axis=axis)

  def walk(name, tree):
    if not isinstance(tree, Mapping):
      return take(rows)(tree)
    if name == 'cross_attention':
      return jax.tree.map(take(sentences), tree)
    if 'cached_beam' in tree:
      return {key: take(sentences if key in ('cached_key', 'cached_value')
                        else rows)(value) for key, value in tree.items()}
    return {key: walk(key, value) for key, value in tree.items()}
  return walk(None, cache)
