"""The yardstick: google/flax ``examples/wmt``'s model, train step and beam search.

Written for this benchmark after the example (its ``models.py``, ``decode.py``
and ``train.py``), doing the same work per step so that our numbers can be
read against it:

* the model: Linen, pre-LayerNorm blocks with a final LayerNorm in encoder
  and decoder, one embedding shared by source, target and output (logits are
  ``embedding.attend(y) / sqrt(d_model)``), fixed sinusoidal positions added
  to unscaled embeddings, ``nn.MultiHeadDotProductAttention`` without biases
  for self- and cross-attention. The cached decoder (``decode=True``) keeps
  ``cached_key``/``cached_value``/``cache_index`` in the 'cache' collection;
  its cross-attention projects keys and values from the beam-tiled encoder
  output again at every step, as the example's does;
* the train step: label-smoothed cross-entropy over the logits (one-hot soft
  targets), the example's loss/accuracy metrics, ``optax.adamw`` (b2 0.98,
  eps 1e-9, weight decay 0, i.e. Adam) with linear warmup then rsqrt decay,
  ``jax.jit`` with the state donated. Dropout 0.1 on the embeddings and on
  every sublayer output, as in ours; the example also drops out the FFN's
  hidden layer and the attention weights (0.1 each by default), both off here
  so that the step is the same computation as our train step;
* the beam search: one ``lax.while_loop`` over a state of live and finished
  sequences, live log-probs, finished scores and flags and the decoder cache;
  per step the top ``2k`` over beam x vocab, the live top ``k`` among those
  not ending in EOS, the WHOLE cache gathered by (batch, beam) indices, the
  finished set merged with score ``logp / ((5 + len) / 6) ** alpha``; it stops
  when no live beam can beat the worst finished one; a row without a finished
  beam returns its live beams and their raw log-probs.

Our ids, not the example's: pad 0 is the start symbol and is never emitted
(its column is masked, as in our decoders), EOS is 1. The example's sequence
buffer counts the start slot, so ``max_decode_len`` tokens take a buffer and
a cache of ``max_decode_len + 1`` slots here.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
from flax.training import train_state as flax_train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.benchmark.common import LABEL_SMOOTHING, CompiledStep
from xfmr_jax import config as config_lib

NEG_INF = -1.0e7        # the example's finite "impossible" log-prob
LEARNING_RATE = 0.0625  # the example's default peak rate and warmup
WARMUP_STEPS = 1000


@dataclasses.dataclass(frozen=True)
class WmtConfig:
  vocab_size: int
  d_model: int
  num_heads: int
  num_encoder_layers: int
  num_decoder_layers: int
  d_ff: int
  max_len: int
  dropout_rate: float = 0.1
  dtype: Any = jnp.float32
  deterministic: bool = True
  decode: bool = False

  @classmethod
  def from_model_config(cls, cfg: config_lib.ModelConfig, **changes):
    """Our model's sizes and dropout rate (``SIZES[size]['model']``)."""
    fields = ('vocab_size', 'd_model', 'num_heads', 'num_encoder_layers',
              'num_decoder_layers', 'd_ff', 'max_len', 'dropout_rate')
    return cls(**{k: getattr(cfg, k) for k in fields},
               dtype=jnp.dtype(cfg.dtype), **changes)


def sinusoids(length: int, depth: int) -> np.ndarray:
  """``[1, length, depth]``: sines of all frequencies, then their cosines."""
  half = depth // 2
  rates = np.exp(-np.log(1e4) * np.arange(half) / max(half - 1, 1))
  angles = np.arange(length)[:, None] * rates[None]
  table = np.zeros((length, depth), np.float32)
  table[:, :half], table[:, half:2 * half] = np.sin(angles), np.cos(angles)
  return table[None]


class AddPositions(nn.Module):
  """x ``[b, t, d]`` + fixed positions; when decoding, the next position."""
  cfg: WmtConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x):
    table = sinusoids(self.cfg.max_len, x.shape[-1])
    pe = table[:, :x.shape[1]]
    if self.decode:
      ready = self.has_variable('cache', 'cache_index')
      index = self.variable('cache', 'cache_index',
                            lambda: jnp.array(0, jnp.int32))
      if ready:
        i = index.value
        index.value = i + 1
        pe = jax.lax.dynamic_slice(table, (0, i, 0), (1, 1, x.shape[-1]))
    return x + pe


