"""An encoder-only (BERT-style) Transformer with a token-level head.

The encoder stack of the paper, bidirectional, and a linear head giving
``config.num_labels`` logits per token. The interface matches the other
models so the same train and eval steps run it: ``__call__(inputs, targets,
...)`` where ``targets [batch, s]`` are the labels aligned with ``inputs``
(0 = padding, ignored by the loss; the model does not read them). The toy
task it is trained on is :mod:`xfmr_jax.data.toy_tagging`.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from xfmr_jax import masks
from xfmr_jax.blocks import SelfAttentionStack, default_positions
from xfmr_jax.config import ModelConfig
from xfmr_jax.layers import dense


class EncoderOnly(nn.Module):
  """``num_encoder_layers`` encoder layers and a ``d_model -> num_labels`` head."""
  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.body = SelfAttentionStack(cfg, cfg.num_encoder_layers)
    self.head = dense(cfg.num_labels, ('embed', None), 'head')

  def __call__(self, inputs, targets=None, inputs_segmentation=None,
               targets_segmentation=None, inputs_position=None,
               targets_position=None, deterministic: bool = True):
    """inputs ``[batch, s]`` -> float32 label logits ``[batch, s, num_labels]``."""
    del targets, targets_segmentation, targets_position  # labels: loss only
    mask = masks.self_mask(inputs, inputs_segmentation)
    x = self.body(inputs, mask, default_positions(inputs, inputs_position),
                  deterministic)
    return self.head(x).astype(jnp.float32)
