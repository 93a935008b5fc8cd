"""The building blocks every model kind is made of (paper section 3.1).

Encoder and decoder layers, the stack that repeats them (unrolled, or one
``nn.scan`` with optional rematerialisation), the token embedder, the output
head, and the right shift of teacher forcing. The encoder-decoder
(:mod:`xfmr_jax.encoder_decoder`), decoder-only and encoder-only models
assemble these.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from xfmr_jax import positional
from xfmr_jax.token_ids import PAD
from xfmr_jax.config import ModelConfig
from xfmr_jax.layers import Dropout, FeedForward, Norm, Sublayer, project
from xfmr_jax.multi_head_attention import MultiHeadAttention


class EncoderLayer(nn.Module):
  """Self-attention then FFN, each wrapped in :class:`Sublayer`.

  Also the block of a decoder-only model (a causal ``mask``), which decodes
  incrementally like :class:`DecoderLayer`'s self-attention.
  """
  config: ModelConfig
  scanned: bool = False  # nn.scan wants ``(carry, output)`` back

  @nn.compact
  def __call__(self, x, mask, positions, deterministic: bool,
               decode: int | None = None, step=None):
    """x: ``[batch, length, d_model]``; mask: a :class:`masks.SelfMask`
    (or, while decoding, the visible cache slots ``[batch, 1, 1, slots]``);
    positions: ``[batch, length]`` (used by RoPE and ALiBi)."""
    cfg = self.config
    x = nn.with_logical_constraint(x, ('batch', 'length', 'embed'))
    cache = {} if decode is None else dict(cache='self', cache_len=decode,
                                           step=step)
    attn = MultiHeadAttention(cfg, cfg.attention_kind, name='self_attention')
    x = Sublayer(cfg, name='attention_block')(
        x, lambda h: attn(h, h, mask, deterministic, positions=positions,
                          **cache), deterministic)
    ffn = FeedForward(cfg, name='ffn')
    x = Sublayer(cfg, name='ffn_block')(x, ffn, deterministic)
    return (x, None) if self.scanned else x


class DecoderLayer(nn.Module):
  """Masked self-attention, cross-attention over the encoder output, FFN."""
  config: ModelConfig
  scanned: bool = False

  @nn.compact
  def __call__(self, y, encoded, self_mask, cross_mask, positions,
               deterministic: bool, decode: int | None = None, step=None):
    """y: ``[batch, t, d_model]``; encoded: ``[batch, s, d_model]``;
    positions: ``[batch, t]`` target positions (for RoPE and ALiBi).

    With ``decode`` (the self-attention cache length) the layer decodes
    incrementally: ``y`` holds positions ``step ..`` only, keys and values live
    in the ``cache`` collection, ``encoded`` is needed on the first step only
    (its cross-attention K/V are cached) and may be ``None`` afterwards.
    """
    cfg = self.config
    y = nn.with_logical_constraint(y, ('batch', 'length', 'embed'))
    self_cache = cross_cache = {}
    if decode is not None:
      self_cache = dict(cache='self', cache_len=decode, step=step)
      cross_cache = dict(cache='cross')
    self_attn = MultiHeadAttention(cfg, cfg.attention_kind,
                                   name='self_attention')
    y = Sublayer(cfg, name='self_attention_block')(
        y, lambda h: self_attn(h, h, self_mask, deterministic,
                               positions=positions, **self_cache),
        deterministic)
    cross_attn = MultiHeadAttention(cfg, name='cross_attention')
    y = Sublayer(cfg, name='cross_attention_block')(
        y, lambda h: cross_attn(h, encoded, cross_mask, deterministic,
                                **cross_cache),
        deterministic)
    ffn = FeedForward(cfg, name='ffn')
    y = Sublayer(cfg, name='ffn_block')(y, ffn, deterministic)
    return (y, None) if self.scanned else y


def layer_stack(layer_cls, cfg: ModelConfig, num_layers: int,
                num_broadcast: int, name: str,
                static_argnums: tuple[int, ...] | None = None):
  """Build ``num_layers`` layers as one callable ``(x, *broadcast) -> x``.

  With ``cfg.scan_layers`` the layers are one ``nn.scan`` whose parameters (and
  decoding caches) have a leading ``layers`` axis, so compile time does not
  grow with depth; with ``cfg.remat`` each layer's activations are recomputed
  in the backward pass. ``static_argnums`` (counting the module as 0 and the
  carry as 1) defaults to ``deterministic`` and ``decode``, the last two but
  one broadcast arguments.
  """
  cls = layer_cls
  if cfg.remat:
    # Argument 0 is the module itself, 1 the carried activations.
    cls = nn.remat(cls, prevent_cse=not cfg.scan_layers,
                   static_argnums=static_argnums or (num_broadcast - 1,
                                                     num_broadcast))
  if cfg.scan_layers:
    scanned = nn.scan(cls, variable_axes={'params': 0, 'intermediates': 0,
                                          'cache': 0},
                      split_rngs={'params': True, 'dropout': True},
                      in_axes=(nn.broadcast,) * num_broadcast,
                      length=num_layers,
                      metadata_params={nn.PARTITION_NAME: 'layers'})
    stack = scanned(cfg, scanned=True, name=name)
    return lambda x, *args: stack(x, *args)[0]
  layers = [cls(cfg, name=f'{name}_{i}') for i in range(num_layers)]

  def run(x, *args):
    for layer in layers:
      x = layer(x, *args)
    return x
  return run


def default_positions(tokens, positions=None):
  """``positions`` if given, else ``0 .. length-1`` for every row ``[batch, length]``."""
  if positions is not None:
    return positions
  return jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)


class Embedder(nn.Module):
  """Token embedding times sqrt(d_model) plus positions (section 3.4-3.5).

  With shared embeddings :class:`OutputHead` reuses the same matrix as the
  pre-softmax projection. RoPE and ALiBi add nothing here: they act inside
  self-attention.
  """
  config: ModelConfig
  vocab_size: int

  def setup(self):
    cfg = self.config
    init = nn.initializers.normal(stddev=cfg.d_model ** -0.5)
    if cfg.pad_embedding == 'zero':
      init = _zero_pad_row(init)
    self.embedding = self.param(
        'embedding', nn.with_logical_partitioning(init, ('vocab', 'embed')),
        (self.vocab_size, cfg.d_model), jnp.float32)
    if cfg.positional == 'learned':
      self.position_embedding = self.param(
          'position_embedding', nn.with_logical_partitioning(
              nn.initializers.normal(stddev=0.02), (None, 'embed')),
          (cfg.max_len, cfg.d_model), jnp.float32)

  def __call__(self, tokens, positions=None):
    """tokens: ``[batch, length]`` ids -> ``[batch, length, d_model]``."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    positions = default_positions(tokens, positions)
    x = jnp.take(self.table(), tokens, axis=0) * jnp.sqrt(float(cfg.d_model))
    if cfg.positional == 'sinusoidal':
      x = x + positional.sinusoidal_encoding(positions, cfg.d_model,
                                             layout=cfg.sinusoid_layout)
    elif cfg.positional == 'learned':
      x = x + jnp.take(self.position_embedding, positions, axis=0)
    return x.astype(dtype)

  def table(self):
    """``[vocab, d_model]``: the matrix the model computes with. Under
    ``pad_embedding='zero'`` row PAD is masked to zero, so no gradient reaches
    it and the parameter row keeps its initial zero (what an exported model
    then holds)."""
    if self.config.pad_embedding == 'learned':
      return self.embedding
    is_pad = (jnp.arange(self.vocab_size) == PAD)[:, None]
    return jnp.where(is_pad, jnp.zeros((), self.embedding.dtype),
                     self.embedding)


