"""Sublayers of the Transformer (paper sections 3.1-3.3).

Pure functions for the math (``layer_norm``, ``rms_norm``, ``feed_forward``) and
Flax Linen modules that own the parameters and call them. Every parameter is
annotated with logical axis names (``embed``, ``mlp``, ``joined_kv``, ``vocab``)
that :mod:`xfmr_jax.sharding`-style rules can map onto a device mesh.
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from xfmr_jax import (activations, attention, beam_cache,
                      linear_attention, local_attention, masks, positional)
from xfmr_jax.config import ModelConfig
from xfmr_jax.dropout import Dropout


def layer_norm(x, scale, bias, epsilon: float = 1e-6):
  """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last axis.

  Statistics are taken in float32 whatever ``x.dtype`` is; the result has
  ``x.dtype``.
  """
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  var = jnp.square(xf - mean).mean(-1, keepdims=True)
  y = (xf - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias
  return y.astype(x.dtype)


def rms_norm(x, scale, epsilon: float = 1e-6):
  """``x / sqrt(mean(x^2) + eps) * scale``: LayerNorm without centring or bias."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + epsilon)
  return (y * scale).astype(x.dtype)


def linear(x, w):
  """``x @ w``: ``[..., in] @ [in, out] -> [..., out]``, as one 2-D product
  over the flattened tokens.

  Flattening first changes no value; it changes the backward pass. Autodiff
  of the 2-D product writes the weight gradient ``x^T dy`` as a 2-D
  contraction, which XLA's CPU backend runs at full matmul speed; contracted
  over two token axes (batch and length) it runs with both operands
  transposed, which is slower (``docs/benchmarks.md``).
  """
  y = x.reshape(-1, x.shape[-1]) @ w
  return y.reshape(*x.shape[:-1], w.shape[-1])


def feed_forward(x, w1, b1, w2, b2, activation: Callable = jax.nn.relu):
  """Position-wise FFN ``activation(x W1 + b1) W2 + b2`` (equation 2).

  Args:
    x: ``[..., d_model]``; w1: ``[d_model, d_ff]``; w2: ``[d_ff, d_model]``;
    b1, b2: biases, or None for bias-free layers.
  """
  h = linear(x, w1)
  if b1 is not None:
    h = h + b1
  y = linear(activation(h), w2)
  return y if b2 is None else y + b2


def swiglu_feed_forward(x, w_gate, w1, w2, gate=jax.nn.silu):
  """Gated FFN ``(gate(x W_gate) * x W1) W2`` (SwiGLU with swish, Shazeer 2020).

  Args:
    x: ``[..., d_model]``; w_gate, w1: ``[d_model, d_ff]``;
    w2: ``[d_ff, d_model]``. Bias-free, as usually trained.
  """
  return linear(gate(linear(x, w_gate)) * linear(x, w1), w2)


def _param(module: nn.Module, name: str, init, shape, axes):
  """A float32 parameter with logical axis names for sharding."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape,
                      jnp.float32)


class Dense(nn.Module):
  """``x @ kernel + bias`` through :func:`linear`: the parameters of
  ``nn.Dense`` (``kernel`` ``[in, features]``, Xavier-uniform; ``bias``
  ``[features]``, zeros; float32, logically named ``axes``), computed in
  ``dtype``."""
  features: int
  axes: tuple[str, str]
  dtype: jnp.dtype = jnp.float32
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    kernel = _param(self, 'kernel', nn.initializers.xavier_uniform(),
                    (x.shape[-1], self.features), self.axes)
    y = linear(x.astype(self.dtype), kernel.astype(self.dtype))
    if self.use_bias:
      y = y + _param(self, 'bias', nn.initializers.zeros, (self.features,),
                     (self.axes[-1],)).astype(self.dtype)
    return y


def dense(features: int, axes: tuple[str, str], name: str,
          dtype=jnp.float32, use_bias: bool = True) -> Dense:
  """A :class:`Dense` layer with logically named axes."""
  return Dense(features, axes, dtype, use_bias, name=name)


class Norm(nn.Module):
  """LayerNorm (default) or RMSNorm over the model width."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    scale = _param(self, 'scale', nn.initializers.ones, (x.shape[-1],),
                   ('embed',))
    if cfg.norm_type == 'rmsnorm':
      return rms_norm(x, scale, cfg.layer_norm_epsilon)
    bias = _param(self, 'bias', nn.initializers.zeros, (x.shape[-1],),
                  ('embed',))
    return layer_norm(x, scale, bias, cfg.layer_norm_epsilon)


