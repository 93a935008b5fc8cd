"""Alignments from cross-attention (xfmr_jax.alignment): the source position
of each output token against a float64 NumPy reading of the attention maps,
word links, and on the trained toy model against the task's gold alignment."""
import numpy as np
import pytest

from tests.test_decode import build, sources
from xfmr_jax import alignment, data, decode
from xfmr_jax.data import toy_language
from xfmr_jax.token_ids import EOS, PAD
from xfmr_jax.translate import Aligned, Translator


def reference_positions(maps, inputs, outputs, layer):
  """Float64 NumPy: the head-averaged argmax over the source's words."""
  weights = np.asarray(maps['decoder_cross'][layer], np.float64).mean(1)
  word = (inputs != PAD) & (inputs != EOS)
  out = np.full(outputs.shape, alignment.NONE)
  for b in range(len(inputs)):
    for i, tok in enumerate(outputs[b]):
      if tok in (PAD, EOS) or not word[b].any():
        continue
      out[b, i] = np.flatnonzero(word[b])[np.argmax(weights[b, i][word[b]])]
  return out


def test_source_positions_equal_a_float64_reading_of_the_maps():
  m, params = build('post', num_decoder_layers=3)
  src = sources()
  src[3, 1:] = 0
  src[3, 0] = EOS  # a source of EOS alone aligns nothing
  out = np.asarray(decode.greedy_decode(m, params, src, max_decode_len=9))
  maps = decode.attention_maps(m, params, src, out)
  for layer in (None, 0, 2, -1):
    got = np.asarray(alignment.source_positions(m, params, src, out,
                                                layer=layer))
    want = reference_positions(maps, src, out, 1 if layer is None else layer)
    np.testing.assert_array_equal(got, want)
  assert (got[3] == alignment.NONE).all() and (got[:3] >= 0).any()
  with pytest.raises(ValueError, match='layer 3 is not one of the 3'):
    alignment.source_positions(m, params, src, out, layer=3)


def test_word_links_group_pieces_into_words():
  assert alignment.word_starts(['\u2581a', 'b', '\u2581c', '\u2581d', 'e']) == [
      0, 0, 1, 2, 2]
  assert alignment.word_starts(['x', '\u2581y']) == [0, 1]
  # Output tokens 0..3 in words 0 0 1 1; the last has no source position.
  links = alignment.word_links([0, 1, 1], [0, 0, 1, 1], [2, 1, 0,
                                                         alignment.NONE])
  assert links == [(0, 1), (1, 0)]
  assert alignment.default_layer(6) == 4 and alignment.default_layer(1) == 0


@pytest.fixture(scope='module')
def translator(trained_workdir):
  return Translator.from_workdir(str(trained_workdir), batch_size=8)


def test_translator_aligns_its_translations_like_the_gold_alignment(
    translator, data_dir):
  """The texts are the translations; on the sentences the model gets right,
  its links agree with the toy task's gold word alignment far more often
  than chance does; an empty text aligns to nothing."""
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  sources_ = [test[i][0] for i in range(24)]
  aligned = translator.align(sources_ + [''])
  assert aligned[-1] == Aligned('', [])
  assert [a.text for a in aligned[:-1]] == translator(sources_)
  lang = toy_language.LANGUAGE
  hits = chance = total = 0
  for src, a in zip(sources_, aligned):
    n_src, n_out = len(src.split()), len(a.text.split())
    assert all(0 <= s < n_src and 0 <= o < n_out for s, o in a.links)
    source, target, gold = lang.pair(lang.parse(src))
    if a.text != target:
      continue
    gold = set(gold)
    golden = {o for _, o in gold}
    for s, o in a.links:
      if o in golden:
        total += 1
        hits += (s, o) in gold
        chance += len([g for g in gold if g[1] == o]) / n_src
  assert total > 20, total
  assert hits / total > 2 * chance / total, (hits, chance, total)
  with pytest.raises(ValueError, match='layer 5 is not one of the 2'):
    translator.align(sources_[:1], layer=5)
