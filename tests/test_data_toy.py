"""The toy language's rules and the `toy_translate` TFDS dataset."""
import random

import pytest

from xfmr_jax.data import toy_language, toy_translate
from xfmr_jax.data.toy_language import LANGUAGE, NP, Clause, Sentence

SMALL = dict(num_train=1500, num_validation=300, num_test=300, num_long=100)


def _config(seed=0, name='t'):
  return toy_translate.ToyTranslateConfig(name=name, seed=seed, **SMALL)


@pytest.fixture(scope='module')
def built(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp('tfds'))
  builder = toy_translate.build_toy_dataset(data_dir, config='small')
  return builder, {s: builder.as_data_source(split=s)
                   for s in ('train', 'validation', 'test', 'long')}, data_dir


def _texts(ds):
  return [(e['source'].decode(), e['target'].decode()) for e in
          ds.__getitems__(list(range(len(ds))))]


def test_generation_is_deterministic():
  a, b = (toy_translate.generate_splits(_config(0)) for _ in range(2))
  assert a == b
  assert toy_translate.generate_splits(_config(1))['train'] != a['train']
  # Evaluation splits do not depend on the number of training pairs.
  bigger = toy_translate.generate_splits(
      toy_translate.ToyTranslateConfig(name='u', **{**SMALL, 'num_train': 3000}))
  assert bigger['test'] == a['test'] and bigger['long'] == a['long']


def test_builder_writes_the_generated_pairs(built):
  builder, splits, data_dir = built
  expected = toy_translate.generate_splits(builder.builder_config)
  for split, ds in splits.items():
    assert _texts(ds) == expected[split], split
  assert builder.info.splits['train'].num_examples == 5000
  # Idempotent: a second call reuses the prepared data.
  again = toy_translate.build_toy_dataset(data_dir, config='small')
  assert again.data_path == builder.data_path and again.is_prepared()


def test_splits_do_not_overlap_and_lengths(built):
  _, splits, _ = built
  sources = {s: [p[0] for p in _texts(ds)] for s, ds in splits.items()}
  seen = set()
  for split, texts in sources.items():
    assert len(set(texts)) == len(texts), split
    assert not seen & set(texts), split
    seen |= set(texts)
    lo, hi = (31, 60) if split == 'long' else (3, 30)
    lengths = [len(t.split()) for t in texts]
    assert lo <= min(lengths) and max(lengths) <= hi, split
  mid = sum(8 <= len(t.split()) <= 22 for t in sources['train'])
  assert mid / len(sources['train']) > 0.5  # weighted towards the middle


def test_targets_follow_the_rules(built):
  _, splits, _ = built
  for src, tgt in _texts(splits['test']) + _texts(splits['long']):
    assert toy_language.reference_translation(src) == tgt
    assert abs(len(tgt.split()) - len(src.split())) <= 10


def test_reordering_is_real(built):
  """Alignment links come from the generator (equal lexical items share a key).

  A pair is non-monotonic if two links cross: source i1 < i2 but target
  j1 > j2. Copying word by word in order cannot translate those pairs.
  """
  assert toy_language.is_monotonic([(0, 0), (1, 2), (2, 3)])
  assert not toy_language.is_monotonic([(0, 1), (1, 0)])
  _, splits, _ = built
  pairs = _texts(splits['test'])
  crossing = 0
  for src, _ in pairs:
    _, _, alignment = LANGUAGE.pair(LANGUAGE.parse(src))
    crossing += not toy_language.is_monotonic(alignment)
  assert crossing / len(pairs) > 0.9
  # Source and target vocabularies are disjoint: nothing can be copied.
  words = lambda k: {w for p in pairs for w in p[k].split()}  # noqa: E731
  assert not words(0) & words(1)


def test_agreement_depends_on_a_distant_word():
  # 'DET NOUN[s] that VERB DET NOUN2 VERB_I': the main verb agrees with NOUN,
  # four words away in the source, past another noun.
  intransitive = LANGUAGE.num_transitive
  for plural_other in (False, True):
    forms = []
    for plural in (False, True):
      rc = Clause(None, 0, 3, NP(det=1, noun=7, plural=plural_other))
      subj = NP(det=0, noun=5, plural=plural, rc=rc)
      sentence = Sentence([Clause(subj, 0, intransitive + 2)])
      src, tgt, _ = LANGUAGE.pair(sentence)
      forms.append((src.split(), tgt.split()))
    (src_sg, tgt_sg), (src_pl, tgt_pl) = forms
    assert src_sg[-1] == src_pl[-1]          # same source verb
    assert src_sg[1] != src_pl[1]            # subject noun +s
    assert tgt_sg[-1] != tgt_pl[-1]          # target verb form changes
    assert tgt_sg[-1].endswith('a') and tgt_pl[-1].endswith('nar')


def test_parse_rejects_non_sentences():
  rng = random.Random(3)
  src, _, _ = LANGUAGE.pair(LANGUAGE.sample(rng))
  with pytest.raises(ValueError, match='not a source-language word'):
    LANGUAGE.parse(src + ' xyzzy')
  with pytest.raises(ValueError):
    LANGUAGE.parse(' '.join(reversed(src.split())) + ' ' + src)


def test_lexicon_is_deterministic_and_sized():
  other = toy_language.ToyLanguage(0)
  assert other.src == LANGUAGE.src and other.tgt == LANGUAGE.tgt
  n_src = sum(len(v) for v in LANGUAGE.src.values())
  assert 200 <= n_src <= 500
  assert all(w.isascii() and w.islower() and w.isalpha()
             for v in LANGUAGE.tgt.values() for w in v)
