"""The user's own parallel text: a TSV file or two line-aligned files.

Files are read and checked completely when the source is made, so a bad file
fails at start-up with its path and 1-based line number, not hours into
training. Empty lines and pairs with an empty side are skipped, logged and
counted in ``skipped`` (a list of ``(path, line_number, reason)``).

Only the byte offset of each kept line stays in memory (8 bytes a line); the
text is read back through ``mmap`` when a pair is asked for, so a corpus of
millions of pairs costs tens of megabytes, not its size in Python strings.
"""
from __future__ import annotations

import array
import itertools
import logging
import mmap
import os

import numpy as np

log = logging.getLogger(__name__)

_BOM = b'\xef\xbb\xbf'


class DataError(ValueError):
  """Bad input data; the message names the file and line (or the split)."""


class _Lines:
  """A UTF-8 text file, checked line by line once, then read by offset."""

  def __init__(self, path: str):
    if os.path.isdir(path):
      raise DataError(f'{path}: a directory, not a text file')
    if not os.path.isfile(path):
      raise DataError(f'{path}: file not found')
    self.path = path
    self._map = None

  def scan(self):
    """``(line_number, byte_offset, text)`` of every line, in order; text
    without its line ending. Raises DataError at the first invalid line."""
    with open(self.path, 'rb') as f:
      offset = 0
      for number, raw in enumerate(f, start=1):
        start, offset = offset, offset + len(raw)
        line = raw[:-1] if raw.endswith(b'\n') else raw
        if number == 1 and line.startswith(_BOM):
          start, line = start + len(_BOM), line[len(_BOM):]
        try:
          text = line.decode('utf-8')
        except UnicodeDecodeError as e:
          raise DataError(f'{self.path}:{number}: invalid UTF-8 at byte '
                          f'{e.start} of the line ({e.reason})') from None
        yield number, start, text[:-1] if text.endswith('\r') else text

  def read(self, start: int) -> str:
    """The line that starts at byte ``start``, without its line ending."""
    if self._map is None:
      with open(self.path, 'rb') as f:
        self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    end = self._map.find(b'\n', start)
    text = self._map[start:end if end >= 0 else len(self._map)].decode('utf-8')
    return text[:-1] if text.endswith('\r') else text

  def __getstate__(self):  # a map is not picklable; reopened where used
    return dict(path=self.path, _map=None)


class TextPairSource:
  """Random-access ``(source_text, target_text)`` pairs read from text files.

  Args:
    tsv: a file of ``source<TAB>target`` lines; or
    source_path, target_path: two files with one sentence per line, aligned.
    reverse: swap the sides.
  """

  def __init__(self, tsv: str | None = None, *, source_path: str | None = None,
               target_path: str | None = None, reverse: bool = False):
    if (tsv is None) == (source_path is None or target_path is None):
      raise ValueError('give either tsv or both source_path and target_path')
    self.skipped = []
    if tsv is not None:
      self.paths = (tsv,)
      self._files = (_Lines(tsv),)
      rows = ((tsv, n, (at,), *self._split_tab(tsv, n, line))
              for n, at, line in self._files[0].scan())
    else:
      self.paths = (source_path, target_path)
      self._files = (_Lines(source_path), _Lines(target_path))
      rows = self._aligned(*self._files)
    kept = array.array('q')  # byte offsets of kept lines, 8 bytes each
    total = 0
    for path, n, offsets, s, t in rows:
      total += 1
      s, t = s.strip(), t.strip()
      if not s or not t:
        reason = 'empty line' if not (s or t) else (
            'empty source' if not s else 'empty target')
        self.skipped.append((path, n, reason))
      else:
        kept.extend(offsets)
    self._offsets = np.frombuffer(kept, np.int64).reshape(
        -1, len(self._files))
    self.reverse = reverse
    if self.skipped:
      shown = ', '.join(f'{p}:{n} ({r})' for p, n, r in self.skipped[:5])
      log.warning('skipped %d of %d lines with an empty side: %s%s',
                      len(self.skipped), total, shown,
                      ' ...' if len(self.skipped) > 5 else '')

  @staticmethod
  def _aligned(source: _Lines, target: _Lines):
    for a, b in itertools.zip_longest(source.scan(), target.scan()):
      if a is None or b is None:
        # Which line was added or lost cannot be told from the counts: every
        # pair after it is shifted, so no line number is given.
        n_src = sum(1 for _ in source.scan())
        n_tgt = sum(1 for _ in target.scan())
        raise DataError(
            f'{source.path} has {n_src} lines but {target.path} has '
            f'{n_tgt}; line-aligned files need the same number of lines')
      yield source.path, a[0], (a[1], b[1]), a[2], b[2]

  @staticmethod
  def _split_tab(path, number, line):
    if not line.strip():
      return '', ''  # an empty line: skipped and counted, not an error
    tabs = line.count('\t')
    if tabs != 1:
      raise DataError(f'{path}:{number}: expected source<TAB>target (exactly '
                      f'one tab), found {tabs} tabs in {line[:60]!r}')
    return tuple(line.split('\t'))

  @property
  def num_skipped(self) -> int:
    return len(self.skipped)

  def __len__(self) -> int:
    return len(self._offsets)

  def __getitem__(self, index: int) -> tuple[str, str]:
    offsets = self._offsets[index]  # IndexError past the end, as a list
    if len(self._files) == 1:
      s, t = self._files[0].read(int(offsets[0])).split('\t')
    else:
      s, t = (f.read(int(o)) for f, o in zip(self._files, offsets))
    s, t = s.strip(), t.strip()
    return (t, s) if self.reverse else (s, t)

  def __getitems__(self, indices) -> list[tuple[str, str]]:
    return [self[i] for i in indices]
