"""Translate text with a trained model: batching, length buckets, decoding.

    translator = Translator.from_workdir('workdir')   # loads once
    translator(['a source sentence', ''])             # -> list of str, same order

Inputs are padded to one of a few bucket lengths so that a stream of requests
of many lengths compiles the decoder only once per bucket and batch size.
"""
from __future__ import annotations

import sys
from typing import Sequence

import jax
import numpy as np

from xfmr_jax import decode, hf_beam, run_dir
from xfmr_jax.model import SequenceModel
from xfmr_jax.token_ids import EOS
from xfmr_jax.tokenizer import Tokenizer

BUCKETS = (16, 32, 64, 128, 256, 512)


class InputTooLong(ValueError):
  """An input longer than the model's maximum, with ``too_long='error'``."""


class Translator:
  """A callable ``list[str] -> list[str]`` around a model and its tokenizer.

  Args:
    model, params, tokenizer: the trained model.
    beam_size: 1 = greedy; otherwise beam search with length penalty ``alpha``.
    beam_rules: 'gnmt' (:func:`xfmr_jax.decode.beam_search`) or 'hf'
      (:func:`xfmr_jax.hf_beam.beam_search`, Hugging Face ``generate``'s
      scoring, for imported models; ``alpha`` is its ``length_penalty``).
    max_decode_extra: decode up to (bucketed input length + this) tokens.
    batch_size: sentences per decoder call (the last call is padded).
    too_long: 'truncate' (warn on stderr) or 'error' for inputs longer than
      the model's ``max_len``.
    temperature, top_k, top_p, seed: sampling instead of search when
      ``temperature > 0``.
  """

  def __init__(self, model: SequenceModel, params, tokenizer: Tokenizer, *,
               beam_size: int = 1, alpha: float = 0.6,
               beam_rules: str = 'gnmt',
               max_decode_extra: int = decode.DECODE_EXTRA,
               batch_size: int = 64,
               too_long: str = 'truncate', temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0):
    if beam_rules not in ('gnmt', 'hf'):
      raise ValueError(f"beam_rules must be 'gnmt' or 'hf', got {beam_rules!r}")
    if too_long not in ('truncate', 'error'):
      raise ValueError(f"too_long must be 'truncate' or 'error', got {too_long!r}")
    self.model, self.params, self.tokenizer = model, params, tokenizer
    self.beam_size, self.alpha, self.beam_rules = beam_size, alpha, beam_rules
    self.max_decode_extra, self.batch_size = max_decode_extra, batch_size
    self.too_long = too_long
    self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
    self._rng = jax.random.key(seed)
    self.max_input = model.config.max_len
    if model.config.model_kind == 'decoder_only':  # source and output share it
      self.max_input //= 2

  @classmethod
  def from_workdir(cls, workdir: str, step: int | None = None, **kwargs):
    """Load the newest (or given) checkpoint of a training workdir once.

    ``beam_rules`` and ``alpha`` default to the workdir config's
    ``beam_rules`` and ``beam_alpha`` (an imported Marian model's are 'hf' and
    1.0, as ``generate`` scores)."""
    model, params, tokenizer, config = run_dir.load_for_inference(workdir, step)
    kwargs.setdefault('beam_rules', config.get('beam_rules', 'gnmt'))
    kwargs.setdefault('alpha', config.get('beam_alpha', 0.6))
    return cls(model, params, tokenizer, **kwargs)

  def _encode(self, text: str, index: int) -> list[int]:
    ids = self.tokenizer.encode(text) + [EOS]
    if len(ids) > self.max_input:
      if self.too_long == 'error':
        raise InputTooLong(f'input {index} has {len(ids)} tokens, more than '
                           f'the model maximum {self.max_input}')
      print(f'warning: input {index} has {len(ids)} tokens; truncated to '
            f'{self.max_input}', file=sys.stderr)
      ids = ids[:self.max_input - 1] + [EOS]
    return ids

  @staticmethod
  def bucket(length: int, limit: int) -> int:
    """Smallest bucket holding ``length`` tokens (never above ``limit``)."""
    return min(next((b for b in BUCKETS if b >= length), limit), limit)

  def decode_ids(self, inputs: np.ndarray) -> np.ndarray:
    """``[batch, s]`` padded source ids -> ``[batch, t]`` output ids."""
    length = decode.decode_length(self.model.config, inputs.shape[1],
                                  extra=self.max_decode_extra)
    if self.temperature > 0:
      self._rng, key = jax.random.split(self._rng)
      out = decode.sample(self.model, self.params, inputs, key,
                          temperature=self.temperature, top_k=self.top_k,
                          top_p=self.top_p, max_decode_len=length)
    elif self.beam_size > 1 and self.beam_rules == 'hf':
      out, _ = hf_beam.beam_search(self.model, self.params, inputs,
                                   beam_size=self.beam_size, alpha=self.alpha,
                                   max_decode_len=length)
    elif self.beam_size > 1:
      out, _ = decode.beam_search(self.model, self.params, inputs,
                                  beam_size=self.beam_size, alpha=self.alpha,
                                  max_decode_len=length)
    else:
      out = decode.greedy_decode(self.model, self.params, inputs,
                                 max_decode_len=length)
    return np.asarray(out)

  def __call__(self, texts: Sequence[str]) -> list[str]:
    """Translations of ``texts`` in order; an empty input gives ''."""
    encoded = [None if not t.strip() else self._encode(t, i)
               for i, t in enumerate(texts)]
    todo = [i for i, ids in enumerate(encoded) if ids is not None]
    # Sort by length so that each decoder call pads little.
    todo.sort(key=lambda i: len(encoded[i]))
    out = [''] * len(texts)
    for start in range(0, len(todo), self.batch_size):
      chunk = todo[start:start + self.batch_size]
      width = self.bucket(max(len(encoded[i]) for i in chunk), self.max_input)
      inputs = np.zeros((self.batch_size, width), np.int32)
      for row, i in enumerate(chunk):
        inputs[row, :len(encoded[i])] = encoded[i]
      outputs = self.decode_ids(inputs)
      for row, i in enumerate(chunk):
        out[i] = self.tokenizer.decode(outputs[row])
    return out