def _dense(cfg, features, **kw):
  return nn.Dense(features, dtype=cfg.dtype,
                  kernel_init=nn.initializers.xavier_uniform(),
                  bias_init=nn.initializers.normal(1e-6), **kw)


def _attention(cfg, decode=False):
  return nn.MultiHeadDotProductAttention(
      num_heads=cfg.num_heads, qkv_features=cfg.d_model, dtype=cfg.dtype,
      kernel_init=nn.initializers.xavier_uniform(),
      bias_init=nn.initializers.normal(1e-6), use_bias=False,
      broadcast_dropout=False, dropout_rate=0.0, deterministic=True,
      decode=decode)


class Block(nn.Module):
  """Pre-LN layer: self-attention, cross-attention if ``encoded``, FFN."""
  cfg: WmtConfig
  causal_cache: bool = False

  @nn.compact
  def __call__(self, x, self_mask, encoded=None, cross_mask=None):
    cfg = self.cfg
    drop = lambda y: nn.Dropout(cfg.dropout_rate)(y, cfg.deterministic)
    y = nn.LayerNorm(dtype=cfg.dtype)(x)
    x = x + drop(_attention(cfg, self.causal_cache)(y, mask=self_mask))
    if encoded is not None:
      y = nn.LayerNorm(dtype=cfg.dtype)(x)
      x = x + drop(_attention(cfg)(y, encoded, mask=cross_mask))
    y = nn.LayerNorm(dtype=cfg.dtype)(x)
    y = _dense(cfg, cfg.d_model)(nn.relu(_dense(cfg, cfg.d_ff)(y)))
    return x + drop(y)


class Seq2Seq(nn.Module):
  """``encode(inputs [b, s]) -> [b, s, d]``; ``decode(encoded, inputs,
  targets [b, t]) -> logits [b, t, vocab]`` (teacher-forced: targets shifted
  right inside; with ``cfg.decode``: ``targets`` is the ``[b, 1]`` token
  before the next position); ``__call__(inputs, targets)`` both."""
  cfg: WmtConfig

  def setup(self):
    cfg = self.cfg
    self.embed = nn.Embed(cfg.vocab_size, cfg.d_model,
                          embedding_init=nn.initializers.normal(1.0),
                          name='shared_embedding')
    self.drop = nn.Dropout(cfg.dropout_rate)
    self.enc_pos = AddPositions(cfg)
    self.dec_pos = AddPositions(cfg, decode=cfg.decode)
    self.enc_layers = [Block(cfg) for _ in range(cfg.num_encoder_layers)]
    self.dec_layers = [Block(cfg, causal_cache=cfg.decode)
                       for _ in range(cfg.num_decoder_layers)]
    self.enc_norm = nn.LayerNorm(dtype=cfg.dtype)
    self.dec_norm = nn.LayerNorm(dtype=cfg.dtype)

  def _embed(self, ids, positions):
    x = self.drop(positions(self.embed(ids.astype(jnp.int32))),
                  self.cfg.deterministic)
    return x.astype(self.cfg.dtype)

  def encode(self, inputs):
    mask = nn.make_attention_mask(inputs > 0, inputs > 0, dtype=self.cfg.dtype)
    x = self._embed(inputs, self.enc_pos)
    for layer in self.enc_layers:
      x = layer(x, mask)
    return self.enc_norm(x)

  def decode(self, encoded, inputs, targets):
    dt = self.cfg.dtype
    if self.cfg.decode:
      self_mask = None   # the cache's own mask: slots filled so far
      cross = nn.make_attention_mask(jnp.ones_like(targets) > 0, inputs > 0,
                                     dtype=dt)
      ids = targets
    else:
      self_mask = nn.combine_masks(
          nn.make_attention_mask(targets > 0, targets > 0, dtype=dt),
          nn.make_causal_mask(targets, dtype=dt))
      cross = nn.make_attention_mask(targets > 0, inputs > 0, dtype=dt)
      ids = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
    y = self._embed(ids, self.dec_pos)
    for layer in self.dec_layers:
      y = layer(y, self_mask, encoded, cross)
    y = self.dec_norm(y)
    logits = self.embed.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])
    return logits.astype(dt)

  def __call__(self, inputs, targets):
    return self.decode(self.encode(inputs), inputs, targets)


