"""Decoding: KV cache, greedy, beam search, sampling, attention maps."""
import functools
import itertools

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from xfmr_jax import beam_cache, blocks, config, decode, model, token_ids
from xfmr_jax import top_k as topk

EOS = token_ids.EOS
TINY = dict(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=2,
            num_decoder_layers=2, vocab_size=17, max_len=32)
# Unshared output projection: with tied embeddings a random model mostly
# repeats its previous token, which makes token-level comparisons weak.
VARIANTS = {
    'post': dict(share_embeddings=False),
    'pre_scan': dict(share_embeddings=False, norm_position='pre',
                     scan_layers=True),
    'shared_learned_remat': dict(positional='learned', remat=True),
}


@functools.lru_cache(maxsize=None)
def build(variant='post', seed=1, **changes):
  """A tiny random model and its params (cached across tests).

  Params are drawn with numpy on shapes from ``jax.eval_shape``: running
  ``init`` costs seconds on CPU, a good share of this file's budget.
  """
  cfg = config.toy(**{**TINY, **VARIANTS[variant], **changes})
  m = model.Transformer(cfg)
  dummy = jnp.ones((1, 4), jnp.int32)
  shapes = nn.unbox(jax.eval_shape(m.init, jax.random.key(0), dummy, dummy))
  rng = np.random.default_rng(seed)

  def draw(path, x):
    name = jax.tree_util.keystr(path[-1:])
    z = rng.standard_normal(x.shape).astype(np.float32)
    if name in ("['kernel']", "['wi']", "['wo']"):
      return z / np.sqrt(x.shape[-2])  # fan-in scaling
    # Equal-norm output rows: no token wins by its norm alone.
    if name == "['embedding']":
      return 2 * z / np.linalg.norm(z, axis=-1, keepdims=True)
    if jax.tree_util.keystr(path[-2:-1]) == "['logits']":
      return 2 * z / np.linalg.norm(z, axis=0, keepdims=True)
    if name == "['scale']":
      return 1 + 0.1 * z
    return 0.1 * z  # biases, learned positions
  return m, jax.tree_util.tree_map_with_path(draw, shapes['params'])


def sources(batch=4, length=7, vocab=17, seed=0):
  """``[batch, length]`` random source ids, some rows 0-padded."""
  rng = np.random.default_rng(seed)
  src = rng.integers(2, vocab, size=(batch, length)).astype(np.int32)
  for row in range(1, batch, 2):
    src[row, length - 2 * row:] = 0
  return src


@functools.lru_cache(maxsize=None)
def _jit_apply(m):
  return jax.jit(m.apply)


def teacher_forced_log_probs(m, params, inputs, targets):
  """Full-model log-probabilities ``[batch, t, vocab]`` (pad id forbidden)."""
  logits = _jit_apply(m)({'params': params}, inputs, targets)
  return np.asarray(jax.nn.log_softmax(logits.at[..., 0].set(-jnp.inf)))


def check_layout(tokens):
  """EOS-terminated rows: no pad before the first EOS, only pads after it."""
  for row in np.asarray(tokens):
    ends = np.flatnonzero(row == EOS)
    stop = ends[0] + 1 if len(ends) else len(row)
    assert np.all(row[:stop] != 0) and np.all(row[stop:] == 0), row


def sequence_score(log_probs, tokens, alpha):
  """``sum log p / length_penalty(len)`` of one EOS-terminated row."""
  ends = np.flatnonzero(tokens == EOS)
  n = ends[0] + 1 if len(ends) else len(tokens)
  logp = log_probs[np.arange(n), tokens[:n]].sum()
  return logp / decode.length_penalty(n, alpha)


# -------------------------------------------------------------- the cache --

@pytest.mark.parametrize('variant', ['post', 'pre_scan'])
def test_cached_greedy_equals_naive_recompute(variant):
  m, params = build(variant)
  src = sources()
  fast = decode.greedy_decode(m, params, src, max_decode_len=14)
  slow = decode.naive_greedy_decode(m, params, src, max_decode_len=14)
  np.testing.assert_array_equal(fast, slow)
  assert fast.shape == (4, 14)
  check_layout(fast)
  assert len(np.unique(np.asarray(fast))) > 3  # not a degenerate model


