"""The models, by kind: ``build(config)`` and the interface they share.

* ``encoder_decoder``: :class:`~xfmr_jax.encoder_decoder.Transformer`, the
  paper's model;
* ``decoder_only``: :class:`~xfmr_jax.decoder_only.DecoderOnly`, one causal
  stack over ``source EOS target``;
* ``encoder_only``: :class:`~xfmr_jax.encoder_only.EncoderOnly`, a token
  tagger.

The first two are :class:`SequenceModel`\\ s: training (:mod:`xfmr_jax.train_steps`)
and decoding (:mod:`xfmr_jax.decode`) use nothing else of them.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import flax.linen as nn
import jax

from xfmr_jax.config import ModelConfig
from xfmr_jax.decoder_only import DecoderOnly
from xfmr_jax.encoder_decoder import Transformer
from xfmr_jax.encoder_only import EncoderOnly

KINDS = {'encoder_decoder': Transformer, 'decoder_only': DecoderOnly,
         'encoder_only': EncoderOnly}


@runtime_checkable
class SequenceModel(Protocol):
  """What training and decoding need of a model that emits target tokens.

  Linen methods: call them through ``model.apply(variables, ...,
  method=...)``.
  """
  config: ModelConfig

  def __call__(self, inputs, targets, inputs_segmentation=None,
               targets_segmentation=None, inputs_position=None,
               targets_position=None, deterministic: bool = True,
               return_hidden: bool = False):
    """Teacher-forced logits ``[batch, t, vocab]`` of unshifted ``targets``
    ``[batch, t]`` given ``inputs`` ``[batch, s]``; with ``return_hidden``,
    ``(hidden [batch, t, d], output_table() [vocab, d])`` with ``d`` =
    d_model (+ 1 for a logits bias)."""

  def output_table(self):
    """The ``[vocab, d]`` pre-softmax projection (``d`` as above)."""

  def init_cache(self, inputs, cache_len: int):
    """Fill the ``cache`` collection for decoding ``cache_len`` tokens."""

  def decode_step(self, inputs, tokens, step, encoded=None, *, cache_len: int):
    """Logits ``[batch, n, vocab]`` of ``tokens`` ``[batch, n]`` at positions
    ``step ..``, reading and extending the cache."""


def build(config: ModelConfig) -> nn.Module:
  """The model of ``config.model_kind`` (see the module docstring)."""
  return KINDS[config.model_kind](config)


def param_count(params) -> int:
  """Number of parameters in a params tree (boxed by ``init`` or not, or a
  whole ``{'params': ...}`` variables dict)."""
  return sum(x.size for x in jax.tree.leaves(nn.unbox(params)))


__all__ = ['DecoderOnly', 'EncoderOnly', 'KINDS', 'SequenceModel',
           'Transformer', 'build', 'param_count']
