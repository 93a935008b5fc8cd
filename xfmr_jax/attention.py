"""Scaled dot-product attention and head split/merge (paper sections 3.2.1-3.2.2).

All arrays use the ``[batch, length, heads, head_dim]`` layout. Masks follow
:mod:`xfmr_jax.masks`: boolean, broadcastable to ``[batch, heads, q, k]``,
``True`` = may attend.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def split_heads(x: jnp.ndarray, num_heads: int) -> jnp.ndarray:
  """``[batch, length, heads * head_dim] -> [batch, length, heads, head_dim]``."""
  *lead, width = x.shape
  if width % num_heads:
    raise ValueError(f'width {width} is not divisible by {num_heads} heads')
  return x.reshape(*lead, num_heads, width // num_heads)


def merge_heads(x: jnp.ndarray) -> jnp.ndarray:
  """``[batch, length, heads, head_dim] -> [batch, length, heads * head_dim]``."""
  return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def attention_weights(query: jnp.ndarray, key: jnp.ndarray,
                      mask: jnp.ndarray | None = None,
                      bias: jnp.ndarray | None = None) -> jnp.ndarray:
  """``softmax(Q K^T / sqrt(d_k) + bias)`` with masked keys removed.

  Args:
    query: ``[batch, q_length, heads, head_dim]``.
    key: ``[batch, k_length, heads, head_dim]``.
    mask: boolean, broadcastable to ``[batch, heads, q_length, k_length]``.
    bias: additive float bias broadcastable to the same shape (e.g. ALiBi).

  Returns:
    float32 ``[batch, heads, q_length, k_length]``; rows sum to 1, except rows
    whose keys are all masked, which are all zero (never NaN).
  """
  d_k = query.shape[-1]
  # Dividing by sqrt(d_k) keeps the logits' variance near 1 whatever d_k is,
  # so the softmax does not saturate (section 3.2.1).
  query = query / jnp.sqrt(jnp.asarray(d_k, query.dtype))
  scores = jnp.einsum('bqhd,bkhd->bhqk', query, key,
                      preferred_element_type=jnp.float32)
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  if mask is None:
    return jax.nn.softmax(scores, axis=-1)
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1)
  # A query with no visible key (e.g. a padding query) would otherwise spread
  # its weight uniformly over masked keys; zero it instead.
  return jnp.where(jnp.any(mask, axis=-1, keepdims=True), weights, 0.0)


def dot_product_attention(query: jnp.ndarray, key: jnp.ndarray,
                          value: jnp.ndarray,
                          mask: jnp.ndarray | None = None,
                          bias: jnp.ndarray | None = None,
                          *,
                          dropout_rate: float = 0.0,
                          dropout_rng: jax.Array | None = None,
                          return_weights: bool = False):
  """``Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V`` (equation 1).

  Args:
    query: ``[batch, q_length, heads, head_dim]``.
    key: ``[batch, k_length, heads, head_dim]``.
    value: ``[batch, k_length, heads, head_dim_v]``.
    mask, bias: see :func:`attention_weights`.
    dropout_rate: dropout on the attention weights (needs ``dropout_rng``).
    return_weights: also return the ``[batch, heads, q, k]`` weights.

  Returns:
    ``[batch, q_length, heads, head_dim_v]`` in ``query.dtype`` (and the weights).
  """
  weights = attention_weights(query, key, mask, bias)
  probs = weights
  if dropout_rate > 0.0 and dropout_rng is not None:
    from xfmr_jax.layers import dropout  # layers imports this module
    probs = dropout(probs, dropout_rate, dropout_rng)
  out = jnp.einsum('bhqk,bkhd->bqhd', probs.astype(value.dtype), value)
  return (out, weights) if return_weights else out