@pytest.mark.parametrize('variant', list(VARIANTS))
def test_cached_step_logits_equal_teacher_forced(variant):
  m, params = build(variant)
  src = sources()
  rng = np.random.default_rng(1)
  targets = rng.integers(2, 17, size=(4, 14)).astype(np.int32)
  targets[1, 5:] = [EOS] + [0] * 8
  targets[2, 2:] = [EOS] + [0] * 11
  cached = np.asarray(decode.cached_logits(m, params, src, targets))
  full = np.asarray(_jit_apply(m)({'params': params}, src, targets))
  real = targets != 0  # pad targets are masked queries in teacher forcing
  np.testing.assert_allclose(cached[real], full[real], atol=1e-5, rtol=0)


def _dots_on_encoded(jaxpr, shapes, in_loop=False, counts=None):
  """Count dot_generals with an operand of one of ``shapes`` in / outside
  while loops."""
  counts = counts if counts is not None else {True: 0, False: 0}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general' and any(
        getattr(v.aval, 'shape', None) in shapes for v in eqn.invars):
      counts[in_loop] += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      _dots_on_encoded(sub, shapes, in_loop or eqn.primitive.name == 'while',
                       counts)
  return counts


@pytest.mark.parametrize('variant', ['post', 'pre_scan'])
def test_cross_attention_kv_projected_once(variant):
  m, params = build(variant)
  src = sources()
  # [batch, s, d_model], or flattened to [batch * s, d_model] by
  # layers.linear.
  encoded_shapes = ((4, 7, TINY['d_model']), (4 * 7, TINY['d_model']))
  jaxpr = jax.make_jaxpr(
      lambda p, x: decode.greedy_decode(m, p, x, max_decode_len=14))(params,
                                                                       src)
  counts = _dots_on_encoded(jaxpr.jaxpr, encoded_shapes)
  # Outside the loop: encoder layers, plus cross K and V once per decoder
  # layer (scanned layers appear once in the jaxpr). Inside: none.
  layers = 1 if m.config.scan_layers else 2
  assert counts[False] >= 2 * layers and counts[True] == 0, counts
  # The probe does see recomputation when it happens.
  naive = jax.make_jaxpr(
      lambda p, x: decode.naive_greedy_decode(m, p, x, max_decode_len=14))(
          params, src)
  assert _dots_on_encoded(naive.jaxpr, encoded_shapes)[True] > 0


def test_cache_layout_and_multi_token_steps():
  m, params = build('post')
  src = sources()
  targets = np.random.default_rng(2).integers(2, 17, (4, 14)).astype(np.int32)
  variables = {'params': params}

  @jax.jit
  def run(variables, src):
    encoded = m.apply(variables, src, method=m.encode)
    _, state = m.apply(variables, src, jnp.zeros((4, 0), jnp.int32), 0,
                       encoded, cache_len=14, method=m.decode_step,
                       mutable=['cache'])
    # A whole prefix in one step (e.g. a forced prompt): 9 positions, then 5.
    decoder_inputs = blocks.shift_right(targets)
    first, state2 = m.apply({**variables, **state}, src,
                            decoder_inputs[:, :9], 0, cache_len=14,
                            method=m.decode_step, mutable=['cache'])
    second, _ = m.apply({**variables, **state2}, src, decoder_inputs[:, 9:], 9,
                        cache_len=14, method=m.decode_step, mutable=['cache'])
    return encoded, state, jnp.concatenate([first, second], axis=1)
  encoded, state, logits = run(variables, src)

  layer = state['cache']['decoder_1']
  # Heads first: [batch, kv_heads, slots, head_dim].
  assert layer['self_attention']['cached_key'].shape == (4, 2, 14, 16)
  cross = layer['cross_attention']
  kernel = params['decoder_1']['cross_attention']['key']
  expected = (encoded @ kernel['kernel'] + kernel['bias']).reshape(4, 7, 2, 16)
  np.testing.assert_allclose(cross['cached_key'], expected.transpose(0, 2, 1, 3),
                             atol=1e-5)
  assert cross['cached_value'].shape == (4, 2, 7, 16)
  np.testing.assert_allclose(
      logits, _jit_apply(m)(variables, src, targets), atol=1e-5, rtol=0)


