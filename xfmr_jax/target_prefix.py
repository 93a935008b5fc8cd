"""Target prefixes: decoding that continues given first tokens.

Interactive translation shows a translator's correction and asks the model to
go on from there. A prefix is ``[batch, p]`` int32 target ids per sentence,
0-padded on the right (a sentence's prefix is its ids before the first 0; an
all-0 row has none). At each position ``t`` inside a sentence's prefix the
decoders emit the prefix's token, whatever the model prefers:

* greedy decoding and sampling (:mod:`xfmr_jax.decode`) take it in place of
  their pick (:func:`forced`);
* GNMT's beam search (:mod:`xfmr_jax.beam_search`) leaves every beam one
  extension, the prefix token at its log-probability under the model
  (:func:`force`), so a hypothesis' ``log p`` is that of all its tokens, the
  prefix's included, and its score is ranked as any other.

The outputs hold the prefix, then the continuation. The prefix ids must not be
the pad id inside the prefix or EOS (the caller checks: :func:`check`).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from xfmr_jax.token_ids import EOS, PAD, UNK


NOT_UNDER_HF = ("target prefixes work with beam_rules 'gnmt' (and greedy or "
                "sampling), not under generate's rules ('hf', an imported "
                "Marian model's default): choose beam_rules='gnmt' "
                "(--beam_rules=gnmt)")


class PrefixError(ValueError):
  """A prefix the decoders cannot follow (see :func:`check`)."""


def forced(prefix, t):
  """``(mask [rows] bool, token [rows] int32)``: which rows are inside their
  prefix at position ``t``, and the prefix token there. ``prefix`` ``[rows,
  p]``."""
  p = prefix.shape[1]
  token = prefix[:, jnp.minimum(t, p - 1)]
  return (t < p) & (token != PAD), token


def force(log_probs, prefix, t, raw_log_probs=None):
  """Log-probabilities of one beam step with the prefix imposed.

  Args:
    log_probs: ``[batch, k, vocab]`` (after any logits processor).
    prefix: ``[batch, p]``.
    raw_log_probs: the same before the processors (default ``log_probs``):
      the prefix token keeps its probability under the model even where a
      processor (a banned repeated n-gram) would forbid it.

  Returns:
    ``[batch, k, vocab]``: in rows inside their prefix, the prefix token's
    log-probability and ``-inf`` elsewhere; other rows unchanged.
  """
  raw = log_probs if raw_log_probs is None else raw_log_probs
  inside, token = forced(prefix, t)
  is_token = jnp.arange(log_probs.shape[-1]) == token[:, None, None]
  imposed = jnp.where(is_token, raw, -jnp.inf)
  return jnp.where(inside[:, None, None], imposed, log_probs)


def check(prefixes, limit: int) -> None:
  """Host-side checks of prefixes as id lists (``None``: no prefix).

  Raises:
    PrefixError: a prefix holding the pad id, EOS or the unknown id, or one
      leaving no room for a token after it within ``limit`` output positions.
  """
  for i, ids in enumerate(prefixes):
    if ids is None:
      continue
    bad = [x for x in ids if x in (PAD, EOS)]
    if bad:
      raise PrefixError(f'prefix {i} holds the id {bad[0]} (pad or EOS), '
                       'which a prefix cannot force')
    if UNK in ids:
      raise PrefixError(f'prefix {i} has a token the vocabulary lacks (it '
                        'maps to the unknown id)')
    if len(ids) >= limit:
      raise PrefixError(f'prefix {i} has {len(ids)} tokens; outputs hold at '
                       f'most {limit} tokens, EOS included, so a prefix has '
                       f'at most {limit - 1}')


def encode(tokenizer, prefixes, encoded, limit: int) -> list:
  """Each text's prefix as target ids (``None``: none), checked.

  Args:
    tokenizer: has ``encode_target``.
    prefixes: per text, a prefix string (None or blank: none), or None for
      no prefixes at all.
    encoded: the texts' source ids (``None``: a blank text).
    limit: the model's ``max_len``.
  """
  if prefixes is None:
    return [None] * len(encoded)
  if len(prefixes) != len(encoded):
    raise PrefixError(f'{len(encoded)} texts but {len(prefixes)} prefixes')
  ids = [tokenizer.encode_target(p) if p and p.strip() else None
         for p in prefixes]
  for i, (source, prefix) in enumerate(zip(encoded, ids)):
    if source is None and prefix:
      raise PrefixError(f'text {i} is empty but has a prefix; there is no '
                        'source to continue it from')
  check(ids, limit)
  return ids


def pad(prefixes, rows: int, width: int) -> np.ndarray:
  """Id lists (``None``: none) -> ``[rows, width]`` int32, 0-padded (rows
  past the lists have no prefix)."""
  out = np.zeros((rows, width), np.int32)
  for r, ids in enumerate(prefixes):
    if ids:
      out[r, :len(ids)] = ids
  return out
