"""A decoder-only (GPT-style) Transformer: translation as conditional LM.

"Transformer" is not only the encoder-decoder of the paper. Here one causal
stack reads ``source EOS <sep> target`` as a single sequence and is
trained to predict the target part; ``<sep>`` is the EOS id again (the toy
vocabulary reserves no other id), standing where the encoder-decoder's
decoder has its start symbol.

The interface is the encoder-decoder's, so training, evaluation, decoding and
sharding use the model unchanged: ``__call__(inputs, targets, ...)`` returns
target logits ``[batch, t, vocab]``, ``init_cache`` runs the source through
the stack once (the "prefill", caching its keys and values) and
``decode_step`` extends the target one cached step at a time.

Layout: the 0-padded ``inputs [batch, s]`` occupy slots ``0 .. s-1`` and the
target part slots ``s ..``; source padding is masked as keys, and each target
token's position (for the positional scheme) is counted from its own source
length, so a row reads as if it had no padding. Packed rows work too: source
and target segment ``k`` are one sequence.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from xfmr_jax import masks
from xfmr_jax.blocks import (SelfAttentionStack, default_positions, output_head,
                             shift_right)
from xfmr_jax.config import ModelConfig
from xfmr_jax.token_ids import EOS, PAD

SEP_ID = EOS  # reused as the separator / start of the target part


def source_lengths(source_segments, target_segments):
  """Tokens of each target token's own source ``[batch, t]``.

  Args:
    source_segments: ``[batch, s]`` segment ids (0 = padding).
    target_segments: ``[batch, t]`` segment ids of the target tokens.
  """
  same = source_segments[:, None, :] == target_segments[:, :, None]
  return jnp.sum(same & (source_segments[:, None, :] != 0), axis=-1)


class DecoderOnly(nn.Module):
  """A causal stack of ``num_decoder_layers`` self-attention + FFN blocks.

  ``num_encoder_layers`` is unused. See the module docstring for the layout.
  """
  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.body = SelfAttentionStack(cfg, cfg.num_decoder_layers)
    self.output_head = output_head(cfg, self.body.embed)

  def _run(self, tokens, mask, positions, deterministic, decode=None,
           step=None):
    """Final states ``[batch, n, d_model]`` of the stack over ``tokens [batch, n]``."""
    return self.body(tokens, mask, positions, deterministic, decode, step)

  def output_table(self):
    """The ``[vocab, d_model]`` pre-softmax projection (see
    :meth:`Transformer.output_table`)."""
    return self.output_head.table()

  def logits(self, x):
    """``[..., d_model] -> float32 [..., vocab]``."""
    return self.output_head(x)

  def __call__(self, inputs, targets, inputs_segmentation=None,
               targets_segmentation=None, inputs_position=None,
               targets_position=None, deterministic: bool = True,
               return_hidden: bool = False):
    """inputs ``[batch, s]``, targets ``[batch, t]`` -> logits ``[batch, t, V]``.

    Same arguments (and ``return_hidden``) as
    :class:`~xfmr_jax.encoder_decoder.Transformer`.
    """
    s = inputs.shape[1]
    src_seg = (inputs != PAD).astype(jnp.int32)
    tgt_seg = (targets != PAD).astype(jnp.int32)
    if inputs_segmentation is not None:
      src_seg, tgt_seg = inputs_segmentation, targets_segmentation
    # Decoder inputs of the target part: the targets shifted right, with the
    # separator where each target starts.
    shifted = shift_right(targets, targets_segmentation)
    shifted = jnp.where((shifted == PAD) & (tgt_seg != 0), SEP_ID,
                        shifted)
    tokens = jnp.concatenate([inputs, shifted], axis=1)
    positions = jnp.concatenate([
        default_positions(inputs, inputs_position),
        source_lengths(src_seg, tgt_seg) +
        default_positions(targets, targets_position)], axis=1)
    segments = jnp.concatenate([src_seg, tgt_seg], axis=1)
    mask = masks.SelfMask(segments, causal=True)
    # Only the target part is projected onto the vocabulary.
    hidden = self._run(tokens, mask, positions, deterministic)[:, s:]
    if return_hidden:
      return self.output_head.hidden(hidden), self.output_table()
    return self.logits(hidden)

  def _cache_mask(self, inputs, cache_len):
    """Keys ``[batch, 1, 1, s + cache_len]``: source padding is invisible."""
    return masks.key_mask(jnp.concatenate(
        [inputs != PAD, jnp.ones((inputs.shape[0], cache_len), bool)], axis=1))

  def init_cache(self, inputs, cache_len: int):
    """Prefill: run the source ``[batch, s]`` through the stack, caching its
    keys and values in ``s + cache_len`` slots (``cache_len`` for the target).
    Apply with ``mutable=['cache']``."""
    s = inputs.shape[1]
    self._run(inputs, self._cache_mask(inputs, cache_len),
              default_positions(inputs), True, s + cache_len, 0)

  def decode_step(self, inputs, tokens, step, encoded=None, *, cache_len: int):
    """Logits ``[batch, n, vocab]`` for target positions ``step .. step+n-1``.

    As :meth:`Transformer.decode_step`; the start symbol 0 of position 0 is
    read as the separator. ``encoded`` must be None (there is no encoder).
    """
    if encoded is not None:
      raise ValueError('a decoder-only model has no encoder output to cache')
    s = inputs.shape[1]
    tokens = jnp.where(tokens == PAD, SEP_ID, tokens)
    lengths = jnp.sum(inputs != PAD, axis=1, keepdims=True)
    positions = lengths + step + jnp.arange(tokens.shape[1])
    return self.logits(self._run(tokens, self._cache_mask(inputs, cache_len),
                                 positions, True, s + cache_len, s + step))
