"""Translate text with a trained model: batching, length buckets, decoding.

    translator = Translator.from_workdir('workdir')   # loads once
    translator(['a source sentence', ''])             # -> list of str, same order
    translator.translate_document(text)               # -> str, layout kept

Inputs are padded to one of a few bucket lengths, and each call's rows to a
power of two, so that a stream of requests of many lengths compiles the
decoder a few times per bucket, and one sentence decodes one row (the rules
live in :mod:`xfmr_jax.source_batches`, shared with the exported translator
of :mod:`xfmr_jax.serving`).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np

from xfmr_jax import alignment
from xfmr_jax import beam_search as beam_lib
from xfmr_jax import constraints as constraint_lib
from xfmr_jax import decode, documents, hf_beam, repetition, source_batches
from xfmr_jax import target_prefix
from xfmr_jax.alignment import Aligned
from xfmr_jax.beam_search import Hypothesis
from xfmr_jax.model import SequenceModel
from xfmr_jax.source_batches import BUCKETS, InputTooLong
from xfmr_jax.token_ids import EOS
from xfmr_jax.tokenizer import Tokenizer
from xfmr_jax.workdir import Workdir

__all__ = ['Aligned', 'BEAM_RULES', 'BUCKETS', 'Hypothesis', 'InputTooLong',
           'Translator', 'search']


BEAM_RULES = ('gnmt', 'hf')


def search(model: SequenceModel, params, inputs, *, beam_size: int,
           alpha: float, beam_rules: str, max_decode_len: int,
           no_repeat_ngram_size: int = 0, repetition_penalty: float = 1.0,
           prefix=None, constraints=None, word_starts=None):
  """``[batch, s]`` source ids -> ``[batch, max_decode_len]`` output ids:
  greedy for ``beam_size`` 1, else beam search under ``beam_rules`` ('gnmt':
  :func:`xfmr_jax.decode.beam_search`; 'hf': :func:`xfmr_jax.hf_beam.
  beam_search`, Hugging Face ``generate``'s scoring), with the
  anti-repetition settings of :mod:`xfmr_jax.repetition` and target
  prefixes ``[batch, p]`` of :mod:`xfmr_jax.target_prefix` (not under 'hf')
  and terminology constraints ``[batch, C]`` of
  :mod:`xfmr_jax.constraints` with the ``[vocab]`` ``word_starts`` of the
  tokenizer (GNMT's beam search only). Traceable: the exported translator
  (:mod:`xfmr_jax.export`) runs this same function."""
  repeat = dict(no_repeat_ngram_size=no_repeat_ngram_size,
                repetition_penalty=repetition_penalty)
  if beam_size == 1:
    return decode.greedy_decode(model, params, inputs, prefix=prefix,
                                max_decode_len=max_decode_len, **repeat)
  if beam_rules == 'hf':
    out, _ = hf_beam.beam_search(model, params, inputs, beam_size=beam_size,
                                 alpha=alpha, max_decode_len=max_decode_len,
                                 prefix=prefix, **repeat)
  else:
    out, _ = decode.beam_search(model, params, inputs, beam_size=beam_size,
                                alpha=alpha, max_decode_len=max_decode_len,
                                prefix=prefix, constraints=constraints,
                                word_starts=word_starts, **repeat)
  return out


def beam_settings(config) -> dict:
  """The beam scoring a workdir's config asks for: ``beam_rules`` and
  ``alpha`` (its ``beam_alpha``; configs written before a field existed get
  the defaults 'gnmt' and 0.6)."""
  return dict(beam_rules=config.get('beam_rules', 'gnmt'),
              alpha=config.get('beam_alpha', 0.6))


class Translator:
  """A callable ``list[str] -> list[str]`` around a model and its tokenizer.

  Args:
    model, params, tokenizer: the trained model.
    beam_size: 1 = greedy; otherwise beam search with length penalty ``alpha``.
    beam_rules: 'gnmt' (:func:`xfmr_jax.decode.beam_search`) or 'hf'
      (:func:`xfmr_jax.hf_beam.beam_search`, Hugging Face ``generate``'s
      scoring, for imported models; ``alpha`` is its ``length_penalty``).
    max_decode_extra: decode up to (bucketed input length + this) tokens.
    batch_size: the most sentences per decoder call; a call's rows are
      padded to a power of two (at most ``batch_size``), so one sentence
      decodes one row.
    too_long: 'truncate' (warn on stderr) or 'error' for inputs longer than
      the model's ``max_len``.
    temperature, top_k, top_p, seed: sampling instead of search when
      ``temperature > 0``.
    no_repeat_ngram_size, repetition_penalty: anti-repetition in greedy
      decoding, sampling and beam search (:mod:`xfmr_jax.repetition`; 0 and
      1.0: off; under 'hf' as ``generate`` has them).
  """

  def __init__(self, model: SequenceModel, params, tokenizer: Tokenizer, *,
               beam_size: int = 1, alpha: float = 0.6,
               beam_rules: str = 'gnmt',
               max_decode_extra: int = decode.DECODE_EXTRA,
               batch_size: int = 64,
               too_long: str = 'truncate', temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               no_repeat_ngram_size: int = 0, repetition_penalty: float = 1.0):
    repetition.check(no_repeat_ngram_size, repetition_penalty)
    if beam_rules not in BEAM_RULES:
      raise ValueError(f'beam_rules must be one of {BEAM_RULES}, got '
                       f'{beam_rules!r}')
    if too_long not in ('truncate', 'error'):
      raise ValueError(f"too_long must be 'truncate' or 'error', got {too_long!r}")
    self.model, self.params, self.tokenizer = model, params, tokenizer
    self.beam_size, self.alpha, self.beam_rules = beam_size, alpha, beam_rules
    self.max_decode_extra, self.batch_size = max_decode_extra, batch_size
    self.too_long = too_long
    self.repeat = dict(no_repeat_ngram_size=no_repeat_ngram_size,
                       repetition_penalty=float(repetition_penalty))
    self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
    self._rng = jax.random.key(seed)
    self.max_input = source_batches.max_input_length(
        model.config.max_len, model.config.model_kind)

  @classmethod
  def from_workdir(cls, workdir: str, step: int | None = None, **kwargs):
    """Load the newest (or given) checkpoint of a training workdir once.

    ``beam_rules`` and ``alpha`` default to the workdir config's
    ``beam_rules`` and ``beam_alpha`` (an imported Marian model's are 'hf' and
    1.0, as ``generate`` scores)."""
    trained = Workdir(workdir).load(step)
    return cls(trained.model, trained.params, trained.tokenizer,
               **{**beam_settings(trained.config), **kwargs})

  @staticmethod
  def bucket(length: int, limit: int) -> int:
    """Smallest bucket holding ``length`` tokens (never above ``limit``)."""
    return source_batches.bucket(length, limit)

  def decode_length(self, width: int, prefix_width: int = 0) -> int:
    """Output positions for sources of ``width``: ``max_decode_extra`` past
    the longer of the sources and the prefixes, within the model's limit."""
    return decode.decode_length(self.model.config, width,
                                max(width, prefix_width) +
                                self.max_decode_extra)

  def decode_ids(self, inputs: np.ndarray, prefix=None,
                 constraints=None) -> np.ndarray:
    """``[batch, s]`` padded source ids (and optional ``[batch, p]`` target
    prefixes or ``[batch, C]`` packed constraints) -> ``[batch, t]`` output
    ids."""
    length = self.decode_length(inputs.shape[1],
                                0 if prefix is None else prefix.shape[1])
    if self.temperature > 0:
      self._rng, key = jax.random.split(self._rng)
      out = decode.sample(self.model, self.params, inputs, key,
                          temperature=self.temperature, top_k=self.top_k,
                          top_p=self.top_p, max_decode_len=length,
                          prefix=prefix, **self.repeat)
    else:
      out = search(self.model, self.params, inputs, beam_size=self.beam_size,
                   alpha=self.alpha, beam_rules=self.beam_rules,
                   max_decode_len=length, prefix=prefix,
                   constraints=constraints,
                   word_starts=None if constraints is None
                   else self._word_starts, **self.repeat)
    return np.asarray(out)

  def _encode(self, texts: Sequence[str]) -> list[list[int] | None]:
    """Each text's source ids (``None`` for a blank one)."""
    return [source_batches.encode_source(self.tokenizer, t, i, self.max_input,
                                         self.too_long)
            for i, t in enumerate(texts)]

  def encode_prefixes(self, prefixes, encoded, beam_loop: bool | None = None):
    """Each text's prefix ids (``None``: no prefix), checked; ``beam_loop``:
    decoded by a beam search loop, so not under generate's rules (default:
    what this translator's settings decode with)."""
    if beam_loop is None:
      beam_loop = self.beam_size > 1 and self.temperature == 0
    ids = target_prefix.encode(self.tokenizer, prefixes, encoded,
                               self.model.config.max_len)
    if any(ids) and beam_loop and self.beam_rules == 'hf':
      raise target_prefix.PrefixError(target_prefix.NOT_UNDER_HF)
    return ids

  @functools.cached_property
  def _word_starts(self):  # for constraints (constraints.word_starts)
    return constraint_lib.word_starts(self.tokenizer,
                                      self.model.config.vocab_size)

  def encode_constraints(self, constraints, encoded, prefix_ids):
    """Each text's constraint phrases as id lists (``None``: none), checked,
    and what they are combined with."""
    ids = constraint_lib.encode(self.tokenizer, constraints, encoded,
                                self.model.config.max_len)
    if any(ids) and (self.beam_size == 1 or self.temperature > 0 or
                     self.beam_rules == 'hf' or any(prefix_ids)):
      raise constraint_lib.ConstraintError(
          "terminology constraints need GNMT's beam search (beam_size > 1, "
          "beam_rules 'gnmt', no sampling) and no target prefixes")
    return ids

  def _batch(self, chunk, width, encoded, prefix_ids, constraint_ids=None):
    """A chunk's ``[n, width]`` sources, ``[n, p]`` prefixes and ``[n, C]``
    packed constraints (each None when none of its texts has one, which
    decodes as without the option)."""
    inputs = source_batches.pad_rows([encoded[i] for i in chunk], width,
                                     self.batch_size)
    prefix = constraints = None
    rows = [prefix_ids[i] for i in chunk]
    if any(rows):
      p = self.bucket(max(len(r or ()) for r in rows),
                      self.model.config.max_len - 1)
      target_prefix.check(rows, self.decode_length(width, p))
      prefix = target_prefix.pad(rows, len(inputs), p)
    rows = [None if constraint_ids is None else constraint_ids[i]
            for i in chunk]
    if any(rows):
      constraint_lib.check(rows, self.decode_length(width))
      constraints = constraint_lib.pack(rows, len(inputs), self.bucket(
          constraint_lib.packed_width(rows), 2 * self.model.config.max_len))
    return inputs, prefix, constraints

  def __call__(self, texts: Sequence[str],
               prefixes: Sequence[str | None] | None = None,
               constraints: Sequence[Sequence[str] | None] | None = None
               ) -> list[str]:
    """Translations of ``texts`` in order; an empty input gives ''.

    ``prefixes``: per text, a target prefix the translation must start with
    (None or '' for none; :mod:`xfmr_jax.target_prefix`). It is tokenized on
    its own, so it should end at a word boundary; the translation holds it.

    ``constraints``: per text, target phrases its translation must contain
    (None or [] for none; :mod:`xfmr_jax.constraints`), by dynamic beam
    allocation in GNMT's beam search; a beam larger than the phrases' token
    count places them best.
    """
    encoded = self._encode(texts)
    prefix_ids = self.encode_prefixes(prefixes, encoded)
    return self.translate_ids(encoded, prefix_ids, self.encode_constraints(
        constraints, encoded, prefix_ids))

  def translate_ids(self, encoded, prefix_ids, constraint_ids=None
                    ) -> list[str]:
    """Translations of encoded texts (None: blank, giving '') in order, with
    the checked ids of :meth:`encode_prefixes` and :meth:`encode_constraints`
    (the service's way in, which encodes each text on its own)."""

    def translate_chunk(chunk, width):
      outputs = self.decode_ids(*self._batch(chunk, width, encoded,
                                             prefix_ids, constraint_ids))
      return [self.tokenizer.decode(outputs[r]) for r in range(len(chunk))]
    return source_batches.translate_in_order(encoded, self.batch_size,
                                             self.max_input, translate_chunk)

  def translate_document(self, text: str, language: str = 'en') -> str:
    """The translation of a whole document, its layout kept.

    ``text`` is cut into sentences (:func:`xfmr_jax.documents.split`, by the
    rules of the source ``language``); they are translated in batches as
    :meth:`__call__` does, and put back between the original spaces, line
    breaks and blank lines. A sentence longer than the model takes is cut
    into parts at word boundaries of its tokens
    (:func:`xfmr_jax.documents.split_ids`), whose translations are joined
    with a space: nothing is truncated, whatever ``too_long`` says.
    """
    doc = documents.split(text, language)
    rows, owner = documents.encode(doc, self.tokenizer, self.max_input)
    return documents.assemble(doc, owner,
                              self.translate_ids(rows, [None] * len(rows)))

  def nbest(self, texts: Sequence[str], num_hypotheses: int,
            prefixes: Sequence[str | None] | None = None,
            constraints: Sequence[Sequence[str] | None] | None = None
            ) -> list[list[Hypothesis]]:
    """The ``num_hypotheses`` best translations of each text, best first.

    The beam search of this translator (``beam_size`` beams, 1 being greedy,
    under ``beam_rules``) keeps them anyway: both rule sets hold the ``k``
    best finished hypotheses. Where a sentence finished fewer (the output
    limit reached first), its best unfinished ones follow; a list can be
    shorter than asked where the search held fewer distinct hypotheses. An
    empty text gets an empty list. ``prefixes`` and ``constraints`` as in
    :meth:`__call__` (a hypothesis' ``log_prob`` counts its prefix's tokens).

    Raises:
      ValueError: ``num_hypotheses`` not in ``1..beam_size``, or a sampling
        translator (``temperature > 0``), which has no ranked list.
    """
    self.check_nbest(num_hypotheses)
    encoded = self._encode(texts)
    prefix_ids = self.encode_prefixes(prefixes, encoded, True)
    return self.nbest_ids(encoded, num_hypotheses, prefix_ids,
                          self.encode_constraints(constraints, encoded,
                                                  prefix_ids))

  def check_nbest(self, num_hypotheses: int) -> None:
    """The ValueError :meth:`nbest` raises for these settings, if any."""
    if not 1 <= num_hypotheses <= self.beam_size:
      raise ValueError(f'num_hypotheses must be between 1 and the beam size '
                       f'{self.beam_size}, got {num_hypotheses}')
    if self.temperature > 0:
      raise ValueError('n-best lists come from beam search; this translator '
                       f'samples (temperature {self.temperature})')

  def nbest_ids(self, encoded, num_hypotheses: int, prefix_ids,
                constraint_ids=None) -> list[list[Hypothesis]]:
    """:meth:`nbest` of encoded texts and checked options (as
    :meth:`translate_ids`)."""
    beam = functools.partial(hf_beam.beam_search if self.beam_rules == 'hf'
                             else decode.beam_search, **self.repeat)

    def chunk_nbest(chunk, width):
      inputs, prefix, packed = self._batch(chunk, width, encoded, prefix_ids,
                                           constraint_ids)
      extra = {} if packed is None else dict(
          constraints=packed, word_starts=self._word_starts)
      tokens, scores, log_probs = map(np.asarray, beam(
          self.model, self.params, inputs, beam_size=self.beam_size,
          alpha=self.alpha, max_decode_len=self.decode_length(
              width, 0 if prefix is None else prefix.shape[1]),
          num_hypotheses=num_hypotheses, prefix=prefix, **extra))
      return [[Hypothesis(self.tokenizer.decode(tokens[r, j]),
                          float(scores[r, j]), float(log_probs[r, j]))
               for j in range(num_hypotheses)
               if scores[r, j] > beam_lib.NEG_INF / 2]
              for r in range(len(chunk))]
    out = source_batches.translate_in_order(
        encoded, self.batch_size, self.max_input, chunk_nbest, empty=None)
    return [[] if hyps is None else hyps for hyps in out]

  def align(self, texts: Sequence[str],
            prefixes: Sequence[str | None] | None = None,
            constraints: Sequence[Sequence[str] | None] | None = None, *,
            layer: int | None = None) -> list[Aligned]:
    """Translations of ``texts`` (as :meth:`__call__` gives them, with the
    same options) with their word alignments, from the cross-attention of
    decoder ``layer`` (default: the penultimate,
    :func:`xfmr_jax.alignment.default_layer`) over the decoded output. An
    empty text gets ``Aligned('', [])``.

    Raises:
      ValueError: a layer the decoder does not have, or a model whose
        attention weights are not drawn (not an encoder-decoder with full
        attention).
    """
    layer = self.check_align(layer)
    encoded = self._encode(texts)
    prefix_ids = self.encode_prefixes(prefixes, encoded)
    return self.align_ids(encoded, prefix_ids, self.encode_constraints(
        constraints, encoded, prefix_ids), layer=layer)

  def check_align(self, layer: int | None) -> int | None:
    """``layer`` as an index (None: the default), or the ValueError of
    :meth:`align`."""
    decode.check_attention_maps(self.model.config)
    if layer is None:
      return None
    return alignment.check_layer(layer, self.model.config.num_decoder_layers)

  def align_ids(self, encoded, prefix_ids, constraint_ids=None, *,
                layer: int | None = None) -> list[Aligned]:
    """:meth:`align` of encoded texts and checked options (as
    :meth:`translate_ids`)."""

    def chunk_aligned(chunk, width):
      inputs, prefix, packed = self._batch(chunk, width, encoded, prefix_ids,
                                           constraint_ids)
      outputs = self.decode_ids(inputs, prefix, packed)
      positions = np.asarray(alignment.source_positions(
          self.model, self.params, inputs, outputs, layer=layer))
      return [Aligned(self.tokenizer.decode(outputs[r]), alignment.token_links(
          self.tokenizer, encoded[i], outputs[r], positions[r]))
              for r, i in enumerate(chunk)]
    return source_batches.translate_in_order(
        encoded, self.batch_size, self.max_input, chunk_aligned,
        empty=Aligned('', []))

  def score(self, sources: Sequence[str],
            targets: Sequence[str]) -> list[np.ndarray]:
    """Each target's token log-probabilities under the model, given its source.

    Teacher forcing (:func:`xfmr_jax.decode.token_log_probs`), batched and
    bucketed as translation is (by source length; the targets of a call padded
    to one bucket). Returns, in order, a float32 array per pair: one entry per
    target token and a last one for EOS; its sum is the log-probability of the
    target. An empty target scores EOS alone.

    Raises:
      ValueError: ``sources`` and ``targets`` of different lengths, an empty
        source, or a target longer than the model's ``max_len`` (nothing is
        scored then).
    """
    if len(sources) != len(targets):
      raise ValueError(f'{len(sources)} sources but {len(targets)} targets')
    encoded = self._encode(sources)
    return self.score_ids(encoded, self.encode_targets(encoded, targets))

  def encode_targets(self, encoded, targets) -> list[list[int]]:
    """Each target's ids with EOS, checked (the ValueErrors of :meth:`score`)
    against the encoded sources."""
    if self.model.config.model_kind != 'encoder_decoder':
      raise ValueError('score needs an encoder-decoder model, got '
                       f'{self.model.config.model_kind!r}')
    empty = [i for i, ids in enumerate(encoded) if ids is None]
    if empty:
      raise ValueError(f'source {empty[0]} is empty; there is nothing to '
                       'score its target against')
    limit = self.model.config.max_len
    wanted = [self.tokenizer.encode_target(t) + [EOS] for t in targets]
    for i, ids in enumerate(wanted):
      if len(ids) > limit:
        raise ValueError(f'target {i} has {len(ids)} tokens, more than the '
                         f'model maximum {limit}')
    return wanted

  def score_ids(self, encoded, wanted) -> list[np.ndarray]:
    """:meth:`score` of encoded sources and :meth:`encode_targets`' ids."""
    limit = self.model.config.max_len
    out = [None] * len(encoded)
    for chunk, width in source_batches.plan(encoded, self.batch_size,
                                            self.max_input):
      rows = [wanted[i] for i in chunk]
      inputs = source_batches.pad_rows([encoded[i] for i in chunk], width,
                                       self.batch_size)
      target_width = self.bucket(max(map(len, rows)), limit)
      log_p = np.asarray(decode.token_log_probs(
          self.model, self.params, inputs,
          source_batches.pad_rows(rows, target_width, self.batch_size)))
      for r, i in enumerate(chunk):
        out[i] = log_p[r, :len(rows[r])]
    return out
