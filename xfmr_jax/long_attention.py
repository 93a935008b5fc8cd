"""The local and linear self-attention of an attention layer.

A :class:`~xfmr_jax.multi_head_attention.MultiHeadAttention` of ``kind``
'local' or 'linear' (self-attention only) hands its projected heads to
:func:`attend`, which picks the math: the sliding window of
:mod:`xfmr_jax.local_attention` (blockwise, or a fused kernel) or the
kernelised attention of :mod:`xfmr_jax.linear_attention` with the feature
map of :func:`features`. Outside decoding, ``mask`` is a
:class:`~xfmr_jax.masks.SelfMask` (segments and causality), never a dense
mask.

While decoding (``cache='self'``) neither keeps ``cache_len`` keys: local
attention keeps a ring buffer of ``attention_window`` keys (plus the global
ones), linear attention its running state ``(S, z)``, as the layer's
``cached_<name>`` variables in the ``cache`` collection. Such a summary of
the history cannot be shared by several rows the way
:mod:`xfmr_jax.kv_cache` shares full attention's keys, so a beam search
copies it from the parent beam.

The functions take the layer (``module``) and create its cache variables and
dropout keys through it, so they add no level to its parameter or cache
paths.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xfmr_jax import linear_attention, local_attention, masks, positional
from xfmr_jax.config import ModelConfig


def attend(module, q, k, v, mask, positions, deterministic, cache, step):
  """Local or linear self-attention of ``q`` ``[batch, q, heads, head_dim]``
  (k, v: ``[batch, q, kv_heads, head_dim]``), with or without the cache.

  ``module`` is the attention layer (its ``config`` and ``kind``);
  returns ``[batch, q, heads, head_dim]`` in ``q.dtype``.
  """
  cfg = module.config
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
    return _cached(module, q, k, v, visible, positions, step, bias_fn)
  if not isinstance(mask, masks.SelfMask):
    raise ValueError(f'attention kind {module.kind!r} needs a masks.SelfMask '
                     f'(segments), got {type(mask).__name__}')
  if module.kind == 'linear':
    qf, kf = features(cfg, q, k)
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
    dropout_rng = module.make_rng('dropout')
  return local_attention.local_attention(
      q, k, v, mask.segments, window=cfg.attention_window,
      causal=mask.causal, global_tokens=cfg.attention_global_tokens,
      positions=positions, bias_fn=bias_fn,
      dropout_rate=cfg.attention_dropout_rate, dropout_rng=dropout_rng)


def features(cfg: ModelConfig, q, k):
  """Positive features of queries and keys for linear attention
  (``cfg.linear_feature_map``: 'elu', or FAVOR+ drawn from ``favor_seed``)."""
  if cfg.linear_feature_map == 'elu':
    return linear_attention.elu_features(q), linear_attention.elu_features(k)
  projection = linear_attention.favor_projection(
      jax.random.key(cfg.favor_seed), cfg.linear_features, cfg.head_dim)
  return (linear_attention.favor_features(q, projection, is_query=True),
          linear_attention.favor_features(k, projection, is_query=False))


def _cached(module, q, k, v, visible, positions, step, bias_fn):
  """One cached step of local or linear attention; the state lives in the
  ``cache`` collection as ``module``'s ``cached_<name>`` variables."""
  cfg = module.config
  batch = q.shape[0]
  if module.kind == 'local':
    fresh = local_attention.init_cache(
        batch, cfg.kv_heads, cfg.head_dim, window=cfg.attention_window,
        global_tokens=cfg.attention_global_tokens, dtype=k.dtype)
  else:
    fresh = dict(zip(('sum', 'norm'), linear_attention.init_state(
        batch, cfg.kv_heads, cfg.linear_features, cfg.head_dim)))
  state = {name: module.variable('cache', f'cached_{name}', lambda x=x: x)
           for name, x in fresh.items()}
  current = {name: var.value for name, var in state.items()}
  if module.kind == 'local':
    out, new = local_attention.cached_attention(
        current, q, k, v, visible, positions, step,
        window=cfg.attention_window,
        global_tokens=cfg.attention_global_tokens, bias_fn=bias_fn)
  else:
    qf, kf = features(cfg, q, k)
    out, (s, z) = linear_attention.linear_attention(
        qf, kf, v, visible.astype(jnp.int32), causal=True,
        state=(current['sum'], current['norm']))
    new = dict(sum=s, norm=z)
  for name, var in state.items():
    var.value = new[name]
  return out.astype(q.dtype)
