"""Anti-repetition (xfmr_jax.repetition) against plain-Python references, and
in greedy decoding, sampling and beam search on a random model that loops."""
import jax
import numpy as np
import pytest

from tests.test_decode import build, sources
from xfmr_jax import decode, hf_beam, repetition
from xfmr_jax.token_ids import EOS, PAD

VOCAB = 12


def banned_reference(seq, t, n):
  """Tokens that would complete an n-gram already in ``seq[:t]``."""
  seq = list(seq[:t])
  last = tuple(seq[t - n + 1:]) if n > 1 else ()
  return {seq[i + n - 1] for i in range(t - n + 1)
          if tuple(seq[i:i + n - 1]) == last}


@pytest.mark.parametrize('n', [1, 2, 3])
def test_banned_tokens_equal_a_python_search_of_the_history(rng, n):
  seqs = rng.integers(2, 6, (8, 10)).astype(np.int32)  # 4 tokens: repeats
  for t in range(10):
    got = np.asarray(repetition.repeated_ngram_tokens(seqs, t, n, VOCAB))
    for row in range(len(seqs)):
      assert set(np.flatnonzero(got[row])) == banned_reference(
          seqs[row], t, n), (row, t)


def test_penalty_divides_positive_and_multiplies_negative_logits(rng):
  seqs = rng.integers(2, VOCAB, (4, 6)).astype(np.int32)
  logits = rng.normal(size=(4, VOCAB)).astype(np.float32)
  got = np.asarray(repetition.process(logits, seqs, 3,
                                      repetition_penalty=1.5))
  for row in range(4):
    seen = set(seqs[row, :3])
    for tok in range(VOCAB):
      x = float(logits[row, tok])
      want = (x / 1.5 if x > 0 else x * 1.5) if tok in seen else x
      assert got[row, tok] == pytest.approx(want, rel=1e-6)
  assert repetition.process(logits, seqs, 3) is logits  # off: untouched


def repeated_bigrams(row):
  row = [int(x) for x in row]
  row = row[:row.index(EOS) + 1] if EOS in row else row
  grams = list(zip(row, row[1:]))
  return len(grams) - len(set(grams))


@pytest.fixture(scope='module')
def looping_model():
  """A random model whose EOS logit is 0 (its output column zeroed): its
  outputs run long and repeat bigrams under every decoder."""
  m, params = build('post', seed=3, vocab_size=VOCAB)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * (np.arange(x.shape[-1]) != EOS)
      if jax.tree_util.keystr(path) == "['logits']['kernel']" else x, params)
  return m, params, sources(batch=4, vocab=VOCAB)


def test_no_repeated_bigram_in_greedy_sampling_or_either_beam(looping_model):
  m, params, src = looping_model
  length = 24
  runs = {
      'greedy': lambda **kw: decode.greedy_decode(
          m, params, src, max_decode_len=length, **kw),
      'sample': lambda **kw: decode.sample(
          m, params, src, jax.random.key(1), temperature=1.0,
          max_decode_len=length, **kw),
      'beam': lambda **kw: decode.beam_search(
          m, params, src, beam_size=3, max_decode_len=length, **kw)[0],
      'hf beam': lambda **kw: hf_beam.beam_search(
          m, params, src, beam_size=3, max_decode_len=length,
          force_eos=False, **kw)[0],
  }
  for name, run in runs.items():
    plain, fixed = (np.asarray(run(**kw)) for kw in (
        {}, dict(no_repeat_ngram_size=2)))
    assert sum(map(repeated_bigrams, plain)) > 0, name  # the model loops
    assert sum(map(repeated_bigrams, fixed)) == 0, (name, fixed)
  # The penalty at 1.0 and n-gram size 0 are the plain decoders.
  np.testing.assert_array_equal(
      decode.greedy_decode(m, params, src, max_decode_len=length,
                           repetition_penalty=1.0),
      decode.greedy_decode(m, params, src, max_decode_len=length))


def test_penalty_in_greedy_is_the_penalised_argmax_of_each_step(
    looping_model):
  """Each greedy token is the argmax of the step's logits penalised as the
  reference says, computed by teacher forcing the decoded tokens."""
  m, params, src = looping_model
  length, p = 12, 3.0
  out = np.asarray(decode.greedy_decode(m, params, src, max_decode_len=length,
                                        repetition_penalty=p))
  logits = np.asarray(decode.cached_logits(m, params, src, out), np.float64)
  for row in range(len(src)):
    ended = list(out[row]).index(EOS) + 1 if EOS in out[row] else length
    for t in range(ended):
      x = logits[row, t].copy()
      x[PAD] = -np.inf
      for tok in set(out[row, :t]):
        x[tok] = x[tok] / p if x[tok] > 0 else x[tok] * p
      assert out[row, t] == np.argmax(x), (row, t)
  assert sum(map(repeated_bigrams, out)) < sum(map(
      repeated_bigrams, decode.greedy_decode(m, params, src,
                                             max_decode_len=length)))


def test_bad_settings_are_one_clear_error():
  for n, p in ((-1, 1.0), (1.5, 1.0), (0, 0.0), (0, -2.0)):
    with pytest.raises(ValueError, match='no_repeat_ngram_size|repetition_'):
      repetition.check(n, p)


def test_a_loop_is_a_short_phrase_three_times_in_a_row():
  loops = lambda text: repetition.loops(text.split())
  assert loops('du ki ki ki') and loops('a b c a b c a b c x')
  assert not loops('ki a ki a ki') and not loops('a b a b c')
