"""The user's own parallel text: a TSV file or two line-aligned files.

Files are read and checked completely when the source is made, so a bad file
fails at start-up with its path and 1-based line number, not hours into
training. Empty lines and pairs with an empty side are skipped, logged and
counted in ``skipped`` (a list of ``(path, line_number, reason)``).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


class DataError(ValueError):
  """Bad input data; the message names the file and line (or the split)."""


def _read_lines(path: str) -> list[str]:
  """Lines of a UTF-8 file without line endings; errors name path and line."""
  if os.path.isdir(path):
    raise DataError(f'{path}: a directory, not a text file')
  if not os.path.isfile(path):
    raise DataError(f'{path}: file not found')
  with open(path, 'rb') as f:
    raw = f.read()
  lines = raw.split(b'\n')
  if lines and lines[-1] == b'':  # the final newline does not start a line
    lines.pop()
  out = []
  for number, line in enumerate(lines, start=1):
    try:
      text = line.decode('utf-8-sig' if number == 1 else 'utf-8')
    except UnicodeDecodeError as e:
      raise DataError(f'{path}:{number}: invalid UTF-8 at byte {e.start} of '
                      f'the line ({e.reason})') from None
    out.append(text[:-1] if text.endswith('\r') else text)
  return out


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
      rows = [(tsv, n, *self._split_tab(tsv, n, line))
              for n, line in enumerate(_read_lines(tsv), start=1)]
    else:
      self.paths = (source_path, target_path)
      src, tgt = _read_lines(source_path), _read_lines(target_path)
      if len(src) != len(tgt):
        # Which line was added or lost cannot be told from the counts: every
        # pair after it is shifted, so no line number is given.
        raise DataError(
            f'{source_path} has {len(src)} lines but {target_path} has '
            f'{len(tgt)}; line-aligned files need the same number of lines')
      rows = [(source_path, n, s, t)
              for n, (s, t) in enumerate(zip(src, tgt), start=1)]
    self.pairs = []
    for path, n, s, t in rows:
      s, t = s.strip(), t.strip()
      if not s or not t:
        reason = 'empty line' if not (s or t) else (
            'empty source' if not s else 'empty target')
        self.skipped.append((path, n, reason))
      else:
        self.pairs.append((t, s) if reverse else (s, t))
    if self.skipped:
      shown = ', '.join(f'{p}:{n} ({r})' for p, n, r in self.skipped[:5])
      log.warning('skipped %d of %d lines with an empty side: %s%s',
                      len(self.skipped), len(rows), shown,
                      ' ...' if len(self.skipped) > 5 else '')

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
    return len(self.pairs)

  def __getitem__(self, index: int) -> tuple[str, str]:
    return self.pairs[index]

  def __getitems__(self, indices) -> list[tuple[str, str]]:
    return [self.pairs[i] for i in indices]
