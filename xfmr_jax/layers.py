"""The Transformer's sublayers other than attention (paper sections 3.1-3.3).

Pure functions for the math (``layer_norm``, ``rms_norm``, ``feed_forward``,
the output projection ``project``) and Flax Linen modules that own the
parameters and call them (``Dense``, ``Norm``, ``FeedForward``, ``Sublayer``).
Every parameter is annotated with logical axis names (``embed``, ``mlp``,
``joined_kv``, ``vocab``) that :mod:`xfmr_jax.sharding`-style rules can map
onto a device mesh. The attention layer is
:mod:`xfmr_jax.multi_head_attention`.
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from xfmr_jax import activations
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


def project(hidden, table):
  """Logits ``hidden @ table^T``: ``[..., d] x [vocab, d] -> float32 [...,
  vocab]`` (the output projection, ``table`` e.g. the shared embedding)."""
  return jnp.einsum('...d,vd->...v', hidden, table.astype(hidden.dtype),
                    preferred_element_type=jnp.float32)


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
