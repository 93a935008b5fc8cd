"""Documents cut into sentences and put back, and over-long token runs cut
into parts (xfmr_jax.documents); Translator.translate_document is tested on
the trained model in test_translate.py."""
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from xfmr_jax import documents

LETTER = """\
Dear reader,

  This is the first paragraph. It has two sentences!
Is this a question? Yes.\r\n\r\n
\tAn indented paragraph with trailing spaces.   \n"""


def test_a_document_round_trips_its_layout():
  doc = documents.split(LETTER, 'en')
  assert doc.sentences == [
      'Dear reader,', 'This is the first paragraph.', 'It has two sentences!',
      'Is this a question?', 'Yes.',
      'An indented paragraph with trailing spaces.']
  assert doc.join(doc.sentences) == LETTER
  # Translations of any length go between the same spaces, tabs, CRs and
  # blank lines.
  short = documents.split('Hi.  Ok!\n\n\tBye.\r\n', 'en')
  assert short.join(['A', 'BB', 'CCC']) == 'A  BB\n\n\tCCC\r\n'


def test_hard_wrapped_sentences_are_one_and_blank_text_is_layout_alone():
  doc = documents.split('A sentence wrapped\n  over two lines. Next one.', 'en')
  assert doc.sentences == ['A sentence wrapped over two lines.', 'Next one.']
  assert doc.layout == ['', ' ', '']
  for blank in ('', ' \n\n\t '):
    doc = documents.split(blank, 'en')
    assert doc.sentences == [] and doc.join([]) == blank
  with pytest.raises(ValueError, match='2 sentences but 1 translations'):
    documents.split('One. Two.', 'en').join(['x'])


TEXT = st.lists(st.sampled_from(['word', 'Word', 'x.', '?', ' ', '  ', '\n',
                                 '\n\n', '\t', 'é', '3.5', 'e.g.']),
                max_size=40).map(''.join)


@given(TEXT)
@settings(max_examples=200, deadline=None)
def test_any_text_is_its_layout_and_sentences(text):
  doc = documents.split(text, 'en')
  assert len(doc.layout) == len(doc.sentences) + 1
  assert all(not s.strip() for s in doc.layout)  # layout is whitespace only
  for s in doc.sentences:
    assert s and s == ' '.join(s.split())
  # Up to whitespace inside sentences, the pieces are the text.
  assert doc.join(doc.sentences).split() == text.split()
  if not re.search(r'\S\s{2,}\S|\S[\t\n\r]\S', text):
    assert doc.join(doc.sentences) == text


@given(st.lists(st.integers(1, 9), min_size=1, max_size=30),
       st.integers(1, 12))
# 11 tokens: the cuts at 4 and 6 are as far from 11 // 2, but only 6 leaves
# two parts that fit.
@example([4, 2, 5], 6)
@settings(max_examples=300, deadline=None)
def test_split_ids_fits_keeps_order_and_cuts_at_word_starts(word_lengths,
                                                            limit):
  ids, starts = [], []
  for w, n in enumerate(word_lengths):
    ids += [w] * n  # a token's id is its word's index
    starts += [True] + [False] * (n - 1)
  parts = documents.split_ids(ids, starts, limit)
  assert [t for p in parts for t in p] == ids
  assert all(1 <= len(p) <= limit for p in parts)
  if len(ids) <= limit:
    assert parts == [ids]
  # A word is cut only where it is longer than the limit.
  for before, after in zip(parts, parts[1:]):
    if before[-1] == after[0]:
      assert word_lengths[after[0]] > limit
  # Two parts where two can hold it at a word start.
  cuts = [i for i in range(1, len(ids)) if starts[i]
          and len(ids) - limit <= i <= limit]
  if limit < len(ids) <= 2 * limit and cuts:
    assert len(parts) == 2


def test_split_ids_rejects_a_limit_below_one():
  with pytest.raises(ValueError, match='limit must be at least 1'):
    documents.split_ids([1, 2], [True, True], 0)