# ------------------------------------------------------------- beam search --

def test_beam_size_one_is_greedy():
  m, params = build('post')
  src = sources()
  tokens, _ = decode.beam_search(m, params, src, beam_size=1, alpha=0.6,
                                 max_decode_len=14)
  np.testing.assert_array_equal(
      tokens, decode.greedy_decode(m, params, src, max_decode_len=14))


def test_wide_beam_finds_exhaustive_best():
  # Seed and alpha chosen so the best outputs have 2 to 4 tokens, not just EOS.
  m, params = build('post', seed=0, vocab_size=5)
  src = sources(vocab=5)
  length, alpha, content = 4, 2.0, [2, 3, 4]
  # Every EOS-terminated output of at most `length` tokens: 1 + 3 + 9 + 27.
  hyps = np.asarray([list(body) + [EOS] + [0] * (length - 1 - n)
                     for n in range(length)
                     for body in itertools.product(content, repeat=n)],
                    np.int32)
  # A beam as wide as all 4 * 27 extensions at the last step is exhaustive.
  tokens, scores = decode.beam_search(m, params, src, beam_size=108,
                                      alpha=alpha, max_decode_len=length)
  lengths = []
  for row in range(len(src)):
    log_probs = teacher_forced_log_probs(
        m, params, np.repeat(src[row:row + 1], len(hyps), 0), hyps)
    exact = [sequence_score(lp, h, alpha) for lp, h in zip(log_probs, hyps)]
    best = int(np.argmax(exact))
    np.testing.assert_array_equal(tokens[row], hyps[best])
    np.testing.assert_allclose(scores[row], exact[best], atol=1e-5)
    lengths.append(int(np.sum(hyps[best] != 0)))
  assert max(lengths) > 2, lengths


def test_beam_scores_and_batching():
  m, params = build('post')
  src = sources()
  tokens, scores = decode.beam_search(m, params, src, max_decode_len=14)
  check_layout(tokens)
  # The reported score is the length-penalised log p of the returned tokens.
  log_probs = teacher_forced_log_probs(m, params, src, np.asarray(tokens))
  for row in range(4):
    np.testing.assert_allclose(
        scores[row], sequence_score(log_probs[row], np.asarray(tokens[row]),
                                    0.6), atol=1e-4)
  # A sentence's translation does not depend on the rest of the batch (same
  # shape, so no new compilation): permute it, or change the other rows.
  perm = [2, 0, 3, 1]
  shuffled, shuffled_scores = decode.beam_search(m, params, src[perm],
                                                 max_decode_len=14)
  np.testing.assert_array_equal(shuffled, np.asarray(tokens)[perm])
  np.testing.assert_allclose(shuffled_scores, np.asarray(scores)[perm],
                             atol=1e-5)
  others = sources(seed=5)
  others[2] = src[2]
  mixed, _ = decode.beam_search(m, params, others, max_decode_len=14)
  np.testing.assert_array_equal(mixed[2], tokens[2])
  # Alone (one sentence: one cached cross-attention row for all its beams).
  alone, _ = decode.beam_search(m, params, src[:1], max_decode_len=14)
  np.testing.assert_array_equal(alone[0], tokens[0])


