"""The multi-head attention layer (paper section 3.2.2).

:class:`MultiHeadAttention` projects its inputs to heads, hands them to the
attention that fits the call, and projects the heads back:

* full attention without a cache:
  :func:`xfmr_jax.attention.dot_product_attention` in the configured
  implementation;
* local or linear self-attention (``kind``): :mod:`xfmr_jax.long_attention`;
* a decoding step of full attention: the layer's cache
  (:mod:`xfmr_jax.kv_cache`), read by the einsum path.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from xfmr_jax import attention, kv_cache, long_attention, positional
from xfmr_jax.config import ModelConfig
from xfmr_jax.layers import dense


class MultiHeadAttention(nn.Module):
  """``MultiHead(Q, K, V) = Concat(head_1..head_h) W^O`` (section 3.2.2).

  Self-attention when ``inputs_kv is inputs_q``; cross-attention otherwise
  (query and key lengths may differ). Keys and values have
  ``config.kv_heads`` heads (fewer than the queries for GQA/MQA).
  ``positions`` (``[batch, q]``, the positions of ``inputs_q``) are given to
  self-attention only: RoPE rotates queries and keys by them, ALiBi turns
  them into a distance bias. With the reference implementation the
  attention weights ``[batch, heads, q, k]`` are sown into the
  ``intermediates`` collection for visualisation.

  Its parameters are the ``Dense`` layers ``query``, ``key``, ``value`` and
  ``out``.

  Incremental decoding keeps keys and values in the ``cache`` collection
  (the layouts: :mod:`xfmr_jax.kv_cache`):

  * ``cache='self'``: causal self-attention; the ``q`` new tokens are
    written at slots ``step .. step + q - 1`` of a cache of ``cache_len``
    slots (given on the first call) and each attends to the slots up to
    its own, reading a large cache only up to its filled slots
    (:func:`attention.filled_cache_attention`).
  * ``cache='cross'``: the keys and values of ``inputs_kv`` (the encoder
    output) are computed when it is given and cached; with
    ``inputs_kv=None`` they are read back, so each decoding step projects
    only its new query.

  ``kind`` 'local' or 'linear' (self-attention only; ``mask`` is then a
  :class:`~xfmr_jax.masks.SelfMask`) computes the attention in
  :mod:`xfmr_jax.long_attention`, whose ``cache='self'`` holds a ring
  buffer of ``attention_window`` keys (plus the global ones) or the linear
  state ``(S, z)``, never ``cache_len`` keys.
  """
  config: ModelConfig
  kind: str = 'full'

  @nn.compact
  def __call__(self, inputs_q, inputs_kv, mask=None, deterministic=True, *,
               positions=None, cache: str | None = None,
               cache_len: int | None = None, step=None):
    """inputs_q: ``[batch, q, d_model]``; inputs_kv: ``[batch, k, d_model]``."""
    cfg = self.config
    if cache not in (None, 'self', 'cross'):
      raise ValueError(f"cache must be None, 'self' or 'cross', got {cache!r}")
    q = self._heads('query', cfg.num_heads, inputs_q)
    if cache == 'cross' and inputs_kv is None:
      out = self._cached_cross_attention(q, mask, positions, deterministic)
      return self._output(out)
    k = self._heads('key', cfg.kv_heads, inputs_kv)
    v = self._heads('value', cfg.kv_heads, inputs_kv)
    if positions is not None and cfg.positional == 'rope':
      q = positional.rotary(q, positions)
      k = positional.rotary(k, positions)
    if self.kind != 'full':
      out = long_attention.attend(self, q, k, v, mask, positions,
                                  deterministic, cache, step)
    elif cache == 'self':
      out = self._self_cache_attention(q, k, v, mask, positions, deterministic,
                                       cache_len, step)
    else:
      if cache == 'cross':  # the first decoding step
        k, v = kv_cache.write_cross(self, k, v)
      out = self._attend(q, k, v, mask, self._alibi(positions, positions),
                         deterministic, cache)
    return self._output(out)

  def _heads(self, name, heads, x):
    """The projection ``name`` of ``x`` ``[batch, n, d_model]`` as ``[batch,
    n, heads, head_dim]``."""
    cfg = self.config
    y = dense(heads * cfg.head_dim, ('embed', 'joined_kv'), name,
              jnp.dtype(cfg.dtype), cfg.use_bias)(x)
    return attention.split_heads(y, heads)

  def _output(self, out):
    """The heads ``[batch, q, heads, head_dim]`` merged and projected by
    ``out`` to ``[batch, q, d_model]``."""
    cfg = self.config
    return dense(cfg.d_model, ('joined_kv', 'embed'), 'out',
                 jnp.dtype(cfg.dtype), cfg.use_bias)(attention.merge_heads(out))

  def _alibi(self, positions, key_positions):
    """ALiBi's distance bias, or None (no ALiBi or no positions)."""
    cfg = self.config
    if positions is None or cfg.positional != 'alibi':
      return None
    return positional.alibi_bias(positions, key_positions, cfg.num_heads)

  def _cached_cross_attention(self, q, mask, positions, deterministic):
    """A later decoding step's cross-attention: the encoder's keys and
    values were cached on the first step. A cache of fewer rows than the
    queries is shared by consecutive query rows
    (:func:`kv_cache.group_rows`)."""
    k, v = kv_cache.read_cross(self)
    rows = q.shape[0]
    if k.shape[0] != rows:
      q, mask = kv_cache.group_rows(q, mask, k.shape[0])
    out = self._attend(q, k, v, mask, self._alibi(positions, positions),
                       deterministic, 'cross')
    return out.reshape(rows, -1, *out.shape[2:])  # undoes the grouping

  def _self_cache_attention(self, q, k, v, mask, positions, deterministic,
                            cache_len, step):
    """A decoding step's self-attention: the new keys and values written to
    the cache, the queries attending over its slots up to their own."""
    rows, n = q.shape[:2]
    k, v, key_positions, cache_mask = kv_cache.update_self(
        self, k, v, positions, cache_len, step)
    mask = cache_mask if mask is None else mask & cache_mask
    parts, (q, mask, positions, key_positions) = kv_cache.group_shared(
        self, q, mask, positions, key_positions, step)
    out = self._attend(q, k, v, mask, self._alibi(positions, key_positions),
                       deterministic, 'self', filled=step + n, parts=parts)
    return out.reshape(rows, -1, *out.shape[2:])  # undoes the grouping

  def _attend(self, q, k, v, mask, bias, deterministic, cache, *, filled=None,
              parts=1):
    """Full attention of the heads: keys and values ``[batch, k, kv_heads,
    head_dim]``, or heads first as a decoding cache keeps them (``cache``
    'self' or 'cross'), ``filled`` slots of each of its ``parts``."""
    cfg = self.config
    dropout_rng = None
    if not deterministic and cfg.attention_dropout_rate > 0:
      dropout_rng = self.make_rng('dropout')
    impl = cfg.attention_impl
    if cache is not None:
      # A decoding step reads the heads-first cache: the einsum takes it as
      # it lies, where the fused kernels (keys first) would transpose every
      # layer's whole cache at every step, for a few queries.
      impl = 'reference'
    elif impl == 'auto':
      impl = ('reference' if dropout_rng is not None else
              attention.resolve_implementation('auto'))
    if cache == 'self' and dropout_rng is None:
      return attention.filled_cache_attention(q, k, v, mask, bias,
                                              filled=filled, parts=parts)
    kv_layout = 'bkhd' if cache is None else 'bhkd'
    if impl == 'reference':
      out, weights = attention.dot_product_attention(
          q, k, v, mask, bias, dropout_rate=cfg.attention_dropout_rate,
          dropout_rng=dropout_rng, return_weights=True, kv_layout=kv_layout)
      self.sow('intermediates', 'attention_weights', weights)
      return out
    return attention.dot_product_attention(q, k, v, mask, bias,
                                           implementation=impl,
                                           kv_layout=kv_layout)
