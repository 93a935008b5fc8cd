"""Terminology constraints: target phrases a translation must contain.

Lexically constrained decoding by dynamic beam allocation (Post and Vilar,
2018), inside GNMT's beam search (:mod:`xfmr_jax.beam_search`). A sentence's
constraints are ``[C]`` int32 target ids: its phrases one after another, a 0
(the pad id) after each, 0s to the end (``pack``). Each beam tracks which
constraint tokens it has met and, while it is inside a phrase, the position
of the phrase's next token (``cursor``; :data:`NONE` outside one,
:data:`ENDED` right after one). One step:

1. Candidates: each beam's best ``k`` next tokens, and each token that would
   advance a constraint (the in-progress phrase's next token, the first token
   of every phrase not yet met), deduplicated. A beam that has met every
   constraint may also end: its EOS extension joins the finished hypotheses
   without taking an alive beam's place; EOS is banned while a beam has
   constraints left, so every finished hypothesis holds all of them. Given
   the tokenizer's word starts, the token after a phrase must begin a word.
2. Banks: a candidate's bank is the number of constraint tokens it has met.
   Leaving a phrase half way gives its met tokens back (they must come in a
   row).
3. Allocation: the ``k`` new beams are taken round robin over the banks, the
   best of each bank first, from the bank that has met the most down, then
   the second best of each, and so on. So every bank with candidates gets
   about ``k / (C + 1)`` beams, and the share of an empty bank goes to the
   others: Post and Vilar's allocation with their redistribution.

The finished hypotheses are ranked as in the plain search. The ``beam_size``
should exceed the number of constraint tokens, so that each bank can hold a
beam. Where two phrases not yet met start with the same token, the first
takes it; a phrase that repeats its own beginning (``a a b``) is found only
where no false start precedes it (``a a a b`` restarts at the third ``a``
and misses it), so the search places it again elsewhere.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from xfmr_jax import top_k as topk
from xfmr_jax.token_ids import EOS, PAD, UNK

NONE = -1  # cursor outside every phrase
ENDED = -2  # cursor outside every phrase, one having ended at the last token

NOT_UNDER_HF = ("terminology constraints work with beam_rules 'gnmt', not "
                "under generate's rules ('hf', an imported Marian model's "
                "default): choose beam_rules='gnmt' (--beam_rules=gnmt)")


class ConstraintError(ValueError):
  """Constraints the search cannot follow (see :func:`check`)."""


def check(constraints: Sequence[Sequence[Sequence[int]] | None],
          limit: int) -> None:
  """Host-side checks of each sentence's phrases (id lists; None: none).

  Raises:
    ConstraintError: an empty phrase, one holding the pad id, EOS or the
      unknown id, or phrases whose tokens leave no room for EOS within
      ``limit`` output positions.
  """
  for i, phrases in enumerate(constraints):
    for j, ids in enumerate(phrases or ()):
      if not ids:
        raise ConstraintError(f'constraint {j} of sentence {i} is empty')
      if UNK in ids:
        raise ConstraintError(f'constraint {j} of sentence {i} has a token the '
                              'vocabulary lacks (it maps to the unknown id), '
                              'which no output can hold')
      if PAD in ids or EOS in ids:
        raise ConstraintError(f'constraint {j} of sentence {i} holds the pad '
                              'or EOS id')
    total = sum(len(ids) for ids in phrases or ())
    if total >= limit:
      raise ConstraintError(f'the constraints of sentence {i} have {total} '
                            f'tokens; outputs hold at most {limit} tokens, '
                            f'EOS included')


def encode(tokenizer, constraints, encoded, limit: int) -> list:
  """Each text's phrases as target id lists (``None``: none), checked.

  Args:
    tokenizer: has ``encode_target``.
    constraints: per text, a list of phrase strings (None or []: none), or
      None for no constraints at all.
    encoded: the texts' source ids (``None``: a blank text).
    limit: the model's ``max_len``.
  """
  if constraints is None:
    return [None] * len(encoded)
  if len(constraints) != len(encoded):
    raise ConstraintError(f'{len(encoded)} texts but {len(constraints)} '
                          'constraint lists')
  ids = []
  for i, phrases in enumerate(constraints):
    if phrases and encoded[i] is None:
      raise ConstraintError(f'text {i} is empty but has constraints')
    ids.append([tokenizer.encode_target(p) if p.strip() else []
                for p in phrases] if phrases else None)
  check(ids, limit)
  return ids


def word_starts(tokenizer, vocab_size: int) -> np.ndarray:
  """``[vocab_size]`` bool: the ids whose SentencePiece piece begins a word
  ('\u2581' first; none of the special ids, nor ids past the tokenizer's)."""
  out = np.zeros(vocab_size, bool)
  for i in range(UNK + 1, vocab_size):
    try:
      out[i] = tokenizer.id_to_piece(i).startswith('\u2581')
    except IndexError:
      break
  return out


def pack(constraints, rows: int, width: int | None = None) -> np.ndarray:
  """Phrases per sentence (id lists; None: none) -> ``[rows, width]`` int32:
  each sentence's phrases in a row, a 0 after each (``width`` default: the
  longest sentence's)."""
  flat = [[t for ids in phrases or () for t in [*ids, PAD]]
          for phrases in constraints]
  width = width or packed_width(constraints)
  out = np.zeros((rows, width), np.int32)
  for r, ids in enumerate(flat):
    out[r, :len(ids)] = ids
  return out


def packed_width(constraints) -> int:
  """The width :func:`pack` gives a batch's constraints by default."""
  return max([1] + [sum(len(ids) + 1 for ids in phrases or ())
                    for phrases in constraints])


def init(tokens: jax.Array, k: int, word_starts=None) -> dict:
  """The beams' constraint state before the first step: ``constraints``
  ``[batch, C]``, nothing met (``met`` ``[batch, k, C]``), no phrase begun
  (``cursor`` ``[batch, k]``); with ``word_starts`` (``[vocab]`` bool: the
  token begins a word), ``word_starts`` ``[batch, vocab]``."""
  batch, c = tokens.shape
  state = dict(constraints=tokens, met=jnp.zeros((batch, k, c), bool),
               cursor=jnp.full((batch, k), NONE, jnp.int32))
  if word_starts is not None:
    state['word_starts'] = jnp.broadcast_to(
        jnp.asarray(word_starts, bool), (batch, len(word_starts)))
  return state


def _layout(tokens):
  """``[batch, C]`` -> (``[batch, 1, C]``: starts a phrase, the phrase's
  index, has a next token in its phrase)."""
  real = tokens != PAD
  before = jnp.pad(tokens[:, :-1], ((0, 0), (1, 0)))
  starts = real & (before == PAD)
  phrase = jnp.cumsum(starts, axis=1)
  after = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
  return starts[:, None], phrase[:, None], (real & (after != PAD))[:, None]


def _cursor_token(tokens, cursor):
  """The token each cursor waits for (PAD outside a phrase): ``[batch, m]``."""
  at = jnp.take_along_axis(tokens, jnp.maximum(cursor, 0), axis=1)
  return jnp.where(cursor < 0, PAD, at)


def advance(tokens, met, cursor, token):
  """The constraint state after each beam emits ``token``.

  Args:
    tokens: ``[batch, C]``; met: ``[batch, m, C]``; cursor, token:
      ``[batch, m]``.

  Returns:
    ``(met [batch, m, C], cursor [batch, m])``; the cursor is
    :data:`ENDED` where ``token`` ended a phrase.
  """
  starts, phrase, has_next = _layout(tokens)
  positions = jnp.arange(tokens.shape[1])
  inside = cursor >= 0
  follows = inside & (token == _cursor_token(tokens, cursor))
  # Leaving a phrase half way gives back the tokens it had met.
  current = jnp.take_along_axis(phrase[:, 0], jnp.maximum(cursor, 0), axis=1)
  left = inside & ~follows
  met = met & ~(left[..., None] & (phrase == current[..., None]))
  # Otherwise the token may begin a phrase not met yet: the first such.
  begins = (starts & ~met & (tokens[:, None] == token[..., None]) &
            ~follows[..., None])
  first = jnp.argmax(begins, axis=-1)
  began = jnp.any(begins, axis=-1)
  hit = jnp.where(follows, cursor, jnp.where(began, first, NONE))
  met = met | (positions == hit[..., None])
  next_of = jnp.take_along_axis(has_next[:, 0], jnp.maximum(hit, 0), axis=1)
  cursor = jnp.where(hit == NONE, NONE, jnp.where(next_of, hit + 1, ENDED))
  return met, cursor.astype(jnp.int32)


def met_count(tokens, met):
  """``[batch, m]`` int32: constraint tokens met (the bank)."""
  return jnp.sum(met & (tokens != PAD)[:, None], axis=-1)


def all_met(tokens, met):
  """``[batch, m]`` bool: every constraint token met."""
  return met_count(tokens, met) == jnp.sum(tokens != PAD, axis=-1)[:, None]


def wanted_tokens(tokens, met, cursor):
  """``(token [batch, k, C], valid [batch, k, C])``: per beam, the tokens
  that would advance a constraint: the cursor's, and the first token of
  each phrase not met (while outside a phrase, or leaving one)."""
  starts, _, _ = _layout(tokens)
  positions = jnp.arange(tokens.shape[1])
  valid = (positions == cursor[..., None]) | (starts & ~met)
  return jnp.broadcast_to(tokens[:, None], met.shape), valid


def candidates(alive_logp, log_probs, tokens, met, cursor, k: int,
               word_starts=None):
  """Every beam's extensions worth keeping, flattened per sentence.

  Args:
    alive_logp: ``[batch, m]``; log_probs: ``[batch, m, vocab]``; tokens:
      ``[batch, C]``; met: ``[batch, m, C]``; cursor: ``[batch, m]``.
    word_starts: None, or ``[batch, vocab]`` bool: after a phrase only a
      token that begins a word may come, so that the phrase's last word is
      not continued into a longer one.

  Returns:
    dict of ``[batch, n]`` arrays (``n = m * (min(k, vocab) + C)``):
    ``logp`` (``-inf`` for a slot with no candidate), ``parent``, ``token``,
    ``bank``, ``cursor``, and ``met`` ``[batch, n, C]``, the state after the
    token; and ``eos_logp`` ``[batch, m]``, each beam's log p when it ends
    now (``-inf`` while it has constraints left). The candidates do not end:
    a beam that ends leaves the alive ones.
  """
  batch, m, vocab = log_probs.shape
  eos_logp = alive_logp + jnp.where(all_met(tokens, met),
                                    log_probs[..., EOS], -jnp.inf)
  log_probs = jnp.where(jnp.arange(vocab) == EOS, -jnp.inf, log_probs)
  if word_starts is not None:
    glued = (cursor == ENDED)[..., None] & ~word_starts[:, None]
    log_probs = jnp.where(glued, -jnp.inf, log_probs)
  top_logp, top_token = topk.top_k(log_probs, min(k, vocab))
  want, valid = wanted_tokens(tokens, met, cursor)
  # Each token once per beam: not among its best, nor wanted twice.
  c = tokens.shape[1]
  earlier = jnp.tril(jnp.ones((c, c), bool), -1)
  twice = jnp.any((want[..., :, None] == want[..., None, :]) & earlier &
                  valid[..., None, :], axis=-1)
  among_best = jnp.any(want[..., None] == top_token[..., None, :], axis=-1)
  want_logp = jnp.where(valid & ~twice & ~among_best,
                        jnp.take_along_axis(log_probs, want, axis=-1),
                        -jnp.inf)
  token = jnp.concatenate([top_token, want], axis=-1).reshape(batch, -1)
  logp = (alive_logp[..., None] +
          jnp.concatenate([top_logp, want_logp], axis=-1)).reshape(batch, -1)
  per_beam = top_token.shape[-1] + c
  parent = jnp.repeat(jnp.arange(m, dtype=jnp.int32), per_beam)[None]
  parent = jnp.broadcast_to(parent, token.shape)
  new_met, new_cursor = advance(
      tokens, jnp.take_along_axis(met, parent[..., None], axis=1),
      jnp.take_along_axis(cursor, parent, axis=1), token)
  return dict(logp=logp, parent=parent, token=token, met=new_met,
              cursor=new_cursor, bank=met_count(tokens, new_met),
              eos_logp=eos_logp)


def allocate(logp, bank, real, k: int):
  """Dynamic beam allocation: ``k`` of ``n`` candidates per sentence.

  Args:
    logp, bank, real: ``[batch, n]`` candidates' log p, bank (constraint
      tokens met) and whether they are real.

  Returns:
    ``[batch, k]`` int32 candidate indices, best log p first: round robin
    over the banks (the bank that has met most first), each bank's
    candidates best first; real candidates before any other.
  """
  n = logp.shape[1]
  order = jnp.lexsort((-logp, ~real, bank), axis=-1)  # by bank, best first
  sorted_bank = jnp.take_along_axis(bank, order, axis=1)
  index = jnp.arange(n)
  new = jnp.concatenate([jnp.ones_like(sorted_bank[:, :1], bool),
                         sorted_bank[:, 1:] != sorted_bank[:, :-1]], axis=1)
  first = jax.lax.cummax(jnp.where(new, index, 0), axis=1)
  rank = jnp.zeros_like(order).at[
      jnp.arange(logp.shape[0])[:, None], order].set(index - first)
  pick = jnp.lexsort((-logp, -bank, rank, ~real), axis=-1)[:, :k]
  chosen = jnp.take_along_axis(logp, pick, axis=1)
  return jnp.take_along_axis(pick, jnp.argsort(-chosen, axis=1, stable=True),
                             axis=1)