def test_blocked_top_k_gives_the_same_outputs(monkeypatch):
  """Beam search and top-k sampling rank the vocabulary with top_k.top_k.
  Made to take its blocked path at this small vocabulary, they return what
  one scan of each row (lax.top_k) gives."""
  m, params = build('post', vocab_size=67)
  src = sources(vocab=67)

  def run(min_blocks):
    monkeypatch.setattr(topk, 'MIN_BLOCKS_PER_K', min_blocks)
    jax.clear_caches()  # the constant is read while tracing
    tokens, scores = decode.beam_search(m, params, src, max_decode_len=14)
    sampled = decode.sample(m, params, src, jax.random.key(3), top_k=5,
                            max_decode_len=14)
    return [np.asarray(x) for x in (tokens, scores, sampled)]

  scanned, blocked = run(10**9), run(1)
  for want, got in zip(scanned, blocked):
    np.testing.assert_array_equal(got, want)
  assert len(set(scanned[0][:, 0])) > 1 and (scanned[2] != scanned[0]).any()


def test_reading_only_the_filled_cache_slots_changes_no_output(monkeypatch):
  """With the cache read up to the chunk bound at or above the filled slots
  (a lax.switch per step), every decoder gives what reading the whole cache
  gives: greedy, both beam searches (the beams' parts of a shared block),
  sampling and the cached teacher-forced logits, with scanned layers, under
  ALiBi (cached key positions, cut as the keys are) and with one shared KV
  head (the plain model under a mesh: tests/sharding_checks.py)."""
  from xfmr_jax import attention, hf_beam
  src = sources()
  targets = np.random.default_rng(2).integers(2, 17, (4, 14)).astype(np.int32)

  def run(m, params, min_bytes):
    monkeypatch.setattr(attention, 'MIN_CHUNK_BYTES', min_bytes)
    monkeypatch.setattr(attention, 'MIN_CACHE_CHUNK', 4)  # 14 slots: 4 bounds
    jax.clear_caches()  # the constants are read while tracing
    outs = [decode.greedy_decode(m, params, src, max_decode_len=14),
            *decode.beam_search(m, params, src, max_decode_len=14),
            *hf_beam.beam_search(m, params, src, max_decode_len=14),
            decode.sample(m, params, src, jax.random.key(1),
                          max_decode_len=14),
            decode.cached_logits(m, params, src, targets)]
    return [np.asarray(x) for x in outs]

  m, params = build('pre_scan', positional='alibi', num_kv_heads=1)
  whole, filled = run(m, params, 10**12), run(m, params, 0)
  for want, got in zip(whole, filled):
    if want.dtype == np.int32:
      np.testing.assert_array_equal(got, want)
    else:
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert len(np.unique(whole[0])) > 3


@pytest.mark.parametrize('variant,changes', [
    ('pre_scan', {}), ('post', dict(positional='alibi')),
    pytest.param('post', dict(positional='rope', num_kv_heads=1),
                 marks=pytest.mark.slow)])
def test_beam_hypotheses_read_their_own_history(variant, changes):
  """Beam search never moves the self-attention cache: each beam row
  appends its keys/values and a table says which row holds each slot of a
  beam's history. Every returned score is the teacher-forced log p of its
  tokens, so each beam attended over its own prefix, with the layers
  scanned, under ALiBi (cached key positions), RoPE and one shared KV head."""
  m, params = build(variant, **dict(changes))
  src = sources()
  tokens, scores = decode.beam_search(m, params, src, beam_size=3,
                                      max_decode_len=12)
  check_layout(tokens)
  log_probs = teacher_forced_log_probs(m, params, src, np.asarray(tokens))
  for row in range(len(src)):
    np.testing.assert_allclose(
        scores[row], sequence_score(log_probs[row], np.asarray(tokens[row]),
                                    0.6), atol=1e-4)


