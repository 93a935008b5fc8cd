"""From source texts to padded, length-bucketed id batches, and back.

The in-process :class:`xfmr_jax.translate.Translator` and the exported
translator of :mod:`xfmr_jax.serving` share these rules, so that both give the
same batches and therefore the same outputs. This module needs only numpy and
the tokenizer (no flax, no model code).

Inputs are padded to one of a few bucket lengths, and a call's rows to a power
of two, so that a stream of requests of many lengths and counts compiles the
decoder only a few times per bucket.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

import numpy as np

from xfmr_jax.token_ids import EOS, PAD

BUCKETS = (16, 32, 64, 128, 256, 512)


class InputTooLong(ValueError):
  """An input longer than the model's maximum, with ``too_long='error'``."""


def max_input_length(max_len: int, model_kind: str) -> int:
  """Longest source (EOS included) a model takes: a decoder-only model's
  positions hold the source and the output, so it gets half."""
  return max_len // 2 if model_kind == 'decoder_only' else max_len


def bucket(length: int, limit: int, buckets: Sequence[int] = BUCKETS) -> int:
  """Smallest bucket holding ``length`` tokens (never above ``limit``)."""
  return min(next((b for b in buckets if b >= length), limit), limit)


def buckets_up_to(limit: int, buckets: Sequence[int] = BUCKETS) -> list[int]:
  """Every width :func:`bucket` can return for inputs up to ``limit``."""
  return sorted({bucket(b, limit, buckets) for b in buckets} | {limit})


def encode_source(tokenizer, text: str, index: int, max_input: int,
                  too_long: str = 'truncate') -> list[int] | None:
  """Ids of one source with EOS; ``None`` for an empty or blank text.

  Args:
    index: the text's position, named in the warning or error.
    too_long: 'truncate' (warn on stderr, keep the first tokens and EOS) or
      'error' (raise :class:`InputTooLong`).
  """
  if not text.strip():
    return None
  ids = tokenizer.encode(text) + [EOS]
  if len(ids) > max_input:
    if too_long == 'error':
      raise InputTooLong(f'input {index} has {len(ids)} tokens, more than '
                         f'the model maximum {max_input}')
    print(f'warning: input {index} has {len(ids)} tokens; truncated to '
          f'{max_input}', file=sys.stderr)
    ids = ids[:max_input - 1] + [EOS]
  return ids


def plan(encoded: Sequence[list[int] | None], batch_size: int, max_input: int,
         buckets: Sequence[int] = BUCKETS) -> list[tuple[list[int], int]]:
  """Decoder calls for ``encoded``: ``[(indices, width), ...]``.

  Non-empty inputs are sorted by length, so that each call pads little, and
  cut into chunks of at most ``batch_size``; ``width`` is the chunk's bucket.
  """
  todo = sorted((i for i, ids in enumerate(encoded) if ids is not None),
                key=lambda i: len(encoded[i]))
  calls = []
  for start in range(0, len(todo), batch_size):
    chunk = todo[start:start + batch_size]
    width = bucket(max(len(encoded[i]) for i in chunk), max_input, buckets)
    calls.append((chunk, width))
  return calls


def translate_in_order(encoded: Sequence[list[int] | None], batch_size: int,
                       max_input: int, translate_chunk,
                       buckets: Sequence[int] = BUCKETS,
                       empty: Any = '') -> list:
  """Texts for ``encoded`` in order (``empty`` where ``None``), one
  ``translate_chunk(chunk, width) -> list`` call per :func:`plan` entry
  (``chunk``: the indices into ``encoded`` of its rows, which lets a caller
  bring along other per-text inputs)."""
  out = [empty] * len(encoded)
  for chunk, width in plan(encoded, batch_size, max_input, buckets):
    for i, text in zip(chunk, translate_chunk(chunk, width)):
      out[i] = text
  return out


def row_counts(batch_size: int) -> list[int]:
  """The row counts decoder calls are padded to: powers of two up to (and
  including) ``batch_size``, so each bucket compiles for a handful of batch
  sizes and a call of one sentence decodes one row, not ``batch_size``."""
  return sorted({min(1 << i, batch_size)
                 for i in range(batch_size.bit_length() + 1)})


def pad_rows(rows: Sequence[list[int]], width: int,
             batch_size: int) -> np.ndarray:
  """``[n, width]`` int32 with ``rows`` at the top, PAD elsewhere; ``n`` is
  the smallest of :func:`row_counts` holding them (at most ``batch_size``)."""
  if len(rows) > batch_size:
    raise ValueError(f'{len(rows)} rows; at most {batch_size} per call')
  num_rows = next(n for n in row_counts(batch_size) if n >= len(rows))
  out = np.full((num_rows, width), PAD, np.int32)
  for r, ids in enumerate(rows):
    out[r, :len(ids)] = ids
  return out