def _zero_pad_row(init):
  """``init`` with the PAD row of its ``[vocab, d]`` result set to zero."""
  def zeroed(key, shape, dtype=jnp.float32):
    return init(key, shape, dtype).at[PAD].set(0)
  return zeroed



class OutputHead(nn.Module):
  """The pre-softmax projection ``d_model -> vocab`` (section 3.4).

  With ``shared`` (the model's :class:`Embedder`) it is that embedding matrix
  and adds no parameters; otherwise it owns a bias-free ``kernel`` ``[d_model,
  vocab]`` (the parameters of a bias-free ``nn.Dense``). A model names it
  ``logits``, so the unshared kernel is ``<model>/logits/kernel``.

  With ``config.logits_bias`` 'learned' or 'fixed' it also owns ``bias``
  ``[vocab]`` (zeros at init), added to every logit; 'fixed' stops its
  gradient, so training leaves it as loaded (Marian's ``final_logits_bias`` is
  a buffer, not a trained weight).
  """
  config: ModelConfig
  shared: Embedder | None = None

  def setup(self):
    cfg = self.config
    if self.shared is None:
      self.kernel = self.param(
          'kernel', nn.with_logical_partitioning(
              nn.initializers.xavier_uniform(), ('embed', 'vocab')),
          (cfg.d_model, cfg.vocab_size), jnp.float32)
    if cfg.logits_bias != 'none':
      self.bias = self.param(
          'bias', nn.with_logical_partitioning(nn.initializers.zeros,
                                               ('vocab',)),
          (cfg.vocab_size,), jnp.float32)

  def _bias(self):
    if self.config.logits_bias == 'fixed':
      return jax.lax.stop_gradient(self.bias)
    return self.bias

  def _matrix(self):
    """``[vocab, d_model]``: the output weights (the embedding table if tied)."""
    return self.kernel.T if self.shared is None else self.shared.table()

  def table(self):
    """``[vocab, d_model]`` (``[vocab, d_model + 1]`` with a logits bias, its
    last column): logits are ``x @ table^T`` for :meth:`hidden` ``x``."""
    table = self._matrix()
    if self.config.logits_bias == 'none':
      return table
    return jnp.concatenate([table, self._bias()[:, None]], axis=1)

  def hidden(self, x):
    """``[..., d_model]`` decoder states as the left factor of :meth:`table`:
    unchanged, or with a constant 1 column that picks up the bias. So a loss
    that takes ``(hidden, table)`` (the fast training path) sees the bias
    without knowing of it."""
    if self.config.logits_bias == 'none':
      return x
    return jnp.concatenate([x, jnp.ones((*x.shape[:-1], 1), x.dtype)], axis=-1)

  def __call__(self, x):
    """``[..., d_model] -> float32 [..., vocab]``."""
    logits = project(x, self._matrix())
    if self.config.logits_bias != 'none':
      logits = logits + self._bias()
    return logits