def test_beams_share_their_sentence_cross_attention_row():
  """``beam_cache.expand`` keeps the cross-attention K/V once per sentence;
  a step of 3 beam rows per sentence gives the logits of the same step over
  a cache copied to every row."""
  m, params = build('pre_scan')
  src, g, length = sources(), 3, 6
  variables = {'params': params}
  _, state = m.apply(variables, src, length, method=m.init_cache,
                     mutable=['cache'])
  shared = beam_cache.expand(m, state['cache'], g)
  copied = jax.tree.map(lambda x: jnp.repeat(x, g, axis=1), state['cache'])
  cross = lambda c: c['decoder']['cross_attention']['cached_key']
  assert cross(shared).shape[1] == len(src)
  assert cross(copied).shape[1] == len(src) * g
  rows = np.repeat(src, g, axis=0)
  tokens = np.arange(rows.shape[0], dtype=np.int32)[:, None] % 5 + 2
  step = lambda c: m.apply({**variables, 'cache': c}, rows, tokens, 0,
                           cache_len=length, method=m.decode_step,
                           mutable=['cache'])[0]
  np.testing.assert_allclose(step(shared), step(copied), rtol=1e-5, atol=1e-5)


def test_greedy_batch_equals_single_sentences():
  m, params = build('post')
  src = sources()
  batch = np.asarray(decode.greedy_decode(m, params, src, max_decode_len=14))
  perm = [3, 2, 0, 1]
  np.testing.assert_array_equal(
      decode.greedy_decode(m, params, src[perm], max_decode_len=14),
      batch[perm])
  # Alone and without its padding (another shape, so one more compilation).
  assert np.all(src[1, 5:] == 0)
  alone = decode.greedy_decode(m, params, src[1:2, :5], max_decode_len=14)
  np.testing.assert_array_equal(alone[0], batch[1])


def test_same_bucket_compiles_once():
  m, params = build('post')
  before = decode.TRACE_COUNTS['greedy_decode']
  for seed in range(3):  # new contents, same padded shape
    decode.greedy_decode(m, params, sources(3, 5, seed=seed))
  assert decode.TRACE_COUNTS['greedy_decode'] - before == 1
  # Default length: input length + 50, capped by max_len.
  assert decode.decode_length(m.config, 5) == 32
  assert decode.decode_length(config.toy(), 5) == 55


# ---------------------------------------------------------------- sampling --

def test_sampling_is_seeded_and_respects_top_k():
  m, params = build('post')
  src = sources()
  draw = lambda seed: np.asarray(decode.sample(
      m, params, src, jax.random.key(seed), top_k=3, max_decode_len=14))
  first = draw(0)
  np.testing.assert_array_equal(first, draw(0))
  assert not np.array_equal(first, draw(1))
  check_layout(first)
  # Every emitted token is among the 3 most likely (pad excluded) there.
  log_probs = teacher_forced_log_probs(m, params, src, first)
  third = np.sort(log_probs, axis=-1)[..., -3]
  chosen = np.take_along_axis(log_probs, first[..., None], -1)[..., 0]
  real = first != 0
  assert np.all(chosen[real] >= third[real])


def test_top_k_one_sampling_is_greedy():
  m, params = build('post')
  src = sources()
  np.testing.assert_array_equal(
      decode.sample(m, params, src, jax.random.key(3), top_k=1,
                    max_decode_len=14),
      decode.greedy_decode(m, params, src, max_decode_len=14))


def test_filter_logits_temperature_top_k_top_p():
  logits = jnp.log(jnp.asarray([[0.1, 0.5, 0.15, 0.25]]))
  kept = lambda **kw: np.isfinite(decode._filter_logits(logits, **kw))[0]
  everything = dict(temperature=1.0, top_k=0, top_p=1.0)
  assert kept(**everything).all()
  assert list(kept(**{**everything, 'top_k': 2})) == [0, 1, 0, 1]
  # Nucleus: the fewest most-likely tokens with mass >= p; never empty.
  assert list(kept(**{**everything, 'top_p': 0.7})) == [0, 1, 0, 1]
  assert list(kept(**{**everything, 'top_p': 0.76})) == [0, 1, 1, 1]
  assert list(kept(**{**everything, 'top_p': 1e-6})) == [0, 1, 0, 0]
  scaled = decode._filter_logits(logits, 0.5, 0, 1.0)
  np.testing.assert_allclose(scaled, logits * 2, rtol=1e-6)


# ---------------------------------------------------------- attention maps --

