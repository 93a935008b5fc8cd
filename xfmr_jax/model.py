"""The encoder-decoder Transformer (paper section 3, figure 1).

``Transformer.apply(variables, inputs, targets, ...)`` returns logits
``[batch, target_length, vocab]`` for teacher-forced training. ``encode`` and
``decode`` are exposed separately for inference.

Packed rows are supported through ``*_segmentation`` (1, 2, ... per packed
sequence, 0 for padding) and ``*_position`` (position inside each sequence).
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from xfmr_jax import losses, masks, positional
from xfmr_jax.config import ModelConfig
from xfmr_jax.layers import (Dropout, FeedForward, MultiHeadAttention, Norm,
                             Sublayer)


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
    """x: ``[batch, length, d_model]``; mask: ``[batch, 1, length, length]``;
    positions: ``[batch, length]`` (used by RoPE and ALiBi)."""
    cfg = self.config
    x = nn.with_logical_constraint(x, ('batch', 'length', 'embed'))
    cache = {} if decode is None else dict(cache='self', cache_len=decode,
                                           step=step)
    attn = MultiHeadAttention(cfg, name='self_attention')
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
    self_attn = MultiHeadAttention(cfg, name='self_attention')
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


def _stack(layer_cls, cfg: ModelConfig, num_layers: int, num_broadcast: int,
           name: str, static_argnums: tuple[int, ...] | None = None):
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


class Embedder(nn.Module):
  """Token embedding times sqrt(d_model) plus positions (section 3.4-3.5).

  ``attend`` reuses the same matrix as the pre-softmax projection when
  embeddings are shared. RoPE and ALiBi add nothing here: they act inside
  self-attention.
  """
  config: ModelConfig
  vocab_size: int

  def setup(self):
    cfg = self.config
    self.embedding = self.param(
        'embedding', nn.with_logical_partitioning(
            nn.initializers.normal(stddev=cfg.d_model ** -0.5),
            ('vocab', 'embed')),
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
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    x = jnp.take(self.embedding, tokens, axis=0) * jnp.sqrt(float(cfg.d_model))
    if cfg.positional == 'sinusoidal':
      x = x + positional.sinusoidal_encoding(positions, cfg.d_model)
    elif cfg.positional == 'learned':
      x = x + jnp.take(self.position_embedding, positions, axis=0)
    return x.astype(dtype)

  def attend(self, x):
    """``[..., d_model] -> [..., vocab]`` logits against the embedding matrix."""
    return losses.project(x, self.embedding)


def default_positions(tokens, positions=None):
  """``positions`` if given, else ``0 .. length-1`` for every row ``[batch, length]``."""
  if positions is not None:
    return positions
  return jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)


class OutputProjection(nn.Module):
  """The pre-softmax ``d_model -> vocab`` projection when it is not shared:
  a bias-free ``kernel`` ``[d_model, vocab]`` (the parameters of a bias-free
  ``nn.Dense``)."""
  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.kernel = self.param(
        'kernel', nn.with_logical_partitioning(
            nn.initializers.xavier_uniform(), ('embed', 'vocab')),
        (cfg.d_model, cfg.vocab_size), jnp.float32)

  def table(self):
    """``[vocab, d_model]``: logits are ``x @ table^T``."""
    return self.kernel.T

  def __call__(self, x):
    return losses.project(x, self.table())


def output_projection(cfg: ModelConfig) -> OutputProjection:
  """The unshared output projection, named as it always has been."""
  return OutputProjection(cfg, name='logits')


class SelfAttentionStack(nn.Module):
  """Token embedding, dropout, ``num_layers`` self-attention blocks
  (:class:`EncoderLayer`) and, under Pre-LN, a final norm: the body of the
  encoder-only and decoder-only models (bidirectional or causal by ``mask``).
  """
  config: ModelConfig
  num_layers: int

  def setup(self):
    cfg = self.config
    self.embed = Embedder(cfg, cfg.vocab_size)
    self.embed_dropout = Dropout(cfg.dropout_rate)
    self.layers = _stack(EncoderLayer, cfg, self.num_layers, 5, 'layer')
    if cfg.norm_position == 'pre':
      self.final_norm = Norm(cfg)

  def __call__(self, tokens, mask, positions, deterministic: bool,
               decode: int | None = None, step=None):
    """tokens, positions: ``[batch, n]`` -> ``[batch, n, d_model]``.

    ``decode``/``step`` as in :class:`EncoderLayer` (cached decoding)."""
    x = self.embed(tokens, positions)
    x = self.embed_dropout(x, deterministic=deterministic)
    x = self.layers(x, mask, positions, deterministic, decode, step)
    if self.config.norm_position == 'pre':
      x = self.final_norm(x)
    return x


def shift_right(targets, segmentation=None):
  """Decoder inputs: targets shifted one step right, 0 (pad) as start symbol.

  In packed rows the first token of every segment also gets the start symbol
  instead of the previous sequence's last token.
  """
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  if segmentation is not None:
    prev_seg = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
    shifted = jnp.where(segmentation == prev_seg, shifted, 0)
  return shifted


class Transformer(nn.Module):
  """Encoder-decoder Transformer; see the module docstring for inputs."""
  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.source_embed = Embedder(cfg, cfg.vocab_size)
    self.target_embed = (self.source_embed if cfg.share_embeddings else
                         Embedder(cfg, cfg.vocab_size))
    self.embed_dropout = Dropout(cfg.dropout_rate)
    # Broadcast: mask, positions, deterministic (static), decode (static
    # cache length or None), step.
    self.encoder_layers = _stack(EncoderLayer, cfg, cfg.num_encoder_layers, 5,
                                 'encoder')
    # Broadcast: encoded, self_mask, cross_mask, positions, deterministic,
    # decode, step.
    self.decoder_layers = _stack(DecoderLayer, cfg, cfg.num_decoder_layers, 7,
                                 'decoder')
    if cfg.norm_position == 'pre':  # pre-LN leaves the stack output unnormalised
      self.encoder_norm = Norm(cfg)
      self.decoder_norm = Norm(cfg)
    if not cfg.share_embeddings:
      self.output_projection = output_projection(cfg)

  def encode(self, inputs, inputs_segmentation=None, inputs_position=None,
             deterministic: bool = True):
    """inputs: ``[batch, s]`` ids -> encoded ``[batch, s, d_model]``."""
    mask = self.encoder_mask(inputs, inputs_segmentation)
    positions = default_positions(inputs, inputs_position)
    x = self.source_embed(inputs, positions)
    x = self.embed_dropout(x, deterministic=deterministic)
    x = self.encoder_layers(x, mask, positions, deterministic, None, None)
    if self.config.norm_position == 'pre':
      x = self.encoder_norm(x)
    return x

  def decode(self, encoded, inputs, targets, inputs_segmentation=None,
             targets_segmentation=None, targets_position=None,
             deterministic: bool = True, return_hidden: bool = False):
    """Teacher-forced decoder: ``[batch, t]`` targets -> logits ``[batch, t, V]``
    (or ``(hidden, table)``, see :meth:`__call__`)."""
    positions = default_positions(targets, targets_position)
    y = self.target_embed(shift_right(targets, targets_segmentation), positions)
    y = self.embed_dropout(y, deterministic=deterministic)
    # Shifted inputs start with the pad id, so padding is read off the targets.
    self_mask = masks.combine_masks(
        masks.causal_mask(targets.shape[1]),
        masks.padding_mask(targets, targets),
        None if targets_segmentation is None else
        masks.segment_mask(targets_segmentation, targets_segmentation))
    cross_mask = masks.combine_masks(
        masks.padding_mask(targets, inputs),
        None if targets_segmentation is None else
        masks.segment_mask(targets_segmentation, inputs_segmentation))
    y = self.decoder_layers(y, encoded, self_mask, cross_mask, positions,
                            deterministic, None, None)
    if self.config.norm_position == 'pre':
      y = self.decoder_norm(y)
    return (y, self.output_table()) if return_hidden else self.logits(y)

  def decode_step(self, inputs, tokens, step, encoded=None, *, cache_len: int):
    """Incremental decoder: logits for positions ``step .. step + n - 1``.

    Apply with ``mutable=['cache']``. The first call passes ``encoded``: it
    creates the ``cache`` collection (self-attention K/V buffers of
    ``cache_len`` positions, and the cross-attention K/V of ``encoded``, computed
    here once). Later calls pass ``encoded=None`` and read them from the cache.

    Args:
      inputs: ``[batch, s]`` source ids (their padding masks the cross-attention).
      tokens: ``[batch, n]`` decoder inputs at positions ``step ..``: the start
        symbol 0 at position 0, then the previously emitted tokens.
      step: int32 scalar, the position of ``tokens[:, 0]``.
      encoded: ``[batch, s, d_model]`` encoder output, first call only.
      cache_len: static; the longest output the cache can hold.

    Returns:
      float32 logits ``[batch, n, vocab]``, equal to the teacher-forced
      :meth:`decode` logits at the same positions.
    """
    positions = jnp.broadcast_to(step + jnp.arange(tokens.shape[1]),
                                 tokens.shape)
    y = self.target_embed(tokens, positions)
    cross_mask = (inputs != masks.PAD_ID)[:, None, None, :]
    y = self.decoder_layers(y, encoded, None, cross_mask, positions, True,
                            cache_len, step)
    if self.config.norm_position == 'pre':
      y = self.decoder_norm(y)
    return self.logits(y)

  def init_cache(self, inputs, cache_len: int):
    """Encode ``inputs`` ``[batch, s]`` and build the decoding cache.

    Apply with ``mutable=['cache']``: a zero-length :meth:`decode_step` creates
    the self-attention buffers of ``cache_len`` positions and caches the
    cross-attention K/V of the encoder output, without decoding anything.
    """
    encoded = self.encode(inputs)
    nothing = jnp.zeros((inputs.shape[0], 0), jnp.int32)
    self.decode_step(inputs, nothing, 0, encoded, cache_len=cache_len)

  def output_table(self):
    """The ``[vocab, d_model]`` pre-softmax projection: logits = ``y @ table^T``
    (the shared embedding, or the output projection's kernel transposed)."""
    if self.config.share_embeddings:
      return self.target_embed.embedding
    return self.output_projection.table()

  def logits(self, y):
    """``[..., d_model] -> float32 [..., vocab]``."""
    return losses.project(y, self.output_table())

  @staticmethod
  def encoder_mask(inputs, inputs_segmentation=None):
    """Padding (and packed-segment) mask for encoder self-attention."""
    return masks.combine_masks(
        masks.padding_mask(inputs, inputs),
        None if inputs_segmentation is None else
        masks.segment_mask(inputs_segmentation, inputs_segmentation))

  def __call__(self, inputs, targets, inputs_segmentation=None,
               targets_segmentation=None, inputs_position=None,
               targets_position=None, deterministic: bool = True,
               return_hidden: bool = False):
    """inputs ``[batch, s]``, targets ``[batch, t]`` -> logits ``[batch, t, V]``.

    With ``return_hidden`` it returns ``(hidden [batch, t, d_model], table
    [V, d_model])`` instead, logits = ``hidden @ table^T``, so that a loss can
    take the projection inside its own gradient
    (:func:`xfmr_jax.losses.projected_token_metrics`, as training does).
    """
    encoded = self.encode(inputs, inputs_segmentation, inputs_position,
                          deterministic)
    return self.decode(encoded, inputs, targets, inputs_segmentation,
                       targets_segmentation, targets_position, deterministic,
                       return_hidden)


def build(config: ModelConfig) -> nn.Module:
  """The model of ``config.model_kind``: :class:`Transformer` (encoder-decoder),
  :class:`~xfmr_jax.decoder_only.DecoderOnly` or
  :class:`~xfmr_jax.encoder_only.EncoderOnly`."""
  from xfmr_jax import decoder_only, encoder_only  # they import this module
  kinds = {'encoder_decoder': Transformer,
           'decoder_only': decoder_only.DecoderOnly,
           'encoder_only': encoder_only.EncoderOnly}
  return kinds[config.model_kind](config)
