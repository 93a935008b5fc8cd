"""Target prefixes (xfmr_jax.target_prefix) in greedy decoding, sampling and
GNMT's beam search: the prefix is kept token for token, the continuation is
the model's choice given it (float64 teacher forcing; an exhaustive search),
and a row without a prefix decodes as without the option."""
import jax
import numpy as np
import pytest

from tests.test_beam_search import (CONTENT, VOCAB, padded, prefix_log_softmax,
                                    tiny)
from tests.test_decode import build, sources, teacher_forced_log_probs
from xfmr_jax import beam_search, decode, hf_beam, target_prefix
from xfmr_jax.token_ids import EOS, PAD, UNK

LENGTH = 12


@pytest.fixture(scope='module')
def model():
  m, params = build('post')
  return m, params, sources()


def prefixes(batch=4):
  """Row 0: 3 tokens, row 1: none, the others 1 and 2 tokens."""
  out = np.zeros((batch, 4), np.int32)
  out[0, :3] = [5, 5, 7]
  out[2, :1] = [9]
  out[3, :2] = [4, 11]
  return out


def prefix_of(row):
  return [int(x) for x in row if x != PAD]


def test_greedy_keeps_the_prefix_and_continues_with_the_model_argmax(model):
  m, params, src = model
  pre = prefixes()
  out = np.asarray(decode.greedy_decode(m, params, src, prefix=pre,
                                        max_decode_len=LENGTH))
  plain = np.asarray(decode.greedy_decode(m, params, src,
                                          max_decode_len=LENGTH))
  np.testing.assert_array_equal(out[1], plain[1])  # no prefix: as before
  # After the prefix, each token is the argmax given everything before it,
  # the prefix included (the cache was filled by the forced tokens).
  log_p = teacher_forced_log_probs(m, params, src, out)
  for row in range(len(src)):
    p = prefix_of(pre[row])
    assert list(out[row, :len(p)]) == p
    for t in range(len(p), LENGTH):
      assert out[row, t] == np.argmax(log_p[row, t]), (row, t)
      if out[row, t] == EOS:
        break


def start_of(tokens, n):
  """The first ``n`` tokens of each output, cut before its EOS."""
  start = np.asarray(tokens)[:, :n]
  return np.where(np.cumsum(np.isin(start, [EOS, PAD]), axis=1) > 0, PAD,
                  start)


def test_greedy_from_its_own_start_changes_nothing(model):
  m, params, src = model
  plain = decode.greedy_decode(m, params, src, max_decode_len=LENGTH)
  np.testing.assert_array_equal(decode.greedy_decode(
      m, params, src, prefix=start_of(plain, 3), max_decode_len=LENGTH), plain)


def test_sampling_and_beam_search_keep_the_prefix(model):
  m, params, src = model
  pre = prefixes()
  sampled = np.asarray(decode.sample(m, params, src, jax.random.key(1),
                                     prefix=pre, max_decode_len=LENGTH))
  beams, _ = decode.beam_search(m, params, src, beam_size=4, prefix=pre,
                                max_decode_len=LENGTH)
  nbest, _, _ = decode.beam_search(m, params, src, beam_size=4, prefix=pre,
                                   max_decode_len=LENGTH, num_hypotheses=3)
  one_beam, _ = decode.beam_search(m, params, src, beam_size=1, prefix=pre,
                                   max_decode_len=LENGTH)
  np.testing.assert_array_equal(one_beam, decode.greedy_decode(
      m, params, src, prefix=pre, max_decode_len=LENGTH))  # k = 1 is greedy
  for row in range(len(src)):
    p = prefix_of(pre[row])
    assert list(sampled[row, :len(p)]) == p
    assert list(np.asarray(beams)[row, :len(p)]) == p
    for j in range(3):
      assert list(np.asarray(nbest)[row, j, :len(p)]) == p


def test_a_prefix_wins_over_a_banned_repetition(model):
  """A prefix that repeats a bigram is still kept under no_repeat_ngram_size
  2, and the continuation repeats none of the prefix's bigrams."""
  m, params, src = model
  pre = np.tile(np.asarray([[6, 8, 6, 8]], np.int32), (len(src), 1))
  for out in (decode.greedy_decode(m, params, src, prefix=pre,
                                   no_repeat_ngram_size=2,
                                   max_decode_len=LENGTH),
              decode.beam_search(m, params, src, beam_size=3, prefix=pre,
                                 no_repeat_ngram_size=2,
                                 max_decode_len=LENGTH)[0]):
    out = np.asarray(out)
    for row in out:
      row = [int(x) for x in row]
      assert row[:4] == [6, 8, 6, 8]
      rest = row[3:row.index(EOS) + 1 if EOS in row else None]
      assert not set(zip(rest, rest[1:])) & {(6, 8), (8, 6)}


def test_gnmt_with_a_prefix_is_the_exhaustive_search_over_its_continuations():
  """With a beam over every hypothesis, the n-best list under a prefix is
  the n best EOS-terminated sequences starting with it, scored in float64
  with the prefix's tokens counted in log p; a row without a prefix is the
  unconstrained search."""
  m, params, src = tiny()
  length, alpha, n = 3, 2.0, 4
  k = len(CONTENT) ** (length - 1) * (VOCAB - 1)
  exact, raw, starts = [], [], []
  for row in range(len(src)):
    logp = prefix_log_softmax(m, params, src[row], length, renormalise=True)
    lp = {p + (EOS,): sum(logp[p[:i]][tok] for i, tok in enumerate(p)) +
          logp[p][EOS] for p in logp}
    raw.append(lp)
    exact.append({s: v / beam_search.length_penalty(len(s), alpha)
                  for s, v in lp.items()})
    best = max(exact[-1], key=exact[-1].get)
    # A first token the unconstrained search does not choose.
    starts.append(next(tok for tok in CONTENT if tok != best[0]))
  pre = np.asarray([[starts[0]], [PAD]], np.int32)
  tokens, scores, log_probs = map(np.asarray, beam_search.search(
      m, params, src, beam_search.GNMT(alpha), beam_size=k,
      max_decode_len=length, num_hypotheses=n, prefix=pre))
  for row in range(len(src)):
    ranked = sorted((s for s in exact[row] if row or s[0] == starts[0]),
                    key=exact[row].get, reverse=True)
    for j, seq in enumerate(ranked[:n]):
      np.testing.assert_array_equal(tokens[row, j], padded(seq, length))
      np.testing.assert_allclose(scores[row, j], exact[row][seq], atol=1e-5)
      np.testing.assert_allclose(log_probs[row, j], raw[row][seq], atol=1e-5)


def test_bad_prefixes_are_one_clear_error():
  target_prefix.check([[4, 5], None], limit=3)
  with pytest.raises(ValueError, match='prefix 1 holds the id 1'):
    target_prefix.check([[4], [3, EOS]], limit=10)
  with pytest.raises(ValueError, match='prefix 0 has a token the vocabulary'):
    target_prefix.check([[4, UNK]], limit=10)
  with pytest.raises(ValueError, match='prefix 0 has 3 tokens.*at most 2'):
    target_prefix.check([[4, 5, 6]], limit=3)
  m, params, src = tiny()
  with pytest.raises(ValueError, match="not under generate's rules"):
    hf_beam.beam_search(m, params, src, beam_size=2, max_decode_len=4,
                        prefix=np.ones((2, 1), np.int32) * 3)