@pytest.mark.parametrize('variant', ['post', 'pre_scan'])
def test_attention_maps(variant):
  m, params = build(variant)
  src = sources()
  out = np.asarray(decode.greedy_decode(m, params, src, max_decode_len=14))
  maps = decode.attention_maps(m, params, src, out)
  assert maps['encoder_self'].shape == (2, 4, 2, 7, 7)
  assert maps['decoder_self'].shape == (2, 4, 2, 14, 14)
  cross = np.asarray(maps['decoder_cross'])
  assert cross.shape == (2, 4, 2, 14, 7)
  real = np.broadcast_to((out != 0)[None, :, None, :], cross.shape[:-1])
  np.testing.assert_allclose(cross.sum(-1), np.where(real, 1.0, 0.0),
                             atol=1e-5)
  # No weight on padded source positions.
  assert np.all(cross * (src == 0)[None, :, None, None, :] == 0)


def _cache_transposes(jaxpr, shapes, in_loop=False, found=None):
  """Transposes, inside while loops, of an array of one of ``shapes``."""
  found = [] if found is None else found
  for eqn in jaxpr.eqns:
    if in_loop and eqn.primitive.name == 'transpose' and \
        eqn.invars[0].aval.shape in shapes:
      found.append(eqn.invars[0].aval.shape)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      _cache_transposes(sub, shapes, in_loop or eqn.primitive.name == 'while',
                        found)
  return found


@pytest.mark.parametrize('impl', ['reference', 'xla'])
def test_decoding_steps_read_the_heads_first_cache_without_transposing_it(
    impl):
  """Whatever the attention implementation, a cached step's attention reads
  the [batch, kv_heads, slots, head_dim] cache as it lies."""
  m, params = build('post', attention_impl=impl)
  src = sources()
  greedy = lambda p, x: decode.greedy_decode(m, p, x, max_decode_len=14)
  heads, d = TINY['num_heads'], TINY['d_model'] // TINY['num_heads']
  cache_shapes = ((4, heads, 14, d), (4, heads, 7, d))  # self, cross
  jaxpr = jax.make_jaxpr(greedy)(params, src)
  assert _cache_transposes(jaxpr.jaxpr, cache_shapes) == []
  # The probe sees such a transpose where one is written.
  probe = jax.make_jaxpr(lambda k: jax.lax.while_loop(
      lambda c: c[1] < 2, lambda c: (c[0].transpose(0, 2, 1, 3).transpose(
          0, 2, 1, 3), c[1] + 1), (k, 0)))(jnp.zeros(cache_shapes[0]))
  assert len(_cache_transposes(probe.jaxpr, cache_shapes)) == 1
  ref, ref_params = build('post')
  np.testing.assert_array_equal(
      greedy(params, src),
      decode.greedy_decode(ref, ref_params, src, max_decode_len=14))


def test_logsumexp_matches_float64_and_keeps_masked_rows():
  rng = np.random.default_rng(3)
  x = (rng.standard_normal((5, 3001)) * 8).astype(np.float32)
  x[1, :7] = -np.inf           # a banned pad id and more
  x[2] += 80.0                 # large logits: no overflow
  x[4] = -np.inf               # nothing allowed: -inf, not NaN
  got = np.asarray(jax.jit(decode.logsumexp)(jnp.asarray(x)))
  assert got.shape == (5, 1) and got.dtype == np.float32
  with np.errstate(divide='ignore'):
    x64 = x.astype(np.float64)
    m = x64[:4].max(-1, keepdims=True)
    want = m + np.log(np.exp(x64[:4] - m).sum(-1, keepdims=True))
  np.testing.assert_allclose(got[:4], want, rtol=1e-6)
  assert got[4, 0] == -np.inf
  # Given the row maximum (as a beam step knows it from its top-k).
  given = np.asarray(jax.jit(decode.logsumexp)(
      jnp.asarray(x), jnp.asarray(x.max(-1, keepdims=True))))
  np.testing.assert_array_equal(given, got)
