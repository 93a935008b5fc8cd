"""The beam search loop, once, and GNMT's rules for it (paper section 6.1).

:func:`loop` is the one beam search every rule set runs: the encoder (and the
cross-attention keys/values) run once per sentence, the cache is laid out for
``k`` beams per sentence (:func:`xfmr_jax.beam_cache.expand`), and a
``lax.while_loop`` runs one cached decoder step for all ``batch * k`` beam
rows, asks the rules for the new beams and the parent of each, and has each
beam's cache follow its parent (:func:`xfmr_jax.beam_cache.reorder`). It
stops when ``t`` reaches the output length or the rules say every sentence is
done, and the rules' ``finalize`` gives the result. As sentences finish, the
loop moves the live ones into a smaller batch (:func:`segment_sizes`), so a
finished sentence stops costing decoder steps while others go on.

How hypotheses are scored, kept, stopped and chosen is the rules' business, a
small hashable object (so a static jit argument) with the :class:`Rules`
methods:

* :class:`GNMT` (here): the paper's, with the length penalty
  ``((5 + len) / 6) ** alpha`` (:func:`xfmr_jax.decode.beam_search`);
* :class:`xfmr_jax.hf_beam.Generate`: Hugging Face ``generate``'s
  (:func:`xfmr_jax.hf_beam.beam_search`).

An n-best list is the rules' ``finalize`` asked for ``n`` hypotheses:
both rule sets keep the ``k`` best finished ones, best first
(``num_hypotheses``). Further decoding features fit the same loop: a logits
processor (no repeated n-grams, a repetition penalty, constrained decoding)
acts on the logits in the rules' ``update``, which sees every beam's tokens in
``beams['alive_seqs']``. Per-sentence inputs of the search, which the static
rules cannot hold, travel in the beams: a target prefix
(:mod:`xfmr_jax.target_prefix`) is ``beams['prefix']``, and GNMT's ``update``
leaves each beam only the prefix's token while ``t`` is inside it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from xfmr_jax import beam_cache
from xfmr_jax import constraints as constraint_lib
from xfmr_jax import decode_steps as steps
from xfmr_jax import repetition, target_prefix
from xfmr_jax import top_k as topk
from xfmr_jax.token_ids import EOS, PAD

NEG_INF = -1.0e7  # finite "impossible" score: keeps beam arithmetic NaN-free

Beams = dict[str, Any]  # a pytree of arrays with at least 'alive_seqs'


class Rules(Protocol):
  """What :func:`loop` asks of a beam search's rules.

  ``beams`` is the rules' own pytree of arrays, carried through the loop; it
  must hold ``alive_seqs`` ``[batch, k, length]`` int32, the tokens of the
  ``k`` alive beams of each sentence (the loop feeds the token at ``t - 1``
  of every beam to the decoder at step ``t``). Every leaf is ``[batch, ...]``
  or a scalar: the loop drops the rows of sentences that are done, so a
  sentence ``done`` reports must keep its result through further updates.
  """

  def init(self, batch: int, k: int, length: int) -> Beams:
    """The beams before the first step (one real start per sentence).
    :func:`loop` adds ``prefix`` ``[batch, p]`` to them when given one;
    rules that cannot follow a prefix raise if they find it."""

  def update(self, beams: Beams, logits: jax.Array, t: jax.Array,
             length: int) -> tuple[Beams, jax.Array]:
    """Extend the beams by the token at position ``t``.

    Args:
      logits: ``[batch * k, vocab]`` raw logits of step ``t``, the beams of
        a sentence on consecutive rows (sentence-major).

    Returns:
      the new beams and ``parent [batch, k]`` int32: which alive beam of
      the same sentence each new alive beam extends (its cache follows).
    """

  def done(self, beams: Beams, t: jax.Array, length: int) -> jax.Array:
    """Bool ``[batch]`` (or a scalar): which sentences need no more steps.
    Called before each step, ``t`` being the next step's position."""

  def finalize(self, beams: Beams, length: int,
               n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ``n`` best hypotheses of each sentence, best first: ``(tokens
    [batch, n, length] int32, scores [batch, n] float32, log_probs [batch, n]
    float32)``, the score the rules rank by and the hypothesis' plain
    ``log p``; a slot with no hypothesis scores ``<= NEG_INF / 2``."""


def segment_sizes(batch: int) -> list[int]:
  """How many sentences each stretch of the search decodes: the whole batch,
  then, once at most half of them are live, half as many, down to an eighth
  and to no fewer than 8 (``[batch]`` alone below 16 sentences). Each size is
  one more loop body to compile; past an eighth, or below 8 sentences, where
  a step costs about the same whatever its rows, the stragglers cost little
  enough."""
  sizes = [batch]
  while len(sizes) < 4 and sizes[-1] >= 16:
    sizes.append(-(-sizes[-1] // 2))
  return sizes


def loop(model, params, inputs, rules: Rules, *, beam_size: int,
         max_decode_len=None, compact: bool = True, num_hypotheses=None,
         prefix=None, constraints=None, word_starts=None):
  """Beam search under ``rules``, traceable (jit it, or call it inside a
  jitted function). Arguments as in :func:`search`."""
  variables = steps.as_variables(params)
  inputs = steps.split_rows(inputs)
  length = steps.decode_length(model.config, inputs.shape[1], max_decode_len)
  batch, k = inputs.shape[0], beam_size
  # The encoder and the cross-attention K/V run once per sentence, and stay
  # so; the self-attention cache gets one row per beam (see beam_cache).
  cache = beam_cache.expand(model, steps.init_cache(model, variables, inputs,
                                                    length), k)
  beams = rules.init(batch, k, length)
  if prefix is not None:
    beams = dict(beams, prefix=steps.split_rows(prefix))
  if constraints is not None:
    beams = dict(beams, **constraint_lib.init(steps.split_rows(constraints),
                                              k, word_starts))
  final = beams      # every sentence's beams, written back as it leaves
  where = jnp.arange(batch)  # the sentence each decoded row belongs to
  t = jnp.zeros((), jnp.int32)
  # A batch left symbolic (jax.export) has no sizes to halve: one segment.
  compact = compact and isinstance(batch, int)
  sizes = segment_sizes(batch) if compact else [batch]
  for n, smaller in zip(sizes, sizes[1:] + [0]):
    beam_inputs = jnp.repeat(inputs, k, axis=0)

    def done(beams, t, n=n):
      return jnp.broadcast_to(rules.done(beams, t, length), (n,))

    def cond(state, smaller=smaller, done=done):
      t, beams, _ = state
      return (t < length) & (jnp.sum(~done(beams, t)) > smaller)

    def body(state, n=n, beam_inputs=beam_inputs):
      t, beams, cache = state
      logits, cache = steps.step(model, variables, cache, beam_inputs,
                                 beams['alive_seqs'].reshape(n * k, length),
                                 t, length)
      beams, parent = rules.update(beams, logits, t, length)
      rows = (jnp.arange(n)[:, None] * k + parent).reshape(-1)
      return t + 1, beams, beam_cache.reorder(model, cache, rows)

    t, beams, cache = jax.lax.while_loop(cond, body, (t, beams, cache))
    final = _write_back(final, beams, where)
    if smaller:
      # The live sentences first (then done ones, as filler): a done
      # sentence's result no longer changes (Rules.done), so dropping it
      # leaves every other sentence's tokens as they were.
      keep = jnp.argsort(done(beams, t), stable=True)[:smaller]
      beams = jax.tree.map(lambda x: x[keep] if x.ndim else x, beams)
      cache = beam_cache.select(model, cache, keep, k)
      inputs, where = inputs[keep], where[keep]
  if num_hypotheses is not None and not 1 <= num_hypotheses <= k:
    raise ValueError(f'num_hypotheses must be between 1 and the beam size '
                     f'{k}, got {num_hypotheses}')
  tokens, scores, log_probs = map(steps.replicated, rules.finalize(
      final, length, num_hypotheses or 1))
  if num_hypotheses is None:
    return tokens[:, 0], scores[:, 0]
  return tokens, scores, log_probs


def output_lengths(tokens: jax.Array) -> jax.Array:
  """``[..., length]`` decoded ids -> ``[...]`` int32: the tokens emitted,
  the EOS included (the pad id is never emitted, and fills the rest)."""
  return jnp.sum(tokens != PAD, axis=-1)


def _write_back(final, beams, where):
  """``final`` with the rows of ``beams`` put back at sentences ``where``
  (scalar leaves, such as a flag for the whole batch, taken as they are)."""
  return jax.tree.map(lambda f, x: f.at[where].set(x) if x.ndim else x,
                      final, beams)


@functools.partial(jax.jit, static_argnames=(
    'model', 'rules', 'beam_size', 'max_decode_len', 'compact',
    'num_hypotheses'))
def search(model, params, inputs, rules: Rules, *, beam_size=4,
           max_decode_len=None, compact=True, num_hypotheses=None,
           prefix=None, constraints=None, word_starts=None):
  """Beam search under any rules, one ``jax.jit``.

  Args:
    model: a :class:`~xfmr_jax.model.SequenceModel` (static).
    params: its params (or ``{'params': ...}``).
    inputs: ``[batch, s]`` int32 source ids, 0-padded.
    rules: static; e.g. :class:`GNMT` or :class:`xfmr_jax.hf_beam.Generate`.
    beam_size: static, the ``k`` beams per sentence.
    max_decode_len: static; default ``s + 50`` capped by ``config.max_len``.
    compact: static; drop the sentences that are done from the decoded rows
      as the batch thins out (:func:`segment_sizes`), so a finished sentence
      stops costing decoder steps. The tokens are the same either way.
    num_hypotheses: static; None for the best hypothesis alone, or ``n``
      (``1 <= n <= beam_size``) for the n best.
    prefix: None, or ``[batch, p]`` int32 target prefixes, 0-padded
      (:mod:`xfmr_jax.target_prefix`; GNMT's rules follow them).
    constraints: None, or ``[batch, C]`` int32 terminology constraints
      (:func:`xfmr_jax.constraints.pack`; GNMT's rules follow them).
    word_starts: None, or ``[vocab]`` bool, which tokens begin a word: a
      constraint's last word is then not continued into a longer one.

  Returns:
    the best hypothesis, ``(tokens [batch, max_decode_len] int32, scores
    [batch] float32)``; with ``num_hypotheses=n``, the n best as
    ``rules.finalize`` gives them: ``(tokens [batch, n, max_decode_len],
    scores [batch, n], log_probs [batch, n])``.
  """
  return loop(model, params, inputs, rules, beam_size=beam_size,
              max_decode_len=max_decode_len, compact=compact,
              num_hypotheses=num_hypotheses, prefix=prefix,
              constraints=constraints, word_starts=word_starts)


# --------------------------------------------------------------- GNMT rules --

def length_penalty(length, alpha):
  """GNMT length penalty ``((5 + length) / 6) ** alpha`` (Wu et al., 2016)."""
  return ((5.0 + length) / 6.0) ** alpha


def _gnmt_update(beams, log_probs, t, alpha):
  """Extend every alive beam by one token at position t.

  The new beam is the ``k`` best extensions by log-probability; those ending in
  EOS move to the finished set (scored ``logp / length_penalty(t + 1)``, merged
  keeping the k best), the others stay alive. With k = 1 this is greedy.

  Args:
    beams: dict of ``alive_seqs``, ``fin_seqs`` ``[batch, k, length]``,
      ``alive_logp``, ``fin_scores`` ``[batch, k]``.
    log_probs: ``[batch, k, vocab]`` next-token log-probabilities.

  Returns:
    the new beams and ``parent [batch, k]``.
  """
  batch, k, vocab = log_probs.shape
  candidates = (beams['alive_logp'][..., None] + log_probs).reshape(batch, -1)
  logp, index = topk.top_k(candidates, k)
  return _extend(beams, logp, index // vocab, index % vocab, t, alpha)


def _constrained_update(beams, log_probs, t, alpha):
  """:func:`_gnmt_update` under terminology constraints
  (:mod:`xfmr_jax.constraints`): a beam that has met its constraints may
  end, joining the finished hypotheses; the ``k`` new alive beams are chosen
  by dynamic beam allocation. Rows without constraints get
  :func:`_gnmt_update`'s beams, so that a sentence's output does not depend
  on the others in its batch."""
  k = log_probs.shape[1]
  tokens = beams['constraints']
  cand = constraint_lib.candidates(beams['alive_logp'], log_probs, tokens,
                                   beams['met'], beams['cursor'], k,
                                   beams.get('word_starts'))
  pick = constraint_lib.allocate(cand['logp'], cand['bank'],
                                 cand['logp'] > NEG_INF / 2, k)
  take = lambda x: jnp.take_along_axis(
      x, pick.reshape(pick.shape + (1,) * (x.ndim - 2)), axis=1)
  ended = _extend(beams, cand['eos_logp'],
                  jnp.broadcast_to(jnp.arange(k), pick.shape),
                  jnp.full(pick.shape, EOS), t, alpha)[0]
  new, parent = _extend(dict(beams, fin_seqs=ended['fin_seqs'],
                             fin_scores=ended['fin_scores']),
                        take(cand['logp']), take(cand['parent']),
                        take(cand['token']), t, alpha)
  plain, plain_parent = _gnmt_update(beams, log_probs, t, alpha)
  free = jnp.all(tokens == PAD, axis=1)
  pick_row = lambda a, b: jnp.where(
      free.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
  new = jax.tree.map(pick_row, plain, new)
  kept = {key: beams[key] for key in ('constraints', 'word_starts')
          if key in beams}
  return dict(new, **kept, met=take(cand['met']),
              cursor=take(cand['cursor'])), pick_row(plain_parent, parent)


def _extend(beams, logp, parent, token, t, alpha):
  """The beams after the chosen extensions ``[batch, k]`` (``logp`` their
  log p, ``parent`` the beam each extends, ``token`` the token at ``t``):
  those ending in EOS join the finished ones."""
  seqs = jnp.take_along_axis(beams['alive_seqs'], parent[..., None], axis=1)
  seqs = seqs.at[:, :, t].set(token)
  # Extensions of NEG_INF placeholders (or of a forbidden token) are not real.
  real = logp > NEG_INF / 2
  ended = token == EOS
  new_scores = jnp.where(real & ended, logp / length_penalty(t + 1, alpha),
                         NEG_INF)
  fin_scores, pick = jax.lax.top_k(
      jnp.concatenate([beams['fin_scores'], new_scores], axis=1),
      logp.shape[1])
  fin_seqs = jnp.take_along_axis(
      jnp.concatenate([beams['fin_seqs'], seqs], axis=1), pick[..., None],
      axis=1)
  return dict(alive_seqs=seqs,
              alive_logp=jnp.where(real & ~ended, logp, NEG_INF),
              fin_seqs=fin_seqs, fin_scores=fin_scores), parent


@dataclasses.dataclass(frozen=True)
class GNMT:
  """GNMT's beam search rules (Wu et al., 2016; the paper: beam 4, alpha 0.6).

  Each step keeps the ``k`` best extensions of the alive beams by log p
  (the pad id banned before the log-softmax); those ending in EOS move to the
  ``k`` best finished hypotheses, scored ``log p / length_penalty(len)``
  (len counts the EOS), the others stay alive. A sentence is done when no
  alive beam is left or none can beat its worst finished hypothesis. The
  result is the best finished hypothesis; a sentence with none falls back to
  its best unfinished one, scored at the full length. With k = 1 this is
  greedy decoding.

  Attributes:
    alpha: the length penalty's exponent, >= 0 (0: plain log p).
    no_repeat_ngram_size, repetition_penalty: anti-repetition on each beam's
      logits before the log-softmax (:mod:`xfmr_jax.repetition`; 0 and 1.0:
      off).
  """
  alpha: float = 0.6
  no_repeat_ngram_size: int = 0
  repetition_penalty: float = 1.0

  def init(self, batch, k, length):
    # Beam 0 is the real start; the others are placeholders that never win.
    return dict(
        alive_seqs=jnp.zeros((batch, k, length), jnp.int32),
        alive_logp=jnp.tile(jnp.asarray([0.0] + [NEG_INF] * (k - 1)),
                            (batch, 1)),
        fin_seqs=jnp.zeros((batch, k, length), jnp.int32),
        fin_scores=jnp.full((batch, k), NEG_INF))

  def update(self, beams, logits, t, length):
    batch, k = beams['alive_logp'].shape
    raw_logits = logits
    logits = repetition.process(
        steps.no_pad(logits), beams['alive_seqs'].reshape(batch * k, length),
        t, no_repeat_ngram_size=self.no_repeat_ngram_size,
        repetition_penalty=self.repetition_penalty)
    log_probs = (logits - steps.logsumexp(logits)).reshape(batch, k, -1)
    if 'prefix' in beams:
      raw = None
      if self.no_repeat_ngram_size or self.repetition_penalty != 1.0:
        raw = steps.no_pad(raw_logits)
        raw = (raw - steps.logsumexp(raw)).reshape(batch, k, -1)
      log_probs = target_prefix.force(log_probs, beams['prefix'], t, raw)
    update = (_constrained_update if 'constraints' in beams
              else _gnmt_update)
    new, parent = update(beams, log_probs, t, self.alpha)
    if 'prefix' in beams:
      new['prefix'] = beams['prefix']
    return new, parent

  def done(self, beams, t, length):
    """No alive beam left, or none can beat the worst finished.

    Log-probabilities only fall and (alpha >= 0) the penalty only grows, so
    an alive beam's best reachable score is ``logp / length_penalty(length)``.
    """
    del t
    best_alive = jnp.max(beams['alive_logp'], axis=1)
    worst_finished = jnp.min(beams['fin_scores'], axis=1)  # NEG_INF until k
    return ((best_alive <= NEG_INF / 2) |
            (worst_finished > best_alive / length_penalty(length, self.alpha)))

  def finalize(self, beams, length, n):
    """The finished hypotheses, best first; where fewer than ``n`` finished,
    the best unfinished ones follow, scored at the full length."""
    penalty = length_penalty(length, self.alpha)
    seqs = jnp.concatenate([beams['fin_seqs'], beams['alive_seqs']], axis=1)
    scores = jnp.concatenate([beams['fin_scores'],
                              beams['alive_logp'] / penalty], axis=1)
    real = jnp.concatenate([beams['fin_scores'], beams['alive_logp']],
                           axis=1) > NEG_INF / 2
    finished = jnp.arange(seqs.shape[1]) < beams['fin_scores'].shape[1]
    # Finished before unfinished before empty slots, each best first (ties
    # to the lower slot); under constraints, unfinished ones that hold them
    # before those that do not.
    unfinished, empty = 1, 2
    if 'constraints' in beams:
      held = constraint_lib.all_met(beams['constraints'], beams['met'])
      # (The finished slots' half is not read.)
      unfinished = jnp.where(jnp.concatenate([held, held], axis=1), 1, 2)
      empty = 3
    group = jnp.where(real, jnp.where(finished, 0, unfinished), empty)
    pick = jnp.lexsort((-scores, group), axis=-1)[:, :n]
    seqs = jnp.take_along_axis(seqs, pick[..., None], axis=1)
    scores = jnp.take_along_axis(scores, pick, axis=1)
    real = jnp.take_along_axis(real, pick, axis=1)
    log_probs = scores * length_penalty(output_lengths(seqs), self.alpha)
    return (seqs, jnp.where(real, scores, NEG_INF),
            jnp.where(real, log_probs, NEG_INF))


class Hypothesis(NamedTuple):
  """One translation of an n-best list
  (:meth:`xfmr_jax.translate.Translator.nbest`).

  Attributes:
    text: the translation.
    score: what the search ranks by, ``log p`` normalised for length (GNMT:
      ``log p / ((5 + len) / 6) ** alpha``; 'hf': ``log p / len ** alpha``;
      ``len`` counts the EOS).
    log_prob: the ``log p`` of its tokens and EOS under the model (of its
      tokens alone for a hypothesis cut at the output limit), as the search
      sums it: GNMT's rules renormalise without the pad id, which they never
      emit; 'hf' bans it after the log-softmax, as ``generate`` does.
  """
  text: str
  score: float
  log_prob: float
