"""Anti-repetition for decoding: no repeated n-grams, a repetition penalty.

Both act on one step's logits given the tokens each row emitted so far, inside
the jitted loops of greedy decoding, sampling and GNMT's beam search
(:mod:`xfmr_jax.decode`, :mod:`xfmr_jax.beam_search`):

* ``no_repeat_ngram_size = n`` forbids a token that would complete an n-gram
  the row already holds (the loops of ``ki ki ki`` that an undertrained model
  falls into);
* ``repetition_penalty = p`` (Keskar et al., 2019) makes every token the row
  already emitted less likely: its logit is divided by ``p`` where positive,
  multiplied by it where negative.

``seqs [rows, length]`` holds each row's tokens at positions ``< t`` (what
comes after is not read), ``t`` being the position being decoded.
"""
from __future__ import annotations

import jax.numpy as jnp


def repeated_ngram_tokens(seqs, t, n: int, vocab: int):
  """Bool ``[rows, vocab]``: the tokens that, emitted at ``t``, would repeat
  an n-gram of ``seqs[:, :t]``."""
  rows, length = seqs.shape
  starts = jnp.arange(length)
  at = lambda positions: jnp.take(seqs, jnp.clip(positions, 0, length - 1),
                                  axis=1)
  # The n-gram starting at i is earlier in the row (it ends before t) and
  # its first n - 1 tokens are the last n - 1 emitted.
  match = jnp.broadcast_to(starts + n - 1 < t, (rows, length))
  for j in range(n - 1):
    last = at(jnp.full((1,), t - (n - 1) + j))              # [rows, 1]
    match = match & (at(starts + j) == last)
  follower = at(starts + n - 1)                             # [rows, length]
  return jnp.zeros((rows, vocab), bool).at[
      jnp.arange(rows)[:, None], follower].max(match)


def emitted_tokens(seqs, t, vocab: int):
  """Bool ``[rows, vocab]``: the tokens of ``seqs[:, :t]``."""
  rows, length = seqs.shape
  return jnp.zeros((rows, vocab), bool).at[
      jnp.arange(rows)[:, None], seqs].max(jnp.arange(length) < t)


def process(logits, seqs, t, *, no_repeat_ngram_size: int = 0,
            repetition_penalty: float = 1.0):
  """``logits [rows, vocab]`` with the repetition rules applied (unchanged,
  and no extra work, at the defaults 0 and 1.0)."""
  vocab = logits.shape[-1]
  if repetition_penalty != 1.0:
    seen = emitted_tokens(seqs, t, vocab)
    penalised = jnp.where(logits > 0, logits / repetition_penalty,
                          logits * repetition_penalty)
    logits = jnp.where(seen, penalised, logits)
  if no_repeat_ngram_size:
    banned = repeated_ngram_tokens(seqs, t, no_repeat_ngram_size, vocab)
    logits = jnp.where(banned, -jnp.inf, logits)
  return logits


def loops(words, max_phrase: int = 3) -> bool:
  """Whether a phrase of one to ``max_phrase`` words comes three times in a
  row (``ki ki ki``, ``a b a b a b``): how an output stuck in a loop looks."""
  w = list(words)
  return any(w[i:i + p] == w[i + p:i + 2 * p] == w[i + 2 * p:i + 3 * p]
             for p in range(1, max_phrase + 1)
             for i in range(len(w) - 3 * p + 1))


def check(no_repeat_ngram_size, repetition_penalty) -> None:
  """A ValueError for settings out of range."""
  if type(no_repeat_ngram_size) is not int or no_repeat_ngram_size < 0:
    raise ValueError('no_repeat_ngram_size must be an int >= 0 (0: off), got '
                     f'{no_repeat_ngram_size!r}')
  if not repetition_penalty > 0:
    raise ValueError('repetition_penalty must be > 0 (1: off), got '
                     f'{repetition_penalty!r}')
