"""The one beam search loop (xfmr_jax.beam_search) run with a rules object
directly, against exhaustive float64 searches over a six-token vocabulary."""
import functools
import itertools

import jax
import numpy as np
import pytest

from tests.test_decode import build, sources
from xfmr_jax import beam_search, decode, hf_beam, token_ids

EOS, PAD = token_ids.EOS, token_ids.PAD
VOCAB = 6
CONTENT = range(2, VOCAB)  # every token but the pad id and EOS


def tiny():
  """A random model over six tokens and two sources (one 0-padded)."""
  # A seed whose best outputs are 3 tokens long and not greedy's.
  m, params = build('post', seed=6, vocab_size=VOCAB)
  return m, params, sources(batch=2, vocab=VOCAB)


@functools.lru_cache(maxsize=None)
def _jit_apply(m):
  return jax.jit(m.apply)


def prefix_log_softmax(m, params, source, length, *, renormalise):
  """``{prefix: float64 log p(. | prefix) [vocab]}`` for every EOS-free
  prefix shorter than ``length``, from one teacher-forced pass of the full
  model. The pad id is banned before the normalisation (GNMT's rules) or
  after it (``generate``'s, which does not renormalise)."""
  prefixes = [p for n in range(length)
              for p in itertools.product(CONTENT, repeat=n)]
  targets = np.asarray([list(p) + [EOS] * (length - len(p))
                        for p in prefixes], np.int32)
  logits = np.asarray(_jit_apply(m)({'params': params}, np.repeat(
      source[None], len(prefixes), 0), targets), np.float64)
  if renormalise:
    logits[..., PAD] = -np.inf
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  logp[..., PAD] = -np.inf
  return {p: logp[i, len(p)] for i, p in enumerate(prefixes)}


def padded(seq, length):
  return list(seq) + [PAD] * (length - len(seq))


def test_gnmt_rules_with_one_beam_are_greedy():
  m, params, src = tiny()
  tokens, _ = beam_search.search(m, params, src, beam_search.GNMT(0.6),
                                 beam_size=1, max_decode_len=10)
  np.testing.assert_array_equal(
      tokens, decode.greedy_decode(m, params, src, max_decode_len=10))


def test_gnmt_rules_with_a_beam_over_every_hypothesis_are_exhaustive():
  """With k as large as the 4 ** 2 * 5 extensions of the last step, no
  hypothesis is ever dropped: the result is the best of all EOS-terminated
  sequences under log p / length_penalty(len), each scored in float64, and
  the n-best list is their n best, with their plain log p."""
  m, params, src = tiny()
  length, alpha, n = 3, 2.0, 6
  k = len(CONTENT) ** (length - 1) * (VOCAB - 1)
  rules = beam_search.GNMT(alpha)
  tokens, scores = beam_search.search(m, params, src, rules, beam_size=k,
                                      max_decode_len=length)
  nbest, nbest_scores, log_probs = beam_search.search(
      m, params, src, rules, beam_size=k, max_decode_len=length,
      num_hypotheses=n)
  lengths = []
  for row in range(len(src)):
    logp = prefix_log_softmax(m, params, src[row], length, renormalise=True)
    raw = {p + (EOS,): sum(logp[p[:i]][tok] for i, tok in enumerate(p)) +
           logp[p][EOS] for p in logp}
    exact = {seq: lp / beam_search.length_penalty(len(seq), alpha)
             for seq, lp in raw.items()}
    ranked = sorted(exact, key=exact.get, reverse=True)
    best = ranked[0]
    np.testing.assert_array_equal(tokens[row], padded(best, length))
    np.testing.assert_allclose(scores[row], exact[best], atol=1e-5)
    lengths.append(len(best))
    for j, seq in enumerate(ranked[:n]):
      np.testing.assert_array_equal(nbest[row, j], padded(seq, length))
      np.testing.assert_allclose(nbest_scores[row, j], exact[seq], atol=1e-5)
      np.testing.assert_allclose(log_probs[row, j], raw[seq], atol=1e-5)
  assert max(lengths) > 2, lengths  # not just the shortest outputs
  with pytest.raises(ValueError, match='between 1 and the beam size'):
    beam_search.search(m, params, src, rules, beam_size=2, num_hypotheses=3)


def generate_reference(logp, length, k, alpha, force_eos):
  """``generate``'s beam search for one sentence, in float64 and plain
  Python: each step ranks all extensions of the alive beams (ties to the
  lower beam, then token), keeps the 2k best; an ended one (EOS, or the last
  position) among the first k ranks is finished, the first k unended ones
  stay alive; the sentence stops when its k best finished all score at
  least its best alive beam at the current length, or nothing is alive."""
  alive, finished = [((), 0.0)], []
  for t in range(length):
    ranked = []
    for b, (seq, total) in enumerate(alive):
      row = logp[seq]
      if force_eos and t == length - 1:
        row = np.where(np.arange(VOCAB) == EOS, 0.0, -np.inf)
      ranked += [(total + row[tok], b, tok) for tok in range(VOCAB)]
    ranked.sort(key=lambda c: (-c[0], c[1], c[2]))
    next_alive = []
    for rank, (total, b, tok) in enumerate(ranked[:2 * k]):
      seq = alive[b][0] + (tok,)
      if tok == EOS or t + 1 == length:
        if rank < k:
          finished.append((total / (t + 1) ** alpha, seq, total))
      elif len(next_alive) < k:
        next_alive.append((seq, total))
    alive = next_alive
    best_k = sorted((f[0] for f in finished), reverse=True)[:k]
    if not alive or (len(best_k) == k and
                     best_k[-1] >= alive[0][1] / (t + 1) ** alpha):
      break
  # Best first; of equal scores, the first found.
  return sorted(finished, key=lambda f: -f[0])


