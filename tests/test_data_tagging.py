"""The toy tagging task: role tags of source words, encoding and batches."""
import collections
import itertools
import logging

import numpy as np
import pytest

from xfmr_jax import data
from xfmr_jax.data import toy_tagging as tt
from xfmr_jax.data.toy_language import (FUTURE, LANGUAGE, NP, PAST, PRESENT,
                                        RELATIVIZER, Clause, Sentence)
from xfmr_jax.tokenizer import EOS, Tokenizer

INTRANSITIVE = LANGUAGE.num_transitive  # the first intransitive verb index
NOUN = LANGUAGE.src['noun']
L = 64  # longer than every validation sentence (at most ~50 pieces)


@pytest.fixture(scope='module')
def toy(data_dir):
  """(validation source, tokenizer). The vocabulary is small on purpose, so
  that most words are split into several pieces."""
  train = data.get_source('toy_translate/small', 'train', str(data_dir))
  val = data.get_source('toy_translate/small', 'validation', str(data_dir))
  texts = [p[0] for p in data.pipeline.read_pairs(train, range(2000))]
  return val, Tokenizer.train(texts, None, vocab_size=300)


def _sources(source):
  return [p[0] for p in data.pipeline.read_pairs(source, range(len(source)))]


def _text(sentence):
  return LANGUAGE.pair(sentence)[0]


# Object with a relative clause, then a PP that belongs to the main clause
# (relative clauses take no PP): noun 5 is the subject, noun 7 the object.
S1 = Sentence([Clause(
    NP(det=0, adjs=(3,), noun=5), PAST, 2,
    NP(det=1, noun=7, plural=True, rc=Clause(None, PRESENT, INTRANSITIVE + 1)),
    pp=(4, NP(det=2, noun=9)))])
S1_TAGS = ('subj subj subj verb verb obj obj rel rel pp pp pp').split()

# Roles swapped: noun 7 is the subject (with a transitive relative clause that
# has its own object), noun 5 the object; a second clause with a pronoun.
S2 = Sentence([
    Clause(NP(det=1, noun=7, rc=Clause(None, FUTURE, 0,
                                       NP(det=3, adjs=(1, 2), noun=11))),
           PRESENT, 6, NP(det=0, noun=5)),
    Clause(NP(pron=2), PAST, INTRANSITIVE)], conj=1)
S2_TAGS = ('subj subj rel rel rel rel rel rel rel verb obj obj '
           'conj subj verb verb').split()


def test_tags_follow_the_documented_rule():
  assert tt.TAG_ID == {t: i + 1 for i, t in enumerate(tt.TAGS)}
  assert tt.NUM_CLASSES == len(tt.TAGS) + 1 and 5 <= len(tt.TAGS) <= 8
  for sentence, expected in ((S1, S1_TAGS), (S2, S2_TAGS)):
    text = _text(sentence)
    tagged = tt.tag_words(text)
    assert [w for w, _ in tagged] == text.split()
    assert [t for _, t in tagged] == expected, text
  # The same noun is 'subj' in one sentence and 'obj' in the other.
  assert dict(tt.tag_words(_text(S1)))[NOUN[5]] == 'subj'
  assert dict(tt.tag_words(_text(S2)))[NOUN[5]] == 'obj'
  # Extra whitespace is only a separator.
  text = _text(S1)
  assert tt.tag_words('  ' + text.replace(' ', '   ') + ' ') == \
      tt.tag_words(text)


def test_tags_need_context_on_real_data(toy):
  val, _ = toy
  roles = collections.defaultdict(set)
  fixed = {RELATIVIZER: 'rel', **{w: 'pp' for w in LANGUAGE.src['prep']},
           **{w: 'conj' for w in LANGUAGE.src['conj']},
           **{w: 'subj' for w in LANGUAGE.src['pron']}}
  for text in _sources(val):
    tagged = tt.tag_words(text)
    assert tagged[0][1] == 'subj' and tagged[-1][1] != 'conj'
    for word, tag in tagged:
      assert fixed.get(word, tag) == tag, (word, tag, text)
      roles[word].add(tag)
  # Every content-word category occurs with several tags: a lexicon lookup
  # cannot tag them.
  for cat, tags in (('noun', {'subj', 'obj', 'pp', 'rel'}),
                    ('det', {'subj', 'obj', 'pp', 'rel'}),
                    ('adj', {'subj', 'obj', 'pp', 'rel'}),
                    ('verb', {'verb', 'rel'}), ('aux', {'verb', 'rel'})):
    seen = set().union(*(roles[w] for w in LANGUAGE.src[cat]))
    assert seen == tags, cat
  ambiguous = [w for w in NOUN if {'subj', 'obj'} <= roles[w]]
  assert len(ambiguous) > 20


def test_parser_errors_are_clear_value_errors(toy):
  val, tok = toy
  src, tgt = val[0]
  with pytest.raises(ValueError, match="not a toy source sentence.*'xyzzy'"):
    tt.tag_words(src + ' xyzzy')
  with pytest.raises(ValueError, match='not a toy source sentence'):
    tt.tag_words(tgt)  # the target language
  with pytest.raises(ValueError, match='not a toy source sentence.*expected'):
    tt.tag_words(' '.join(src.split()[1:]))  # no determiner
  with pytest.raises(ValueError, match='not a toy source sentence'):
    tt.encode_tagged('', tok)
  reversed_source = [(tgt, src)]  # e.g. get_source(..., reverse=True)
  with pytest.raises(ValueError, match='not a toy source sentence'):
    next(tt.make_tagging_batches(reversed_source, tok, batch_size=2,
                                 max_length=64))


