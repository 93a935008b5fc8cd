"""The encoder-decoder Transformer (paper section 3, figure 1).

``Transformer.apply(variables, inputs, targets, ...)`` returns logits
``[batch, target_length, vocab]`` for teacher-forced training; it takes the
targets unshifted and shifts them right itself (:func:`blocks.shift_right`).
``encode`` and ``decode`` are exposed separately, and ``init_cache`` /
``decode_step`` decode one cached step at a time.

Packed rows are supported through ``*_segmentation`` (1, 2, ... per packed
sequence, 0 for padding) and ``*_position`` (position inside each sequence).
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from xfmr_jax import masks
from xfmr_jax.blocks import (DecoderLayer, Embedder, EncoderLayer,
                             default_positions, layer_stack, output_head,
                             shift_right)
from xfmr_jax.config import ModelConfig
from xfmr_jax.dropout import Dropout
from xfmr_jax.layers import Norm


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
    self.encoder_layers = layer_stack(EncoderLayer, cfg, cfg.num_encoder_layers, 5,
                                 'encoder')
    # Broadcast: encoded, self_mask, cross_mask, positions, deterministic,
    # decode, step.
    self.decoder_layers = layer_stack(DecoderLayer, cfg, cfg.num_decoder_layers, 7,
                                 'decoder')
    if cfg.final_norm:  # pre/peri-LN leave the stack output unnormalised
      self.encoder_norm = Norm(cfg)
      self.decoder_norm = Norm(cfg)
    self.output_head = output_head(cfg, self.target_embed)

  def encode(self, inputs, inputs_segmentation=None, inputs_position=None,
             deterministic: bool = True):
    """inputs: ``[batch, s]`` ids -> encoded ``[batch, s, d_model]``."""
    mask = masks.self_mask(inputs, inputs_segmentation)
    positions = default_positions(inputs, inputs_position)
    x = self.source_embed(inputs, positions)
    x = self.embed_dropout(x, deterministic=deterministic)
    x = self.encoder_layers(x, mask, positions, deterministic, None, None)
    if self.config.final_norm:
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
    self_mask = masks.self_mask(targets, targets_segmentation, causal=True)
    cross_mask = masks.cross_mask(inputs, targets, inputs_segmentation,
                                  targets_segmentation)
    y = self.decoder_layers(y, encoded, self_mask, cross_mask, positions,
                            deterministic, None, None)
    if self.config.final_norm:
      y = self.decoder_norm(y)
    if return_hidden:
      return self.output_head.hidden(y), self.output_table()
    return self.logits(y)

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
    cross_mask = masks.source_key_mask(inputs)
    y = self.decoder_layers(y, encoded, None, cross_mask, positions, True,
                            cache_len, step)
    if self.config.final_norm:
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
    (the shared embedding, or the output head's kernel transposed; with a
    logits bias ``[vocab, d_model + 1]``, see :class:`~xfmr_jax.blocks.OutputHead`)."""
    return self.output_head.table()

  def logits(self, y):
    """``[..., d_model] -> float32 [..., vocab]``."""
    return self.output_head(y)

  def __call__(self, inputs, targets, inputs_segmentation=None,
               targets_segmentation=None, inputs_position=None,
               targets_position=None, deterministic: bool = True,
               return_hidden: bool = False):
    """inputs ``[batch, s]``, targets ``[batch, t]`` -> logits ``[batch, t, V]``.

    With ``return_hidden`` it returns ``(hidden [batch, t, d_model], table
    [V, d_model])`` instead (``d_model + 1`` wide with a logits bias), logits
    = ``hidden @ table^T``, so that a loss can
    take the projection inside its own gradient
    (:func:`xfmr_jax.losses.projected_token_metrics`, as training does).
    """
    encoded = self.encode(inputs, inputs_segmentation, inputs_position,
                          deterministic)
    return self.decode(encoded, inputs, targets, inputs_segmentation,
                       targets_segmentation, targets_position, deterministic,
                       return_hidden)