def output_head(cfg: ModelConfig, embedder: Embedder) -> OutputHead:
  """The model's output head: tied to ``embedder`` when embeddings are shared."""
  return OutputHead(cfg, embedder if cfg.share_embeddings else None,
                    name='logits')


class SelfAttentionStack(nn.Module):
  """Token embedding, dropout, ``num_layers`` self-attention blocks
  (:class:`EncoderLayer`) and, under Pre-LN and Peri-LN, a final norm: the body of the
  encoder-only and decoder-only models (bidirectional or causal by ``mask``).
  """
  config: ModelConfig
  num_layers: int

  def setup(self):
    cfg = self.config
    self.embed = Embedder(cfg, cfg.vocab_size)
    self.embed_dropout = Dropout(cfg.dropout_rate)
    self.layers = layer_stack(EncoderLayer, cfg, self.num_layers, 5, 'layer')
    if cfg.final_norm:
      self.final_norm = Norm(cfg)

  def __call__(self, tokens, mask, positions, deterministic: bool,
               decode: int | None = None, step=None):
    """tokens, positions: ``[batch, n]`` -> ``[batch, n, d_model]``.

    ``decode``/``step`` as in :class:`EncoderLayer` (cached decoding)."""
    x = self.embed(tokens, positions)
    x = self.embed_dropout(x, deterministic=deterministic)
    x = self.layers(x, mask, positions, deterministic, decode, step)
    if self.config.final_norm:
      x = self.final_norm(x)
    return x


def shift_right(targets, segmentation=None):
  """Decoder inputs ``[batch, t]``: targets shifted one step right, the pad id
  as start symbol.

  In packed rows the first token of every segment also gets the start symbol
  instead of the previous sequence's last token.
  """
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  if segmentation is not None:
    prev_seg = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
    shifted = jnp.where(segmentation == prev_seg, shifted, PAD)
  return shifted
