"""Sequence packing: several (inputs, targets) pairs per fixed-shape row.

A packed batch is a dict of int32 arrays, all ``[batch, max_length]``:

  inputs, targets                      token ids, 0 = padding
  inputs_segmentation, targets_segmentation
                                       1, 2, 3, ... = which pair of the row,
                                       0 = padding; a pair's inputs and
                                       targets share one segment id
  inputs_position, targets_position    0-based position inside the pair,
                                       0 at padding

`PackedBatchIterDataset` packs greedily, first fit: each pair goes into the
first row of the current batch with room on both sides; the first pair that
fits nowhere closes the batch and opens the next one. Its iterator state is the
read position of that pending pair, so `get_state`/`set_state` restore exactly.
"""
from __future__ import annotations

import copy
import logging
from typing import Optional

import grain
import numpy as np

log = logging.getLogger(__name__)

KEYS = ('inputs', 'targets', 'inputs_segmentation', 'targets_segmentation',
        'inputs_position', 'targets_position')


class BatchBuilder:
  """Fills one ``[batch_size, max_length]`` batch, first fit."""

  def __init__(self, batch_size: int, max_length: int,
               max_pairs_per_row: Optional[int] = None):
    self.arrays = {k: np.zeros((batch_size, max_length), np.int32)
                   for k in KEYS}
    self.used = np.zeros((2, batch_size), np.int64)  # tokens used per side/row
    self.pairs = np.zeros(batch_size, np.int64)      # pairs per row
    self.max_length = max_length
    self.max_pairs = max_pairs_per_row or max_length
    self.num_pairs = 0

  def add(self, inputs: np.ndarray, targets: np.ndarray) -> bool:
    """Places a pair (sides at most max_length long); False if nowhere fits."""
    fits = ((self.pairs < self.max_pairs)
            & (self.used[0] + len(inputs) <= self.max_length)
            & (self.used[1] + len(targets) <= self.max_length))
    if not fits.any():
      return False
    row = int(fits.argmax())
    self.pairs[row] += 1
    for side, tokens in (('inputs', inputs), ('targets', targets)):
      start = self.used[0 if side == 'inputs' else 1, row]
      span = slice(start, start + len(tokens))
      self.arrays[side][row, span] = tokens
      self.arrays[f'{side}_segmentation'][row, span] = self.pairs[row]
      self.arrays[f'{side}_position'][row, span] = np.arange(len(tokens))
      self.used[0 if side == 'inputs' else 1, row] += len(tokens)
    self.num_pairs += 1
    return True


def unpack(batch: dict) -> list[tuple[np.ndarray, np.ndarray]]:
  """The ``(inputs, targets)`` token arrays of every pair, row by row."""
  out = []
  for row in range(batch['inputs'].shape[0]):
    seg_in = batch['inputs_segmentation'][row]
    seg_tg = batch['targets_segmentation'][row]
    for s in range(1, int(seg_in.max(initial=0)) + 1):
      out.append((batch['inputs'][row][seg_in == s],
                  batch['targets'][row][seg_tg == s]))
  return out


class PackedBatchIterDataset(grain.IterDataset):
  """Packs a stream of *chunks* (lists of ``(inputs, targets)`` int arrays).

  Args:
    parent: IterDataset of lists of tokenised pairs (reading in chunks lets
      the source use one batched read).
    batch_size, max_length: output shape.
    length_policy: 'filter' drops a pair with a side longer than max_length;
      'truncate' cuts it to max_length tokens (dropping its EOS, so the model
      is never taught to stop where the sentence did not end).
    max_pairs_per_row: 1 gives unpacked (padded) rows; None packs freely.
  """

  def __init__(self, parent: grain.IterDataset, *, batch_size: int,
               max_length: int, length_policy: str = 'filter',
               max_pairs_per_row: Optional[int] = None):
    super().__init__(parent)
    if length_policy not in ('filter', 'truncate'):
      raise ValueError(f"length_policy must be 'filter' or 'truncate', got "
                       f'{length_policy!r}')
    self.options = dict(batch_size=batch_size, max_length=max_length,
                        length_policy=length_policy,
                        max_pairs_per_row=max_pairs_per_row)

  def __iter__(self):
    return PackedBatchIterator(self._parent.__iter__(), **self.options)


class PackedBatchIterator(grain.DatasetIterator):
  """Iterator of `PackedBatchIterDataset`; ``stats`` counts pairs seen."""

  def __init__(self, parent, *, batch_size, max_length, length_policy,
               max_pairs_per_row):
    super().__init__(parent)
    self.batch_size, self.max_length = batch_size, max_length
    self.length_policy, self.max_pairs = length_policy, max_pairs_per_row
    self.stats = dict(pairs=0, filtered=0, truncated=0, batches=0)
    self._chunk, self._offset, self._chunk_state = None, 0, None
    self._carry = None  # (inputs, targets, truncated, position) fitting nowhere

  def _next_pair(self):
    """Next pair after the length policy, with its read position."""
    while True:
      while self._chunk is None or self._offset >= len(self._chunk):
        self._chunk_state = copy.deepcopy(self._parent.get_state())
        self._chunk = next(self._parent)  # StopIteration ends the stream
        self._offset = 0
      position = (self._chunk_state, self._offset)
      inputs, targets = self._chunk[self._offset]
      self._offset += 1
      too_long = max(len(inputs), len(targets)) > self.max_length
      if too_long and self.length_policy == 'filter':
        self._count('filtered')
        continue
      return (inputs[:self.max_length], targets[:self.max_length], too_long,
              position)

  def _count(self, what):
    self.stats[what] += 1
    n = self.stats[what]
    if n & (n - 1) == 0:  # log at 1, 2, 4, 8, ... so the log stays short
      log.warning('%s %d pairs longer than max_length=%d so far '
                      '(%d pairs packed)', what, n, self.max_length,
                      self.stats['pairs'])

  def _place(self, builder, pair) -> bool:
    inputs, targets, truncated, _ = pair
    if not builder.add(inputs, targets):
      return False
    # Counted when placed, so a carry re-read after set_state counts once.
    self.stats['pairs'] += 1
    if truncated:
      self._count('truncated')
    return True

  def __next__(self) -> dict:
    builder = BatchBuilder(self.batch_size, self.max_length, self.max_pairs)
    if self._carry is not None:
      self._place(builder, self._carry)  # always fits an empty batch
      self._carry = None
    while True:
      try:
        pair = self._next_pair()
      except StopIteration:
        if builder.num_pairs == 0:
          raise
        break  # a last, partly filled batch
      if not self._place(builder, pair):
        self._carry = pair
        break
    self.stats['batches'] += 1
    return builder.arrays

  def get_state(self) -> dict:
    """JSON-serialisable read position of the next pair, plus ``stats``."""
    if self._carry is not None:
      parent, offset = self._carry[3]
    elif self._chunk is not None and self._offset < len(self._chunk):
      parent, offset = self._chunk_state, self._offset
    else:
      parent, offset = self._parent.get_state(), 0
    return dict(parent=copy.deepcopy(parent), offset=offset,
                stats=dict(self.stats))

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state['parent'])
    self._carry, self._chunk, self._offset = None, None, 0
    if state['offset']:
      self._chunk_state = copy.deepcopy(state['parent'])
      self._chunk = next(self._parent)
      self._offset = state['offset']
    self.stats = dict(state['stats'])