def test_pieces_map_to_their_words(toy):
  val, tok = toy
  multi_piece = 0
  for text in _sources(val)[:100]:
    ids, tags = tt.encode_tagged(text, tok)
    assert ids.dtype == tags.dtype == np.int32 and ids.shape == tags.shape
    assert ids[-1] == EOS and tags[-1] == 0 and (tags[:-1] > 0).all()
    # The model sees what a translation model would see.
    assert ids[:-1].tolist() == tok.encode(text)
    # Split the pieces at word starts ('\u2581') and decode each group back.
    starts = []
    for k, i in enumerate(ids[:-1].tolist()):
      if tok.id_to_piece(i).startswith('\u2581'):
        starts.append(k)
    bounds = starts + [len(ids) - 1]
    tagged = tt.tag_words(text)
    assert len(starts) == len(tagged) and starts[0] == 0
    for (word, tag), a, b in zip(tagged, bounds, bounds[1:]):
      assert tok.decode(ids[a:b]) == word
      assert (tags[a:b] == tt.TAG_ID[tag]).all(), (word, tag)
      multi_piece += b - a > 1
  assert multi_piece > 100  # the test above is not only about whole words


def _rows(batches):
  """The non-empty rows of the batches, as (ids, tags) lists."""
  out = []
  for b in batches:
    for x, y in zip(b['inputs'], b['targets']):
      if x.any():
        n = int(np.count_nonzero(x))
        out.append((x[:n].tolist(), y[:n].tolist()))
  return out


def test_one_pass_batches_are_padded_and_in_order(toy):
  val, tok = toy
  texts = _sources(val)[:70]
  batches = list(tt.make_tagging_batches(val, tok, batch_size=32,
                                         max_length=L, indices=range(70)))
  assert len(batches) == 3  # 32 + 32 + 6 rows
  for b in batches:
    assert set(b) == {'inputs', 'targets'}
    for v in b.values():
      assert v.dtype == np.int32 and v.shape == (32, L)
    # Targets are 0 exactly on padding and EOS.
    assert ((b['targets'] > 0) == ((b['inputs'] > 0) & (b['inputs'] != EOS))
            ).all()
  last = batches[-1]
  assert last['inputs'][6:].sum() == 0 and last['targets'][6:].sum() == 0
  assert (last['inputs'][:6] > 0).any(axis=1).all()
  expected = [tuple(a.tolist() for a in tt.encode_tagged(t, tok))
              for t in texts]
  assert _rows(batches) == expected


def test_repeat_is_deterministic_and_reshuffles(toy):
  val, tok = toy
  def take(seed, n=6):
    it = tt.make_tagging_batches(val, tok, batch_size=4, max_length=L,
                                 indices=range(10), repeat=True, seed=seed)
    return list(itertools.islice(it, n))
  a, b, c = take(0), take(0), take(1)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x['inputs'], y['inputs'])
    np.testing.assert_array_equal(x['targets'], y['targets'])
  assert any((x['inputs'] != y['inputs']).any() for x, y in zip(a, c))
  rows = _rows(a)  # 24 rows: epochs of 10, rows run across epoch boundaries
  assert len(rows) == 24
  one_pass = _rows(tt.make_tagging_batches(val, tok, batch_size=10,
                                           max_length=L, indices=range(10)))
  key = lambda rs: sorted(map(str, rs))  # noqa: E731
  assert key(rows[:10]) == key(rows[10:20]) == key(one_pass)
  assert rows[:10] != rows[10:20] and rows[:10] != one_pass


def test_overlong_sentences_are_skipped_and_counted(toy, caplog):
  val, tok = toy
  lengths = [len(tt.encode_tagged(t, tok)[0]) for t in _sources(val)]
  max_length = int(np.median(lengths))
  keep = sum(n <= max_length for n in lengths)
  skipped = len(lengths) - keep
  assert 0 < skipped < len(lengths)
  with caplog.at_level(logging.WARNING, logger=tt.__name__):
    rows = _rows(tt.make_tagging_batches(val, tok, batch_size=64,
                                         max_length=max_length))
  assert len(rows) == keep
  assert max(len(r[0]) for r in rows) <= max_length
  assert f'skipped {skipped} of {len(lengths)} sentences' in caplog.text
  # Repeating warns once, not every epoch.
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger=tt.__name__):
    it = tt.make_tagging_batches(val, tok, batch_size=64, repeat=True,
                                 max_length=max_length, indices=range(50))
    list(itertools.islice(it, 5))  # 320 rows: more than 10 epochs
  assert len([r for r in caplog.records if 'skipped' in r.message]) == 1
  # Nothing fits: one pass yields nothing; repeating cannot loop forever.
  assert not list(tt.make_tagging_batches(val, tok, batch_size=4,
                                          max_length=2, indices=range(5)))
  with pytest.raises(ValueError, match='longer than max_length=2'):
    next(tt.make_tagging_batches(val, tok, batch_size=4, max_length=2,
                                 indices=range(5), repeat=True))


def test_majority_baseline(toy):
  val, tok = toy
  batch = {'targets': np.array([[1, 1, 2, 0], [3, 1, 0, 0]], np.int32)}
  assert tt.majority_baseline([batch]) == pytest.approx(3 / 5)
  with pytest.raises(ValueError, match='no tagged tokens'):
    tt.majority_baseline([{'targets': np.zeros((2, 3), np.int32)}])
  baseline = tt.majority_baseline(
      tt.make_tagging_batches(val, tok, batch_size=64, max_length=L))
  # Far from 1: always guessing the commonest tag ('subj') does not solve it.
  assert 1 / len(tt.TAGS) < baseline < 0.6
