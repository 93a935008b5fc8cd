"""Terminology constraints (xfmr_jax.constraints) in GNMT's beam search: the
constraint state against a plain-Python reading, the allocation against a
plain round robin, the n-best list against an exhaustive float64 search, and
every phrase in every finished output of a random model."""
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_beam_search import CONTENT, padded, prefix_log_softmax, tiny
from tests.test_decode import build, sources
from xfmr_jax import beam_search, constraints, decode
from xfmr_jax.token_ids import EOS, PAD, UNK


def reference_met(phrases, tokens):
  """Constraint tokens met after ``tokens``, read as the module documents:
  a phrase's tokens count in a row; leaving one half way gives them back;
  a token outside a phrase begins the first phrase not met it starts."""
  met = [[False] * len(p) for p in phrases]
  current = None  # (phrase, next position)
  for y in tokens:
    if current is not None:
      i, j = current
      if phrases[i][j] == y:
        met[i][j] = True
        current = (i, j + 1) if j + 1 < len(phrases[i]) else None
        continue
      met[i] = [False] * len(phrases[i])
      current = None
    for i, p in enumerate(phrases):
      if not met[i][0] and p[0] == y:
        met[i][0] = True
        current = (i, 1) if len(p) > 1 else None
        break
  return sum(map(sum, met))


def test_the_constraint_state_follows_a_plain_python_reading():
  rng = np.random.default_rng(0)
  batch, beams, steps = 6, 5, 12
  phrases = [[list(rng.integers(3, 7, rng.integers(1, 4)))
              for _ in range(rng.integers(0, 4))] for _ in range(batch)]
  tokens = jnp.asarray(constraints.pack(phrases, batch))
  emitted = rng.integers(2, 8, (batch, beams, steps))
  state = constraints.init(tokens, beams)
  met, cursor = state['met'], state['cursor']
  for t in range(steps):
    met, cursor = constraints.advance(tokens, met, cursor,
                                      jnp.asarray(emitted[:, :, t]))
    counts = np.asarray(constraints.met_count(tokens, met))
    for b in range(batch):
      for r in range(beams):
        want = reference_met(phrases[b], emitted[b, r, :t + 1].tolist())
        assert counts[b, r] == want, (phrases[b], emitted[b, r, :t + 1])
  done = np.asarray(constraints.all_met(tokens, met))
  total = [sum(map(len, p)) for p in phrases]
  np.testing.assert_array_equal(done, np.asarray(counts) ==
                                np.asarray(total)[:, None])


def test_allocation_is_a_round_robin_over_banks():
  rng = np.random.default_rng(1)
  for _ in range(20):
    n, k = 12, int(rng.integers(1, 8))
    logp = rng.permutation(n).astype(np.float32) * -1.0
    bank = rng.integers(0, 4, n)
    real = rng.random(n) < 0.8
    got = np.asarray(constraints.allocate(
        jnp.asarray(logp)[None], jnp.asarray(bank)[None],
        jnp.asarray(real)[None], k))[0]
    # Round robin: the best real one of each bank, most met first, then the
    # second best of each, ...; then the rest.
    queues = {b: sorted((i for i in range(n) if bank[i] == b and real[i]),
                        key=lambda i: -logp[i]) for b in set(bank)}
    order = [q[r] for r in range(n) for b in sorted(queues, reverse=True)
             for q in [queues[b]] if r < len(q)]
    order += sorted((i for i in range(n) if not real[i]), key=lambda i: -logp[i])
    want = sorted(order[:k], key=lambda i: -logp[i])
    assert got.tolist() == want


def contains(seq, phrase):
  return any(tuple(seq[i:i + len(phrase)]) == tuple(phrase)
             for i in range(len(seq)))


def test_a_beam_over_every_hypothesis_finds_the_exhaustive_constrained_best():
  """With a beam over every hypothesis, the n-best list under constraints is
  the n best EOS-terminated sequences that contain every phrase, scored in
  float64."""
  m, params, src = tiny()
  length, alpha, n = 4, 0.6, 4
  # Ending does not take an alive beam under constraints, so k beams hold
  # every EOS-free sequence up to the last position.
  k = len(CONTENT) ** (length - 1)
  phrases = [[[3, 4]], [[5], [2]]]
  tokens, scores, _ = map(np.asarray, beam_search.search(
      m, params, src, beam_search.GNMT(alpha), beam_size=k,
      max_decode_len=length, num_hypotheses=n,
      constraints=constraints.pack(phrases, 2)))
  for row in range(len(src)):
    logp = prefix_log_softmax(m, params, src[row], length, renormalise=True)
    exact = {p + (EOS,): (sum(logp[p[:i]][tok] for i, tok in enumerate(p)) +
                          logp[p][EOS]) /
             beam_search.length_penalty(len(p) + 1, alpha) for p in logp}
    ranked = sorted((s for s in exact
                     if all(contains(s, p) for p in phrases[row])),
                    key=exact.get, reverse=True)
    for j, seq in enumerate(ranked[:n]):
      np.testing.assert_array_equal(tokens[row, j], padded(seq, length))
      np.testing.assert_allclose(scores[row, j], exact[seq], atol=1e-5)


def test_every_phrase_appears_and_unconstrained_rows_are_unchanged():
  m, params = build('post')
  src = sources(batch=4)
  rng = np.random.default_rng(2)
  plain = np.asarray(decode.beam_search(m, params, src, beam_size=6,
                                        max_decode_len=16)[0])
  for _ in range(3):
    words = np.arange(3, m.config.vocab_size)
    phrases = [[list(rng.choice(words, rng.integers(1, 3), replace=False))
                for _ in range(rng.integers(1, 3))] for _ in range(4)]
    phrases[1] = None
    out = np.asarray(decode.beam_search(  # one width: one compilation
        m, params, src, beam_size=6, max_decode_len=16,
        constraints=constraints.pack(phrases, 4, 8))[0])
    np.testing.assert_array_equal(out[1], plain[1])
    for row in (0, 2, 3):
      seq = out[row].tolist()
      assert EOS in seq, seq  # finished, so it holds every phrase
      for p in phrases[row]:
        assert contains(seq[:seq.index(EOS)], p), (p, seq)
  # With word starts (here: the even ids), a phrase's last word stays whole:
  # the token after it begins a word, or is EOS.
  starts = np.arange(m.config.vocab_size) % 2 == 0
  phrases = [[[7]], None, [[9, 3]], [[5], [11]]]
  out = np.asarray(decode.beam_search(
      m, params, src, beam_size=6, max_decode_len=16,
      constraints=constraints.pack(phrases, 4, 8), word_starts=starts)[0])
  for row in (0, 2, 3):
    seq = out[row].tolist()
    for p in phrases[row]:
      ends = [i + len(p) for i in range(len(seq))
              if seq[i:i + len(p)] == p and starts[seq[i + len(p)]] |
              (seq[i + len(p)] == EOS)]
      assert ends, (p, seq)


def test_bad_constraints_are_one_clear_error():
  constraints.check([[[4, 5]], None, []], limit=3)
  for bad, message in (([[[4], []]], 'constraint 1 of sentence 0 is empty'),
                       ([[[4, UNK]]], 'vocabulary lacks'),
                       ([[[EOS]]], 'pad or EOS'),
                       ([[[4, 5], [6]]], 'have 3 tokens')):
    with pytest.raises(constraints.ConstraintError, match=message):
      constraints.check(bad, limit=3)
  np.testing.assert_array_equal(
      constraints.pack([[[4, 5], [6]], None], 3),
      [[4, 5, PAD, 6, PAD], [PAD] * 5, [PAD] * 5])