class FeedForward(nn.Module):
  """Two linear maps with an activation between: ``d_model -> d_ff -> d_model``
  (with 'swiglu', a gated first map: three matrices, no biases)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    xavier = nn.initializers.xavier_uniform()
    zeros = nn.initializers.zeros
    gated = cfg.activation in activations.GATED
    biased = cfg.use_bias and not gated
    # A module draws its parameters in creation order, so the order wi, bi,
    # wo, bo is part of what a given random seed initialises.
    w1 = _param(self, 'wi', xavier, (cfg.d_model, cfg.d_ff), ('embed', 'mlp'))
    b1 = _param(self, 'bi', zeros, (cfg.d_ff,), ('mlp',)) if biased else None
    w2 = _param(self, 'wo', xavier, (cfg.d_ff, cfg.d_model), ('mlp', 'embed'))
    b2 = (_param(self, 'bo', zeros, (cfg.d_model,), ('embed',)) if biased
          else None)
    cast = lambda *ps: [None if p is None else p.astype(dtype) for p in ps]
    x = x.astype(dtype)
    if gated:
      gate = _param(self, 'wi_gate', xavier, (cfg.d_model, cfg.d_ff),
                    ('embed', 'mlp'))
      return swiglu_feed_forward(x, *cast(gate, w1, w2),
                                 gate=activations.GATED[cfg.activation])
    return feed_forward(x, *cast(w1, b1, w2, b2),
                        activation=activations.FUNCTIONS[cfg.activation])


class MultiHeadAttention(nn.Module):
  """``MultiHead(Q, K, V) = Concat(head_1..head_h) W^O`` (section 3.2.2).

  Self-attention when ``inputs_kv is inputs_q``; cross-attention otherwise (query
  and key lengths may differ). Keys and values have ``config.kv_heads`` heads
  (fewer than the queries for GQA/MQA). ``positions`` (``[batch, q]``, the
  positions of ``inputs_q``) are given to self-attention only: RoPE rotates
  queries and keys by them, ALiBi turns them into a distance bias. With the
  reference implementation the attention weights ``[batch, heads, q, k]`` are
  sown into the ``intermediates`` collection for visualisation.

  Incremental decoding keeps keys and values in the ``cache`` collection,
  heads first (``kv_layout='bhkd'`` of :func:`attention.dot_product_attention`:
  a decoding step's attention then needs no transpose of the cache):

  * ``cache='self'``: causal self-attention over ``cached_key`` and
    ``cached_value`` ``[batch, kv_heads, cache_len, head_dim]`` (keys already
    rotated under RoPE; under ALiBi also ``cached_position`` ``[batch,
    cache_len]``). The ``q`` new tokens are written at cache slots ``step ..
    step + q - 1`` and each attends to the slots up to its own; a large
    cache is read only up to its filled slots
    (:func:`attention.filled_cache_attention`).
  * ``cache='cross'``: the keys and values of ``inputs_kv`` (the encoder output)
    are computed when it is given and stored in ``cached_key``/``cached_value``
    ``[batch, kv_heads, source_length, head_dim]``; with ``inputs_kv=None``
    they are read back, so each decoding step projects only its new query.
    Beam search keeps one cached row per sentence for ``g`` query rows (its
    beams): a sentence's beams read it together
    (:func:`beam_cache.group_rows`).
  * beam search keeps a sentence's ``g`` beams together in a ``'self'``
    cache, ``[batch, kv_heads, g * cache_len, head_dim]`` (the ``g`` beams'
    parts in turn), with a ``cached_beam`` table: each beam appends to its
    own part and the beams read their histories through that table
    (:func:`beam_cache.group_beams`) instead of copying each other's caches.
    The block is kept merged, as the attention reads it: kept as ``[...,
    g, cache_len, ...]`` and merged for each read, XLA's CPU backend wrote
    it twice per step and copied it three times.

  ``kind`` 'local' or 'linear' (self-attention only; ``mask`` is then a
  :class:`~xfmr_jax.masks.SelfMask`) computes the attention in
  :mod:`xfmr_jax.local_attention` or :mod:`xfmr_jax.linear_attention`; their
  ``cache='self'`` holds a ring buffer of ``attention_window`` keys (plus
  the global ones) or the linear state ``(S, z)``, never ``cache_len`` keys.
  """
  config: ModelConfig
  kind: str = 'full'

  @nn.compact
  def __call__(self, inputs_q, inputs_kv, mask=None, deterministic=True, *,
               positions=None, cache: str | None = None,
               cache_len: int | None = None, step=None):
    """inputs_q: ``[batch, q, d_model]``; inputs_kv: ``[batch, k, d_model]``."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    proj = lambda name, heads: dense(heads * cfg.head_dim,
                                     ('embed', 'joined_kv'), name, dtype,
                                     cfg.use_bias)
    if cache not in (None, 'self', 'cross'):
      raise ValueError(f"cache must be None, 'self' or 'cross', got {cache!r}")
    relative = positions is not None and cfg.positional in ('rope', 'alibi')
    q = attention.split_heads(proj('query', cfg.num_heads)(inputs_q),
                              cfg.num_heads)
    key_positions = positions
    rows = q.shape[0]
    kv_layout = 'bkhd' if cache is None else 'bhkd'
    parts = 1  # a self-attention cache's parts: a beam search's beams, or one
    if cache == 'cross' and inputs_kv is None:
      # Later decoding steps: the encoder's keys/values were cached once.
      k = self.get_variable('cache', 'cached_key')
      v = self.get_variable('cache', 'cached_value')
      if k is None:
        raise ValueError('cross-attention cache is empty: pass the encoder '
                         'output on the first decoding step')
      if k.shape[0] != rows:
        q, mask = beam_cache.group_rows(q, mask, k.shape[0])
    else:
      k = attention.split_heads(proj('key', cfg.kv_heads)(inputs_kv),
                                cfg.kv_heads)
      v = attention.split_heads(proj('value', cfg.kv_heads)(inputs_kv),
                                cfg.kv_heads)
      if relative and cfg.positional == 'rope':
        q = positional.rotary(q, positions)
        k = positional.rotary(k, positions)
      if self.kind != 'full':
        out = self._long_attention(q, k, v, mask, positions, deterministic,
                                   cache, step)
        return dense(cfg.d_model, ('joined_kv', 'embed'), 'out', dtype,
                     cfg.use_bias)(attention.merge_heads(out))
      if cache == 'cross':
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        self.put_variable('cache', 'cached_key', k)
        self.put_variable('cache', 'cached_value', v)
      elif cache == 'self':
        k, v, key_positions, cache_mask = self._update_self_cache(
            k, v, positions if relative else None, cache_len, step)
        mask = cache_mask if mask is None else mask & cache_mask
        if self.has_variable('cache', 'cached_beam'):
          parts = self.get_variable('cache', 'cached_beam').shape[-2]
          q, mask, positions, key_positions = self._beam_group(
              q, mask, positions, key_positions, step)
    bias = None
    if relative and cfg.positional == 'alibi':
      bias = positional.alibi_bias(positions, key_positions, cfg.num_heads)
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
      out = attention.filled_cache_attention(
          q, k, v, mask, bias, filled=step + inputs_q.shape[1], parts=parts)
    elif impl == 'reference':
      out, weights = attention.dot_product_attention(
          q, k, v, mask, bias, dropout_rate=cfg.attention_dropout_rate,
          dropout_rng=dropout_rng, return_weights=True, kv_layout=kv_layout)
      self.sow('intermediates', 'attention_weights', weights)
    else:
      out = attention.dot_product_attention(q, k, v, mask, bias,
                                            implementation=impl,
                                            kv_layout=kv_layout)
    out = out.reshape(rows, -1, *out.shape[2:])  # undoes the grouping
    return dense(cfg.d_model, ('joined_kv', 'embed'), 'out', dtype,
                 cfg.use_bias)(attention.merge_heads(out))

  def _update_self_cache(self, k, v, positions, cache_len, step):
    """Write ``[rows, q, kv_heads, head_dim]`` new K/V at ``step``.

    Returns the cached keys and values ``[rows, kv_heads, cache_len,
    head_dim]`` (a beam search's ``[batch, kv_heads, g * cache_len,
    head_dim]``: its ``g`` beams' slots, beam-major), the cached key
    positions ``[rows, cache_len]`` (when ``positions`` of the new tokens
    are given, for ALiBi; else None) and the causal mask ``[1, 1, q,
    cache_len]`` over a row's slots (new slot ``step + i`` sees slots ``0 ..
    step + i``).
    """
    rows, length, heads, head_dim = k.shape
    if not self.has_variable('cache', 'cached_key') and cache_len is None:
      raise ValueError("the first cache='self' call needs cache_len")
    shape = (rows, heads, cache_len, head_dim)
    cached_key = self.variable('cache', 'cached_key', jnp.zeros, shape, k.dtype)
    cached_value = self.variable('cache', 'cached_value', jnp.zeros, shape,
                                 v.dtype)
    slots = cached_key.value.shape[-2]
    if self.has_variable('cache', 'cached_beam'):
      # A beam search: [batch, heads, g * slots, d], each beam's part in turn.
      g, slots = self.get_variable('cache', 'cached_beam').shape[-2:]
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
    if positions is not None and self.config.positional == 'alibi':
      cached_position = self.variable('cache', 'cached_position', jnp.zeros,
                                      (rows, slots), jnp.int32)
      cached_position.value = jax.lax.dynamic_update_slice(
          cached_position.value, positions.astype(jnp.int32), (0, step))
      key_positions = cached_position.value
    mask = masks.cache_mask(step, length, slots)
    return cached_key.value, cached_value.value, key_positions, mask

  def _beam_group(self, q, mask, positions, key_positions, step):
    """:func:`beam_cache.group_beams` on this layer's ``cached_beam`` table."""
    table, grouped = beam_cache.group_beams(
        self.get_variable('cache', 'cached_beam'), q, mask, positions,
        key_positions, step)
    self.put_variable('cache', 'cached_beam', table)
    return grouped

  def _long_attention(self, q, k, v, mask, positions, deterministic, cache,
                      step):
    """Local or linear self-attention of ``q`` ``[batch, q, heads, head_dim]``
    (k, v: ``[batch, q, kv_heads, head_dim]``), with or without the cache."""
    cfg = self.config
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    bias_fn = None
    if cfg.positional == 'alibi':  # local only: linear attention refuses it
      bias_fn = lambda qp, kp: positional.alibi_bias(qp, kp, cfg.num_heads)
    if cache == 'self':
      # While decoding, ``mask`` says which cache slots (of the whole row)
      # may be seen: ``[batch, 1, 1, slots]``, or None for all.
      visible = (jnp.ones(q.shape[:2], bool) if mask is None else
                 jax.lax.dynamic_slice_in_dim(mask[:, 0, 0], step, q.shape[1],
                                              axis=1))
      return self._cached_long_attention(q, k, v, visible, positions, step,
                                         bias_fn)
    if not isinstance(mask, masks.SelfMask):
      raise ValueError(f'attention kind {self.kind!r} needs a masks.SelfMask '
                       f'(segments), got {type(mask).__name__}')
    if self.kind == 'linear':
      qf, kf = self._features(q, k)
      out = linear_attention.linear_attention(qf, kf, v, mask.segments,
                                              causal=mask.causal)
      out = out[0] if mask.causal else out
      return out.astype(q.dtype)
    if cfg.attention_impl in ('xla', 'cudnn'):  # no global tokens (config)
      return local_attention.fused_local_attention(
          q, k, v, mask.segments, window=cfg.attention_window,
          causal=mask.causal, implementation=cfg.attention_impl,
          bias=None if bias_fn is None else bias_fn(positions, positions))
    dropout_rng = None
    if not deterministic and cfg.attention_dropout_rate > 0:
      dropout_rng = self.make_rng('dropout')
    return local_attention.local_attention(
        q, k, v, mask.segments, window=cfg.attention_window,
        causal=mask.causal, global_tokens=cfg.attention_global_tokens,
        positions=positions, bias_fn=bias_fn,
        dropout_rate=cfg.attention_dropout_rate, dropout_rng=dropout_rng)

  def _features(self, q, k):
    """Positive features of queries and keys for linear attention."""
    cfg = self.config
    if cfg.linear_feature_map == 'elu':
      return linear_attention.elu_features(q), linear_attention.elu_features(k)
    projection = linear_attention.favor_projection(
        jax.random.key(cfg.favor_seed), cfg.linear_features, cfg.head_dim)
    return (linear_attention.favor_features(q, projection, is_query=True),
            linear_attention.favor_features(k, projection, is_query=False))

  def _cached_long_attention(self, q, k, v, visible, positions, step,
                             bias_fn):
    """One cached step of local or linear attention; the state lives in the
    ``cache`` collection as ``cached_<name>`` variables."""
    cfg = self.config
    batch = q.shape[0]
    if self.kind == 'local':
      fresh = local_attention.init_cache(
          batch, cfg.kv_heads, cfg.head_dim, window=cfg.attention_window,
          global_tokens=cfg.attention_global_tokens, dtype=k.dtype)
    else:
      fresh = dict(zip(('sum', 'norm'), linear_attention.init_state(
          batch, cfg.kv_heads, cfg.linear_features, cfg.head_dim)))
    state = {name: self.variable('cache', f'cached_{name}', lambda x=x: x)
             for name, x in fresh.items()}
    current = {name: var.value for name, var in state.items()}
    if self.kind == 'local':
      out, new = local_attention.cached_attention(
          current, q, k, v, visible, positions, step,
          window=cfg.attention_window,
          global_tokens=cfg.attention_global_tokens, bias_fn=bias_fn)
    else:
      qf, kf = self._features(q, k)
      out, (s, z) = linear_attention.linear_attention(
          qf, kf, v, visible.astype(jnp.int32), causal=True,
          state=(current['sum'], current['norm']))
      new = dict(sum=s, norm=z)
    for name, var in state.items():
      var.value = new[name]
    return out.astype(q.dtype)


class Sublayer(nn.Module):
  """Residual connection, dropout and normalisation around one sublayer.

  Post-LN (paper): ``LayerNorm(x + Dropout(f(x)))``.
  Pre-LN: ``x + Dropout(f(LayerNorm(x)))``, which keeps the residual path clean.
  Peri-LN: ``x + Dropout(LayerNorm_out(f(LayerNorm(x))))``: the sublayer's
  output is normalised too, so no sublayer can blow up the residual stream
  (Kim et al., 2025); its second norm is ``output_norm``.
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, x, fn, deterministic):
    cfg = self.config
    drop = Dropout(cfg.dropout_rate)
    if cfg.norm_position == 'pre':
      return x + drop(fn(Norm(cfg, name='norm')(x)), deterministic=deterministic)
    if cfg.norm_position == 'peri':
      y = Norm(cfg, name='output_norm')(fn(Norm(cfg, name='norm')(x)))
      return x + drop(y, deterministic=deterministic)
    y = x + drop(fn(x), deterministic=deterministic)
    return Norm(cfg, name='norm')(y)
