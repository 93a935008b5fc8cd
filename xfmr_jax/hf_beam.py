"""Beam search under Hugging Face ``generate``'s rules, one ``jax.jit``.

A model imported from Hugging Face (:mod:`xfmr_jax.marian`) translates as
``model.generate(num_beams=k)`` does only if the search scores and stops as
``generate`` does, which differs from :func:`xfmr_jax.decode.beam_search` (the
GNMT rules) in five ways:

* the length penalty is ``len ** alpha`` (``length_penalty``, 1.0 by default
  there), ``len`` counting the generated tokens with the EOS;
* each step ranks ``2k`` extensions of the ``k`` alive beams, so ``k`` beams
  stay alive after some end; an extension ending in EOS is a finished
  hypothesis only if it ranks among the first ``k``;
* the pad id is banned after the log-softmax (a logits processor acting on
  log-probabilities; Marian checkpoints ship ``bad_words_ids=[[pad]]``), so
  the other log-probabilities are not renormalised;
* at the last position every alive beam must end: EOS is forced (Marian's
  ``forced_eos_token_id``) at log-probability 0, and all extensions become
  finished hypotheses;
* ``early_stopping=False``: a row stops once its ``k`` finished hypotheses all
  beat its best alive beam's score at the current length.

:class:`Generate` holds these rules for :mod:`xfmr_jax.beam_search`'s loop,
which runs every beam search (the cache, the steps, the reordering);
:func:`beam_search` is that loop under them. ``max_decode_len`` is
``generate``'s ``max_new_tokens`` (``max_length`` minus the decoder start
token). The conventions are those of :mod:`xfmr_jax.decode`: start symbol 0,
EOS 1, outputs 0 after EOS.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from xfmr_jax import beam_search as beam_lib
from xfmr_jax import constraints as constraint_lib
from xfmr_jax import decode, decode_steps, repetition, target_prefix
from xfmr_jax import top_k as topk
from xfmr_jax.token_ids import EOS, PAD

_OFF = -1.0e9  # generate's "impossible" score offset


def _finish_scores(fin_scores, fin_seqs, fin_done, scores, seqs, done):
  """Merge new finished candidates (scored, or ``_OFF``-offset if not) into
  the ``k`` best finished hypotheses. ``*_seqs`` ``[batch, n, length]``."""
  k = fin_scores.shape[1]
  merged = jnp.concatenate([fin_scores, scores], axis=1)
  best, pick = jax.lax.top_k(merged, k)
  take = lambda x: jnp.take_along_axis(x, pick.reshape(
      pick.shape + (1,) * (x.ndim - 2)), axis=1)
  return (best, take(jnp.concatenate([fin_seqs, seqs], axis=1)),
          take(jnp.concatenate([fin_done, done], axis=1)))


def _best_extensions(logits, alive_logp, n, forced, normalised=False):
  """The ``n`` best ``alive_logp + log p(token)`` over every beam and token,
  as ``generate`` ranks them, without materialising the log-softmax.

  The n best of all ``k * vocab`` extensions are among the n best of each
  beam, so a per-beam top-n of the logits, shifted by their logsumexp,
  then a top-n of those ``k * n`` gives the same extensions as a top-n of the
  whole log-softmax (one pass over the vocabulary instead of three). The pad
  id is banned after the normalisation, as ``generate``'s processor does;
  ``forced`` (traced bool) leaves only EOS, at log-probability 0.

  Args:
    logits: ``[batch * k, vocab]``; alive_logp: ``[batch, k]``.
    normalised: static; ``logits`` are log-probabilities already (processed
      after the log-softmax, which nothing renormalises).

  Returns:
    ``(logp [batch, n], parent [batch, n], token [batch, n])``, best first.
  """
  batch, k = alive_logp.shape
  # One [rows, vocab] array for the reductions below to read: left to
  # itself, XLA's CPU backend wrote the logits' bias add out again for each
  # of them.
  logits = jax.lax.optimization_barrier(logits)
  # The pad ban on a short list: the n best other tokens are among the n + 1
  # best of all, so the row is ranked as it is and the pad id set to -inf
  # there (set in the row, it made XLA copy the whole [rows, vocab] logits,
  # see docs/benchmarks.md). Exact ties and -inf entries keep their order
  # too, as the pad id is the smallest id.
  values, tokens = topk.top_k(logits, n + 1)
  # The row maximum is the best of those n + 1 (taken as values[:, :1],
  # XLA's CPU backend sorted the whole row instead, see docs/benchmarks.md).
  lse = 0.0 if normalised else decode_steps.logsumexp(
      logits, jnp.max(values, axis=-1, keepdims=True))
  values = jnp.where(tokens == PAD, -jnp.inf, values)
  values, pick = jax.lax.top_k(values, n)
  tokens = jnp.take_along_axis(tokens, pick, axis=-1)
  logp = values - lse                                       # [batch * k, n]
  first = jnp.arange(n) == 0
  logp = jnp.where(forced, jnp.where(first, 0.0, -jnp.inf), logp)
  tokens = jnp.where(forced, jnp.where(first, EOS, PAD), tokens)
  candidates = (alive_logp[..., None] + logp.reshape(batch, k, n))
  best, index = jax.lax.top_k(candidates.reshape(batch, k * n), n)
  token = jnp.take_along_axis(tokens.reshape(batch, k * n), index, axis=1)
  return best, index // n, token


@dataclasses.dataclass(frozen=True)
class Generate:
  """Hugging Face ``generate``'s beam search rules (the module docstring)
  for :func:`xfmr_jax.beam_search.loop`.

  Attributes:
    alpha: ``generate``'s ``length_penalty``: scores are
      ``sum log p / len ** alpha``.
    force_eos: force EOS at the last position (``forced_eos_token_id``).
    no_repeat_ngram_size, repetition_penalty: ``generate``'s settings of
      those names (:mod:`xfmr_jax.repetition`; 0 and 1.0: off). As there,
      they act on each beam's log-probabilities, after the log-softmax.
  """
  alpha: float = 1.0
  force_eos: bool = True
  no_repeat_ngram_size: int = 0
  repetition_penalty: float = 1.0

  def init(self, batch, k, length):
    zeros = jnp.zeros((batch, k, length), jnp.int32)
    return dict(
        alive_seqs=zeros,
        alive_logp=jnp.tile(jnp.asarray([0.0] + [_OFF] * (k - 1)),
                            (batch, 1)),
        fin_seqs=zeros, fin_scores=jnp.full((batch, k), _OFF),
        fin_done=jnp.zeros((batch, k), bool),
        # generate's is_early_stop_heuristic_unsatisfied, per row
        open=jnp.ones((batch,), bool),
        all_ended=jnp.zeros((), bool))

  def update(self, beams, logits, t, length):
    if 'prefix' in beams:
      raise target_prefix.PrefixError(target_prefix.NOT_UNDER_HF)
    if 'constraints' in beams:
      raise constraint_lib.ConstraintError(constraint_lib.NOT_UNDER_HF)
    alpha = self.alpha
    batch, k = beams['alive_logp'].shape
    repeat = self.no_repeat_ngram_size or self.repetition_penalty != 1.0
    if repeat:
      logits = repetition.process(
          logits - decode_steps.logsumexp(logits),
          beams['alive_seqs'].reshape(batch * k, length), t,
          no_repeat_ngram_size=self.no_repeat_ngram_size,
          repetition_penalty=self.repetition_penalty)
    top_logp, parent, token = _best_extensions(
        logits, beams['alive_logp'], 2 * k,
        self.force_eos & (t == length - 1), normalised=repeat)  # [batch, 2k]
    seqs = jnp.take_along_axis(beams['alive_seqs'], parent[..., None], axis=1)
    seqs = seqs.at[:, :, t].set(token)
    ended = (token == EOS) | (t + 1 >= length)
    # The k best unended extensions stay alive (ended ones only as fillers).
    running = top_logp + jnp.where(ended, _OFF, 0.0)
    alive_logp, alive = jax.lax.top_k(running, k)
    alive_seqs = jnp.take_along_axis(seqs, alive[..., None], axis=1)
    parent = jnp.take_along_axis(parent, alive, axis=1)
    # Finished: ended among the first k ranks, while the row is still open.
    new_done = ended & (jnp.arange(2 * k) < k)[None, :]
    scores = top_logp / (t + 1.0) ** alpha
    scores = scores + jnp.where(new_done & beams['open'][:, None], 0.0, _OFF)
    fin_scores, fin_seqs, fin_done = _finish_scores(
        beams['fin_scores'], beams['fin_seqs'], beams['fin_done'], scores,
        seqs, new_done)
    # generate's early_stopping=False heuristic at the new length t + 1.
    best_alive = alive_logp[:, :1] / (t + 1.0) ** alpha
    worst = jnp.where(fin_done, jnp.min(fin_scores, axis=1, keepdims=True),
                      _OFF)
    still_open = beams['open'] & jnp.any(best_alive > worst, axis=1)
    return dict(alive_seqs=alive_seqs, alive_logp=alive_logp,
                fin_seqs=fin_seqs, fin_scores=fin_scores, fin_done=fin_done,
                open=still_open, all_ended=jnp.all(ended)), parent

  def done(self, beams, t, length):
    """A row is done once the heuristic closed it; all rows once every
    extension of the last step ended (the forced EOS)."""
    del t, length
    return ~beams['open'] | beams['all_ended']

  def finalize(self, beams, length, n):
    """The ``n`` best finished hypotheses (every sentence has ``k`` once
    done), scored ``log p / len ** alpha``."""
    del length
    seqs, scores = beams['fin_seqs'][:, :n], beams['fin_scores'][:, :n]
    real = scores > _OFF / 2
    log_probs = scores * beam_lib.output_lengths(seqs) ** self.alpha
    return (seqs, jnp.where(real, scores, beam_lib.NEG_INF),
            jnp.where(real, log_probs, beam_lib.NEG_INF))


@functools.partial(jax.jit, static_argnames=(
    'model', 'beam_size', 'alpha', 'max_decode_len', 'force_eos', 'compact',
    'num_hypotheses', 'no_repeat_ngram_size', 'repetition_penalty'))
def beam_search(model, params, inputs, *, beam_size=4, alpha=1.0,
                max_decode_len=None, force_eos=True, compact=True,
                num_hypotheses=None, prefix=None, no_repeat_ngram_size=0,
                repetition_penalty=1.0):
  """``generate(num_beams=beam_size, length_penalty=alpha)`` in JAX:
  :func:`xfmr_jax.beam_search.loop` under :class:`Generate`.

  Args:
    model, params, inputs: as in :func:`xfmr_jax.decode.beam_search`
      (``inputs`` ``[batch, s]`` 0-padded int32).
    beam_size, alpha: static; ``alpha`` is ``generate``'s ``length_penalty``.
    max_decode_len: static; default ``s + 50`` capped by ``config.max_len``.
    force_eos: static; force EOS at the last position (``forced_eos_token_id``).
    compact: static; as in :func:`xfmr_jax.beam_search.search`.
    prefix: must be None: target prefixes are GNMT's (a ValueError here).
    no_repeat_ngram_size, repetition_penalty: static; as ``generate``'s
      (:class:`Generate`).

  Returns:
    ``(tokens [batch, max_decode_len] int32, scores [batch] float32)``: the
    best finished hypothesis and its ``sum log p / len ** alpha``; with
    ``num_hypotheses=n``, the n best with their plain ``log p`` too, as
    :func:`xfmr_jax.beam_search.search` gives them.
  """
  decode.TRACE_COUNTS['hf_beam_search'] += 1
  rules = Generate(alpha, force_eos, no_repeat_ngram_size,
                   float(repetition_penalty))
  return beam_lib.loop(model, params, inputs, rules,
                       beam_size=beam_size, max_decode_len=max_decode_len,
                       compact=compact, num_hypotheses=num_hypotheses,
                       prefix=prefix)
