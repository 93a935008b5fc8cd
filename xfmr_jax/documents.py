"""Whole documents: cut into sentences, translate, put back together.

    doc = documents.split(text, 'en')          # sentences and the rest
    doc.join([translate(s) for s in doc.sentences]) # the same layout

    rows, owner = documents.encode(doc, tokenizer, max_input)  # fit the model
    documents.assemble(doc, owner, translations_of_rows)

Sentences come from `sentencex <https://pypi.org/project/sentencex/>`_
(Wikimedia's rule-based segmenter, about 300 languages, no model to
download), chosen because its segments concatenate back to the input: every
space, newline and blank line stays where it was, and only the sentences
change. A sentence hard-wrapped over several lines is one sentence; its
inner whitespace is read as single spaces.

A sentence longer than the model takes is cut by :func:`split_ids` into parts
that fit, at word boundaries of its tokens, and each part is translated.
"""
from __future__ import annotations

import re
from typing import NamedTuple, Sequence

import sentencex

from xfmr_jax.token_ids import EOS

__all__ = ['Document', 'assemble', 'encode', 'split', 'split_ids']

_EDGES = re.compile(r'^(\s*)(.*?)(\s*)$', re.DOTALL)


class Document(NamedTuple):
  """A text as ``layout[0] + s_0 + layout[1] + ... + s_{n-1} + layout[n]``.

  Attributes:
    sentences: the text's sentences, inner whitespace runs made one space.
    layout: the whitespace around and between them (``len(sentences) + 1``
      strings): what :meth:`join` keeps.
  """
  sentences: list[str]
  layout: list[str]

  def join(self, translations: Sequence[str]) -> str:
    """The document with each sentence replaced by its translation."""
    if len(translations) != len(self.sentences):
      raise ValueError(f'{len(self.sentences)} sentences but '
                       f'{len(translations)} translations')
    out = [self.layout[0]]
    for translation, after in zip(translations, self.layout[1:]):
      out += [translation, after]
    return ''.join(out)


def split(text: str, language: str = 'en') -> Document:
  """``text`` cut into sentences by sentencex's rules for ``language`` (an
  ISO 639 code; one it does not know gets its generic rules)."""
  sentences, layout = [], ['']
  for segment in sentencex.segment(language, text):
    lead, sentence, trail = _EDGES.match(segment).groups()
    layout[-1] += lead
    if sentence:
      sentences.append(' '.join(sentence.split()))
      layout.append('')
    layout[-1] += trail
  return Document(sentences, layout)


def split_ids(ids: Sequence[int], word_starts: Sequence[bool],
              limit: int) -> list[list[int]]:
  """``ids`` cut into consecutive parts of at most ``limit`` tokens.

  A part too long is halved at the word start (``word_starts[i]``: token
  ``i`` begins a word) nearest its middle, and the halves are cut again if
  need be. The range of cuts that leave two halves that fit is centred on
  the middle, so two parts suffice wherever a word start lies in it. A word
  is cut, at the middle of the part, only where the part lies within one
  word longer than ``limit``.
  """
  if limit < 1:
    raise ValueError(f'limit must be at least 1, got {limit}')
  ids = list(ids)
  if len(ids) <= limit:
    return [ids]
  starts = [i for i in range(1, len(ids)) if word_starts[i]]
  cut = min(starts, key=lambda i: abs(2 * i - len(ids)), default=len(ids) // 2)
  return (split_ids(ids[:cut], word_starts[:cut], limit) +
          split_ids(ids[cut:], word_starts[cut:], limit))


def encode(doc: Document, tokenizer, max_input: int
           ) -> tuple[list[list[int]], list[int]]:
  """A document's sentences as source rows that fit the model.

  Args:
    tokenizer: has ``encode`` and ``id_to_piece`` (SentencePiece pieces,
      '\u2581' starting a word).
    max_input: the most source tokens a row may have, EOS included.

  Returns:
    ``(rows, owner)``: EOS-terminated id lists, a sentence longer than
    ``max_input`` cut into parts (:func:`split_ids`), and the index of the
    sentence each row belongs to.
  """
  rows, owner = [], []
  for i, sentence in enumerate(doc.sentences):
    ids = tokenizer.encode(sentence)
    starts = [tokenizer.id_to_piece(t).startswith('\u2581') for t in ids]
    for part in split_ids(ids, starts, max_input - 1):
      rows.append(part + [EOS])
      owner.append(i)
  return rows, owner


def assemble(doc: Document, owner: Sequence[int],
             translations: Sequence[str]) -> str:
  """The translated document from the translations of :func:`encode`'s
  rows: a cut sentence's parts joined with a space."""
  parts = [[] for _ in doc.sentences]
  for i, text in zip(owner, translations):
    parts[i].append(text)
  return doc.join([' '.join(p) for p in parts])