@pytest.mark.parametrize('force_eos', [True, False])
def test_generate_rules_follow_a_float64_reference(force_eos):
  """``generate`` ranks 2k extensions per beam step, so no beam (2k + 1 <=
  vocab) covers every hypothesis; the loop under its rules is checked
  against a plain-Python run of them over exact log-probabilities."""
  m, params, src = tiny()
  length, k, alpha = 4, 2, 1.0
  rules = hf_beam.Generate(alpha, force_eos)
  tokens, scores = beam_search.search(m, params, src, rules, beam_size=k,
                                      max_decode_len=length)
  nbest, nbest_scores, log_probs = beam_search.search(
      m, params, src, rules, beam_size=k, max_decode_len=length,
      num_hypotheses=k)
  for row in range(len(src)):
    logp = prefix_log_softmax(m, params, src[row], length, renormalise=False)
    finished = generate_reference(logp, length, k, alpha, force_eos)
    score, seq, _ = finished[0]
    np.testing.assert_array_equal(tokens[row], padded(seq, length))
    np.testing.assert_allclose(scores[row], score, atol=1e-5)
    for j, (score, seq, total) in enumerate(finished[:k]):
      np.testing.assert_array_equal(nbest[row, j], padded(seq, length))
      np.testing.assert_allclose(nbest_scores[row, j], score, atol=1e-5)
      np.testing.assert_allclose(log_probs[row, j], total, atol=1e-5)
  assert len({tuple(row) for row in np.asarray(tokens)}) == 2  # not alike


def test_rules_are_static_values():
  """Rules are jit static arguments: equal settings, equal (hashable) rules,
  so a second search with them reuses the compilation."""
  assert beam_search.GNMT(0.6) == beam_search.GNMT(0.6)
  assert hash(hf_beam.Generate(1.0, True)) == hash(hf_beam.Generate(1.0, True))
  assert beam_search.GNMT(0.6) != beam_search.GNMT(1.0)


def test_segment_sizes_halve_down_to_an_eighth_and_8_sentences():
  assert beam_search.segment_sizes(64) == [64, 32, 16, 8]
  assert beam_search.segment_sizes(256) == [256, 128, 64, 32]
  assert beam_search.segment_sizes(17) == [17, 9]
  assert beam_search.segment_sizes(15) == [15]


@pytest.mark.parametrize('changes', [
    {}, {'scan_layers': True},
    {'attention_kind': 'local', 'attention_window': 4}],
    ids=['full', 'scan', 'local'])
def test_dropping_finished_sentences_keeps_every_result(changes):
  """Sentences that are done leave the decoded rows as the batch thins out;
  every sentence's tokens and score stay those of the search that decodes
  all rows to the end, under both rule sets."""
  m, params = build('post', seed=1, **changes)
  # EOS's output column scaled up: the sentences of this random model then
  # end at steps far apart, so the batch thins out (under every variant and
  # both rules) well before max_decode_len.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * np.where(np.arange(x.shape[-1]) == EOS, 3., 1.)
      if jax.tree_util.keystr(path) == "['logits']['kernel']" else x, params)
  src = sources(batch=17, vocab=m.config.vocab_size)  # segments 17, 9
  for rules in (beam_search.GNMT(0.6), hf_beam.Generate(1.0)):
    full, compact = (beam_search.search(m, params, src, rules, beam_size=4,
                                        max_decode_len=20, compact=c)
                     for c in (False, True))
    np.testing.assert_array_equal(compact[0], full[0])
    np.testing.assert_allclose(compact[1], full[1], atol=1e-5)
    if isinstance(rules, beam_search.GNMT):  # its sentences end apart
      lengths = (np.asarray(full[0]) != PAD).sum(1)
      assert lengths.min() < lengths.max(), lengths


def test_dropping_finished_sentences_on_a_trained_model(trained_workdir,
                                                        data_dir):
  """The same on a trained toy model and real test sentences, whose
  outputs end at many different steps."""
  from xfmr_jax import data, source_batches
  from xfmr_jax.workdir import Workdir
  trained = Workdir(str(trained_workdir)).load()
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  rows = [source_batches.encode_source(trained.tokenizer, test[i][0], i, 64)
          for i in range(24)]
  src = source_batches.pad_rows(rows, 64, 24)
  full, compact = (decode.beam_search(trained.model, trained.params, src,
                                      beam_size=4, max_decode_len=64,
                                      compact=c) for c in (False, True))
  np.testing.assert_array_equal(compact[0], full[0])
  np.testing.assert_allclose(compact[1], full[1], atol=1e-5)
