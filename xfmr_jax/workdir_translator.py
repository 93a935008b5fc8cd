"""The service's translator for a training workdir: every decoding option.

    translator = WorkdirTranslator('workdir', beam_sizes=(4, 1))
    app = xfmr_jax.service.make_app(translator)

An exported artifact (:mod:`xfmr_jax.serving`) holds the plain search per
beam size and bucket, and runs without model code. Served from a workdir, the
service decodes with :class:`~xfmr_jax.translate.Translator` instead, so a
request may also ask for n-best lists with scores, target prefixes,
terminology constraints, anti-repetition and alignments
(:data:`xfmr_jax.service_request.OPTION_FIELDS`), and ``/score`` scores given
translations. Plain requests give the artifact's translations token for
token: both run the same search with the same buckets and row padding.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from xfmr_jax import constraints as constraint_lib
from xfmr_jax import decode, serving, source_batches, target_prefix
from xfmr_jax.service_request import OPTION_FIELDS, SCORE, Job, Options
from xfmr_jax.token_ids import EOS
from xfmr_jax.translate import Translator, beam_settings
from xfmr_jax.workdir import Workdir

__all__ = ['WorkdirTranslator']


class WorkdirTranslator:
  """A trained model behind the interface :func:`xfmr_jax.service.make_app`
  takes (that of :class:`~xfmr_jax.serving.ExportedTranslator`, plus
  :meth:`prepare` and :meth:`run` for the decoding options).

  Args:
    workdir: a training workdir; its newest (or ``step``'s) checkpoint.
    beam_sizes: the beam sizes requests may ask for (the first: default).
    batch_size, max_decode_extra: as :class:`~xfmr_jax.translate.Translator`
      (and ``python -m experiments.export``) take them.
    max_settings: the most distinct anti-repetition settings it decodes
      with (each compiles its own search, and a client must not be able to
      make the service compile without end).
  """

  options = frozenset(OPTION_FIELDS + (SCORE,))

  def __init__(self, workdir: str, *, beam_sizes: Sequence[int] = (4, 1),
               step: int | None = None, batch_size: int = 64,
               max_decode_extra: int = decode.DECODE_EXTRA,
               max_settings: int = 8):
    if not beam_sizes or any(b < 1 for b in beam_sizes):
      raise ValueError(f'beam sizes must be >= 1, got {list(beam_sizes)}')
    trained = Workdir(workdir).load(step)
    self.tokenizer, self.config = trained.tokenizer, trained.model.config
    self._make = functools.partial(
        Translator, trained.model, trained.params, trained.tokenizer,
        batch_size=batch_size, max_decode_extra=max_decode_extra,
        too_long='error', **beam_settings(trained.config))
    self.beam_sizes, self.batch_size = list(beam_sizes), batch_size
    self.max_input = source_batches.max_input_length(
        self.config.max_len, self.config.model_kind)
    self.buckets = source_batches.buckets_up_to(self.max_input)
    self.manifest = {'platforms': [serving.platform()], 'workdir': workdir}
    self._translators, self.max_settings = {}, max_settings

  def translator(self, beam_size: int, no_repeat_ngram_size: int = 0,
                 repetition_penalty: float = 1.0) -> Translator:
    """The Translator of these settings (made once; they share the model, and
    jax's caches hold each compiled search once)."""
    key = beam_size, no_repeat_ngram_size, repetition_penalty
    if key not in self._translators:
      chosen = sorted({k[1:] for k in self._translators} - {(0, 1.0)})
      if key[1:] != (0, 1.0) and key[1:] not in chosen and (
          len(chosen) >= self.max_settings):
        raise ValueError(
            f'this service decodes at most {self.max_settings} distinct '
            '(no_repeat_ngram_size, repetition_penalty) settings; ask with '
            f'one it has: {chosen}')
      self._translators[key] = self._make(
          beam_size=beam_size, no_repeat_ngram_size=no_repeat_ngram_size,
          repetition_penalty=repetition_penalty)
    return self._translators[key]

  def _of(self, beam_size: int, options: Options) -> Translator:
    return self.translator(beam_size, options.no_repeat_ngram_size,
                           options.repetition_penalty)

  def encode(self, text: str, index: int = 0, too_long: str = 'error'):
    """Source ids with EOS (``None`` for a blank text)."""
    return source_batches.encode_source(self.tokenizer, text, index,
                                        self.max_input, too_long)

  def bucket(self, length: int) -> int:
    return source_batches.bucket(length, self.max_input, self.buckets)

  def prepare(self, encoded, beam_size: int, options: Options,
              prefixes=None, constraints=None) -> list[Job | None]:
    """One :class:`Job` per encoded text (None: blank), every option checked
    here, so that a batch never fails for one request's settings.

    Raises:
      ValueError: settings or texts the search cannot take (a
        :class:`~xfmr_jax.target_prefix.PrefixError`, a
        :class:`~xfmr_jax.constraints.ConstraintError`, or the checks of
        :class:`~xfmr_jax.translate.Translator`), with a message for the
        client.
    """
    translator = self._of(beam_size, options)
    beam_loop = bool(options.num_hypotheses) or None
    if options.num_hypotheses:
      translator.check_nbest(options.num_hypotheses)
    if options.alignments:
      translator.check_align(options.alignment_layer)
    prefix_ids = translator.encode_prefixes(prefixes, encoded, beam_loop)
    constraint_ids = translator.encode_constraints(constraints, encoded,
                                                   prefix_ids)
    jobs = []
    for ids, prefix, phrases in zip(encoded, prefix_ids, constraint_ids):
      if ids is None:
        jobs.append(None)
        continue
      # The limits of the batch this sentence will share: one source bucket,
      # and outputs at least as long as its own prefix bucket gives.
      width = self.bucket(len(ids))
      if prefix:
        target_prefix.check([prefix], translator.decode_length(
            width, translator.bucket(len(prefix), self.config.max_len - 1)))
      if phrases:
        constraint_lib.check([phrases], translator.decode_length(width))
      jobs.append(Job(ids, prefix, phrases))
    return jobs

  def run(self, jobs: Sequence[Job], beam_size: int, options: Options
          ) -> list[dict]:
    """Decode prepared jobs of one bucket: per job ``{"translation": str}``,
    with ``"hypotheses"`` (``[{"text", "score", "log_prob"}, ...]``, best
    first) for n-best requests and ``"alignment"`` (``[[source word,
    translation word], ...]``) for alignment requests."""
    translator = self._of(beam_size, options)
    encoded = [j.ids for j in jobs]
    prefixes = [j.prefix for j in jobs]
    phrases = [j.constraints for j in jobs]
    if options.num_hypotheses:
      lists = translator.nbest_ids(encoded, options.num_hypotheses, prefixes,
                                   phrases)
      return [{'translation': hyps[0].text if hyps else '',
               'hypotheses': [h._asdict() for h in hyps]} for hyps in lists]
    if options.alignments:
      return [{'translation': a.text, 'alignment': [list(p) for p in a.links]}
              for a in translator.align_ids(encoded, prefixes, phrases,
                                            layer=options.alignment_layer)]
    return [{'translation': t}
            for t in translator.translate_ids(encoded, prefixes, phrases)]

  def encode_targets(self, encoded, targets) -> list[list[int]]:
    """Targets to score as ids with EOS, checked against their encoded
    sources (:meth:`~xfmr_jax.translate.Translator.encode_targets`)."""
    return self.translator(self.beam_sizes[0]).encode_targets(encoded, targets)

  def score(self, pairs) -> list[list[float]]:
    """``(source ids, target ids)`` pairs of one source bucket -> each
    target's token log-probabilities, EOS last (teacher forcing)."""
    return [p.tolist() for p in self.translator(self.beam_sizes[0]).score_ids(
        [source for source, _ in pairs], [target for _, target in pairs])]

  def translate_encoded(self, rows, beam_size=None) -> list[str]:
    """Plain translations of encoded sources (as the artifact's)."""
    beam_size = self.beam_sizes[0] if beam_size is None else beam_size
    return self.translator(beam_size).translate_ids(rows, [None] * len(rows))

  def warm_up(self, beam_sizes=None, widths=None) -> int:
    """Compile the plain search for every beam size, bucket width and row
    count (see :meth:`~xfmr_jax.serving.ExportedTranslator.warm_up`);
    returns how many programs were run."""
    count = 0
    for beam_size in beam_sizes or self.beam_sizes:
      for width in widths or self.buckets:
        for rows in source_batches.row_counts(self.batch_size):
          inputs = np.zeros((rows, width), np.int32)
          inputs[:, 0] = EOS
          self.translator(beam_size).decode_ids(inputs)
          count += 1
    return count