def init_params(cfg: WmtConfig, length: int, seed: int = 0):
  ids = jnp.ones((1, length), jnp.int32)
  return jax.jit(Seq2Seq(cfg).init)(jax.random.key(seed), ids, ids)['params']


def full_logits(cfg, params, inputs, targets):
  """Teacher-forced logits ``[b, t, vocab]`` of the full, uncached model."""
  return Seq2Seq(cfg).apply({'params': params}, inputs, targets)


# ------------------------------------------------------------- train step --

def smoothed_cross_entropy(logits, targets, weights, smoothing):
  """Summed label-smoothed cross-entropy minus its floor, and the weight sum."""
  vocab = logits.shape[-1]
  on, off = 1.0 - smoothing, smoothing / (vocab - 1)
  floor = -(on * jnp.log(on) + (vocab - 1) * off * jnp.log(off + 1e-20))
  soft = jnp.where(targets[..., None] == jnp.arange(vocab), on, off)
  loss = -jnp.sum(soft * jax.nn.log_softmax(logits), axis=-1) - floor
  return (loss * weights).sum(), weights.sum()


def learning_rate(count):
  """Linear warmup to LEARNING_RATE, then ``LEARNING_RATE * sqrt(warmup /
  count)``."""
  return optax.join_schedules(
      [optax.linear_schedule(0.0, LEARNING_RATE, WARMUP_STEPS),
       lambda c: LEARNING_RATE * jnp.sqrt(WARMUP_STEPS / (c + WARMUP_STEPS))],
      [WARMUP_STEPS])(count)


def train_step(state, batch, dropout_key, *, cfg, smoothing):
  """One Adam step on ``batch`` (``inputs``, ``targets`` ``[b, t]``)."""
  targets = batch['targets']
  weights = (targets > 0).astype(jnp.float32)
  key = jax.random.fold_in(dropout_key, state.step)

  def loss_fn(params):
    logits = Seq2Seq(cfg).apply({'params': params}, batch['inputs'], targets,
                                rngs={'dropout': key})
    loss, total = smoothed_cross_entropy(logits, targets, weights, smoothing)
    return loss / total, logits

  (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  new_state = state.apply_gradients(grads=grads)
  loss, total = smoothed_cross_entropy(logits, targets, weights, 0.0)
  correct = ((jnp.argmax(logits, -1) == targets) * weights).sum()
  return new_state, dict(loss=loss, accuracy=correct, denominator=total,
                         learning_rate=learning_rate(state.step))


class FlaxWmtTrain(CompiledStep):
  """The example's jitted, state-donating step on one fixed batch; the same
  attributes as ``train.JaxTrain`` (compile_s: lower() + compile())."""

  def __init__(self, cfg: config_lib.ModelConfig, batch: dict):
    wcfg = WmtConfig.from_model_config(cfg, deterministic=False)
    step = jax.jit(functools.partial(train_step, cfg=wcfg,
                                     smoothing=LABEL_SMOOTHING),
                   donate_argnums=0)
    self.batch = jax.device_put(batch)
    self.key = jax.random.key(1)
    tx = optax.adamw(learning_rate, b1=0.9, b2=0.98, eps=1e-9,
                     weight_decay=0.0)
    self._compile(
        lambda: flax_train_state.TrainState.create(
            apply_fn=None, tx=tx, params=init_params(
                dataclasses.replace(wcfg, deterministic=True),
                batch['targets'].shape[1])),
        lambda state: step.lower(state, self.batch, self.key))

  def __call__(self):
    self.state, metrics = self.compiled(self.state, self.batch, self.key)
    jax.block_until_ready(metrics)
    return metrics

