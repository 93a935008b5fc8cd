"""Alignments from cross-attention: the source token each output token reads.

Carrying markup, terminology checks and highlighting in a translation tool
need to know which source words an output word came from. A Transformer has
no alignment model, but its cross-attention is a distribution over source
positions for every output position. One teacher-forced pass over the decoded
output (:func:`xfmr_jax.decode.attention_maps`) gives it for every decoder
layer; averaged over one layer's heads, the argmax of the row that predicts
output token ``i`` is the source token aligned to ``i``. The source's EOS and
padding are never chosen (EOS collects attention that aligns to no word).

The layer is a choice: by default the penultimate decoder layer (the last one
of a one-layer decoder), which Garg et al. (2019) found the best aligned of
a six-layer decoder; on the toy task ``docs/toy_task.md`` measures each layer
against the task's gold alignment.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from xfmr_jax import decode
from xfmr_jax.token_ids import EOS, PAD

NONE = -1  # the source position of an output slot with no token


def default_layer(num_decoder_layers: int) -> int:
  """The penultimate decoder layer (the only one of a one-layer decoder)."""
  return max(num_decoder_layers - 2, 0)


def check_layer(layer: int, num_decoder_layers: int) -> int:
  """``layer`` as an index in ``0..num_decoder_layers - 1`` (negative ones
  count from the last), or a ValueError."""
  if not -num_decoder_layers <= layer < num_decoder_layers:
    raise ValueError(f'alignment layer {layer} is not one of the '
                     f'{num_decoder_layers} decoder layers')
  return layer % num_decoder_layers


class Aligned(NamedTuple):
  """A translation with its word alignment
  (:meth:`xfmr_jax.translate.Translator.align`).

  Attributes:
    text: the translation.
    links: sorted ``(source word, translation word)`` index pairs, words
      being the whitespace-separated ones of each text: each translation
      word's tokens linked to the source words they attend to most
      (:func:`source_positions`).
  """
  text: str
  links: list[tuple[int, int]]


@functools.partial(jax.jit, static_argnames=('model', 'layer'))
def source_positions(model, params, inputs, outputs, *, layer=None):
  """For each output token, the source position it attends to most.

  Args:
    model: an encoder-decoder :class:`~xfmr_jax.model.SequenceModel` with
      full attention (what :func:`xfmr_jax.decode.attention_maps` draws).
    inputs: ``[batch, s]`` source ids, 0-padded, EOS-terminated.
    outputs: ``[batch, t]`` decoded ids (EOS-terminated, 0 after).
    layer: static; the decoder layer (default :func:`default_layer`).

  Returns:
    int32 ``[batch, t]``: at output position ``i``, the source position
    (not EOS, not padding) with the largest head-averaged weight of
    ``layer``'s cross-attention in the row that predicts ``outputs[:, i]``;
    :data:`NONE` at the output's EOS and padding, and where the source has
    no token but EOS.
  """
  num_layers = model.config.num_decoder_layers
  layer = check_layer(default_layer(num_layers) if layer is None else layer,
                      num_layers)
  cross = decode.attention_maps(model, params, inputs,
                                outputs)['decoder_cross'][layer]
  weights = jnp.mean(cross, axis=1)                        # [batch, t, s]
  word = (inputs != PAD) & (inputs != EOS)
  weights = jnp.where(word[:, None, :], weights, -1.0)
  position = jnp.argmax(weights, axis=-1).astype(jnp.int32)
  real = (outputs != PAD) & (outputs != EOS) & jnp.any(word, axis=1,
                                                       keepdims=True)
  return jnp.where(real, position, NONE)


def word_starts(pieces) -> list[int]:
  """Word index of each SentencePiece piece: a piece starting with '▁' (or
  the first one) begins a word, so the words are those of the text split at
  whitespace."""
  index, out = -1, []
  for i, piece in enumerate(pieces):
    if i == 0 or piece.startswith('\u2581'):
      index += 1
    out.append(index)
  return out


def word_links(source_words, output_words, positions) -> list[tuple[int, int]]:
  """Token alignments -> sorted unique ``(source word, output word)`` links.

  Args:
    source_words, output_words: the word index of each source / output token
      (:func:`word_starts`).
    positions: per output token, its source position (:data:`NONE`: none).
  """
  return sorted({(source_words[p], output_words[i])
                 for i, p in enumerate(positions)
                 if p != NONE and i < len(output_words)})


def token_links(tokenizer, source_ids, output_ids, positions
                ) -> list[tuple[int, int]]:
  """:func:`word_links` of one EOS-terminated source and its output (ids),
  the words read from the ``tokenizer``'s pieces."""
  words = lambda ids: word_starts([tokenizer.id_to_piece(int(i)) for i in ids])
  output = [int(x) for x in output_ids]
  output = output[:output.index(EOS)] if EOS in output else output
  return word_links(words(source_ids[:-1]), words(output), positions)
