"""Input pipelines (grain): packed training batches, padded evaluation batches.

Training: this process's share of the source -> seeded shuffle, reshuffled
every epoch -> chunks of indices read with one batched read -> SentencePiece
-> EOS appended to both sides -> length policy -> packing (see `packing`).
By default everything runs in this process (``num_workers`` moves reading
and tokenising to grain worker processes) and the iterator's
``get_state()`` is a JSON-serialisable dict: save it with the checkpoint,
``set_state()`` it on a fresh iterator, and the same batches follow.

    it = make_train_iterator(src, tok, batch_size=64, max_length=128, seed=0)
    batch = next(it)          # dict of int32 [64, 128], see packing.KEYS
    state = it.get_state()    # json.dumps(state) works
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import grain
import numpy as np

from xfmr_jax.data import packing
from xfmr_jax.data.packing import unpack  # noqa: F401  (re-exported)
from xfmr_jax.tokenizer import EOS, Tokenizer

log = logging.getLogger(__name__)

READ_CHUNK = 256  # pairs per batched read; small enough to shuffle finely


def read_pairs(source, indices: Sequence[int]) -> list:
  """``source[i]`` for each index, in one batched read when the source can."""
  if hasattr(source, '__getitems__'):
    return source.__getitems__(indices)
  return [source[i] for i in indices]


def tokenize_pairs(pairs, tokenizer: Tokenizer) -> list:
  """``[(src, tgt)]`` -> ``[(inputs, targets)]`` int32 arrays ending in EOS."""
  sources = tokenizer.encode_batch([p[0] for p in pairs])
  targets = tokenizer.encode_target_batch([p[1] for p in pairs])
  return [(np.asarray(s + [EOS], np.int32), np.asarray(t + [EOS], np.int32))
          for s, t in zip(sources, targets)]


def _shard(shard_index, shard_count):
  if shard_index is None or shard_count is None:
    import jax  # only needed for the multi-host defaults
    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
  if not 0 <= shard_index < shard_count:
    raise ValueError(f'shard_index={shard_index} not in [0, {shard_count})')
  return shard_index, shard_count


def _grain_flags_parsed() -> None:
  """grain's worker processes read grain's absl flags, which raises unless
  the flags were parsed; outside an absl app their defaults are taken."""
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def make_train_iterator(source, tokenizer: Tokenizer, *, batch_size: int,
                        max_length: int, seed: int,
                        length_policy: str = 'filter', pack: bool = True,
                        shard_index: Optional[int] = None,
                        shard_count: Optional[int] = None,
                        num_epochs: Optional[int] = None,
                        prefetch: bool = True,
                        num_workers: int = 0) -> grain.DatasetIterator:
  """Iterator of training batches (dicts of int32 ``[batch_size, max_length]``).

  Args:
    source: random-access ``(source_text, target_text)`` pairs (`get_source`).
    tokenizer: shared vocabulary; EOS is appended to both sides.
    batch_size: rows per batch on this process.
    max_length: tokens per row, EOS included.
    seed: shuffling seed; every epoch is reshuffled from it.
    length_policy: 'filter' or 'truncate' pairs longer than max_length; the
      counts are logged and kept in ``iterator.stats``.
    pack: several pairs per row (segment ids 1, 2, ...) if True, else one.
    shard_index, shard_count: this process reads pairs shard_index,
      shard_index + shard_count, ...; default jax.process_index()/count().
    num_epochs: None repeats forever; otherwise the last batch may be part
      empty (rows of zeros), then StopIteration.
    prefetch: read and tokenise ahead in one background thread.
    num_workers: > 0 reads and tokenises in that many grain worker processes
      (``mp_prefetch``), packing in this one: one core tokenises about half a
      million tokens/s (docs/data.md). The batches depend on num_workers, and
      a saved state resumes only with the same number. ``close()`` the
      iterator to stop them.
  """
  shard_index, shard_count = _shard(shard_index, shard_count)
  if len(source) < shard_count:
    raise ValueError(f'source has {len(source)} pairs, fewer than '
                     f'{shard_count} shards')
  ds = grain.MapDataset.range(len(source))[shard_index::shard_count]
  ds = ds.shuffle(seed=seed).repeat(num_epochs)
  ds = ds.batch(READ_CHUNK).map(
      lambda idx: tokenize_pairs(read_pairs(source, idx.tolist()), tokenizer))
  read_options = grain.ReadOptions(num_threads=1 if prefetch else 0,
                                   prefetch_buffer_size=2 if prefetch else 0)
  chunks = ds.to_iter_dataset(read_options)
  if num_workers:
    _grain_flags_parsed()
    chunks = chunks.mp_prefetch(
        grain.MultiprocessingOptions(num_workers=num_workers))
  ds = packing.PackedBatchIterDataset(
      chunks, batch_size=batch_size,
      max_length=max_length, length_policy=length_policy,
      max_pairs_per_row=None if pack else 1)
  return iter(ds)


def make_eval_batches(source, tokenizer: Tokenizer, *, batch_size: int,
                      max_length: int, limit: Optional[int] = None) -> list:
  """All of ``source`` (or its first ``limit`` pairs) as padded batches.

  Each batch has int32 ``[batch_size, max_length]`` ``inputs``/``targets``
  (EOS-terminated, 0-padded, one pair per row) with the matching
  ``*_segmentation``/``*_position`` so a training loss can take it too;
  ``weights`` float32 ``[batch_size]`` is 1 for real pairs and 0 for the rows
  that pad the last batch; ``source_text``/``target_text`` are the raw strings
  (``''`` in padding rows) for BLEU. Longer pairs are truncated (and counted
  in a warning); their raw text is kept whole.
  """
  n = len(source) if limit is None else min(limit, len(source))
  batches, truncated = [], 0
  for start in range(0, n, batch_size):
    pairs = read_pairs(source, list(range(start, min(start + batch_size, n))))
    builder = packing.BatchBuilder(batch_size, max_length, max_pairs_per_row=1)
    for inputs, targets in tokenize_pairs(pairs, tokenizer):
      truncated += max(len(inputs), len(targets)) > max_length
      builder.add(inputs[:max_length], targets[:max_length])
    batch = dict(builder.arrays)
    batch['weights'] = (np.arange(batch_size) < len(pairs)).astype(np.float32)
    pad = [''] * (batch_size - len(pairs))
    batch['source_text'] = [p[0] for p in pairs] + pad
    batch['target_text'] = [p[1] for p in pairs] + pad
    batches.append(batch)
  if truncated:
    log.warning('evaluation: truncated %d of %d pairs to max_length=%d',
                    truncated, n, max_length)
  return batches
