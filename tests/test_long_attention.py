"""Local (sliding-window) and linear attention: the functions against float64
NumPy, their decoding forms against their parallel forms, and the models that
use them (cached decoding, padding, packing, training, bad settings)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import reference, test_variants
from xfmr_jax import (attention, config, decode, decode_steps,
                      linear_attention, local_attention, masks, model,
                      train_state, train_steps)

B, N, H, KV, D = 2, 13, 4, 2, 8
# Jitted once per static setting: eager dispatch of their many small ops
# would cost most of this file's time.
local = jax.jit(local_attention.local_attention,
                static_argnames=('window', 'causal', 'global_tokens'))
cached_local = jax.jit(local_attention.cached_attention,
                       static_argnames=('window', 'global_tokens'))
linear = jax.jit(linear_attention.linear_attention,
                 static_argnames=('causal', 'chunk'))


def qkv(seed, n=N, heads=H, kv_heads=KV, d=D):
  r = np.random.default_rng(seed)
  return (r.standard_normal((B, n, heads, d)).astype(np.float32),
          r.standard_normal((B, n, kv_heads, d)).astype(np.float32),
          r.standard_normal((B, n, kv_heads, d)).astype(np.float32))


# Row 0: two packed segments and padding; row 1: one segment, padded.
SEGMENTS = np.array([[1] * 6 + [2] * 5 + [0] * 2, [1] * 11 + [0] * 2],
                    np.int32)


# ------------------------------------------------------------------ local --

@pytest.mark.parametrize('window, causal, global_tokens', [
    (1, True, 0), (3, True, 0), (3, False, 0), (4, False, 2), (2, True, 3),
    (5, False, 0)])
def test_local_matches_float64_reference(window, causal, global_tokens):
  q, k, v = qkv(window)
  got = local(
      q, k, v, SEGMENTS, window=window, causal=causal,
      global_tokens=global_tokens)
  mask = reference.local_mask(SEGMENTS, window, causal, global_tokens)
  want = reference.masked_attention(q, k, v, mask)
  np.testing.assert_allclose(got, want, atol=2e-6)
  assert np.all(np.asarray(got)[SEGMENTS == 0] == 0)  # padding sees nothing


@pytest.mark.parametrize('causal', [True, False])
def test_local_with_a_window_covering_the_row_is_full_attention(causal):
  q, k, v = qkv(1)
  mask = masks.SelfMask(jnp.asarray(SEGMENTS), causal)
  full = attention.dot_product_attention(q, k, v, mask.dense())
  for window in (N - 1, N, 40):
    banded = local(q, k, v, SEGMENTS, window=window,
                                            causal=causal)
    np.testing.assert_allclose(banded, full, atol=1e-6)


def test_local_memory_grows_with_n_times_window():
  """No intermediate of the blockwise form is n x n: the largest grows
  linearly in n at a fixed window."""
  def largest(n):
    q = jnp.zeros((1, n, 2, 8))
    seg = jnp.ones((1, n), jnp.int32)
    fn = lambda q: local_attention.local_attention(q, q, q, seg, window=16,
                                                   causal=False).sum()
    jaxpr = jax.make_jaxpr(jax.grad(fn))(q)
    return max(int(np.prod(v.aval.shape)) for eqn in jaxpr.eqns
               for v in eqn.outvars)
  small, big = largest(256), largest(1024)
  assert big <= 4.5 * small, (small, big)     # linear, not quadratic
  assert big < 1024 * 1024, big              # far below one n x n matrix


@pytest.mark.parametrize('causal', [True, False])
def test_fused_local_window_equals_the_blockwise_form(causal):
  """jax.nn.dot_product_attention(local_window_size=...) (the fused path
  'xla' / 'cudnn' take) computes the same thing."""
  q, k, v = qkv(2)
  fused = local_attention.fused_local_attention(
      q, k, v, jnp.asarray(SEGMENTS), window=3, causal=causal,
      implementation='xla')
  blockwise = local(q, k, v, SEGMENTS, window=3,
                                              causal=causal)
  np.testing.assert_allclose(fused, blockwise, atol=1e-6)


@pytest.mark.parametrize('window, global_tokens', [(3, 0), (2, 3)])
def test_local_cache_step_by_step_equals_the_parallel_form(window,
                                                           global_tokens):
  """The ring buffer (plus the global slots), fed in pieces of 1, 5 and 3
  tokens, gives the causal outputs of the whole row at once."""
  q, k, v = qkv(3, n=9)
  seg = np.ones((B, 9), np.int32)
  seg[1, 2] = 0  # a hidden key (e.g. source padding) in the middle
  want = local(q, k, v, seg, window=window,
                                         causal=True,
                                         global_tokens=global_tokens)
  cache = local_attention.init_cache(B, KV, D, window=window,
                                     global_tokens=global_tokens,
                                     dtype=jnp.float32)
  pieces, start = [], 0
  for size in (1, 5, 3):
    sl = slice(start, start + size)
    pos = jnp.broadcast_to(jnp.arange(start, start + size), (B, size))
    out, cache = cached_local(
        cache, q[:, sl], k[:, sl], v[:, sl], jnp.asarray(seg[:, sl] > 0), pos,
        start, window=window, global_tokens=global_tokens)
    pieces.append(out)
    start += size
  got = np.concatenate(pieces, axis=1)
  real = seg > 0  # a hidden query's own output is not compared
  np.testing.assert_allclose(got[real], np.asarray(want)[real], atol=1e-6)
  assert cache['key'].shape[1] == global_tokens + window


# ----------------------------------------------------------------- linear --

def _features(name, q, k, m=32):
  if name == 'elu':
    return (linear_attention.elu_features(q), linear_attention.elu_features(k),
            reference.elu_plus_one(q), reference.elu_plus_one(k))
  w = linear_attention.favor_projection(jax.random.key(0), m, q.shape[-1])
  return (linear_attention.favor_features(q, w, is_query=True),
          linear_attention.favor_features(k, w, is_query=False),
          reference.favor(q, w, True), reference.favor(k, w, False))


@pytest.mark.parametrize('feature_map', ['elu', 'favor'])
@pytest.mark.parametrize('causal', [True, False])
@pytest.mark.parametrize('chunk', [1, 4, 64])
def test_linear_matches_float64_reference(feature_map, causal, chunk):
  q, k, v = qkv(4)
  qf, kf, qf64, kf64 = _features(feature_map, q, k)
  out = linear(qf, kf, v, jnp.asarray(SEGMENTS),
                                          causal=causal, chunk=chunk)
  out = out[0] if causal else out
  want = reference.linear_attention(qf64, kf64, v,
                                    reference.segment_mask(SEGMENTS, causal))
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)
  assert np.all(np.asarray(out)[SEGMENTS == 0] == 0)


def test_favor_features_follow_the_formula():
  q, k, _ = qkv(5)
  w = linear_attention.favor_projection(jax.random.key(1), 24, D)
  # Keys: the formula exactly; queries: up to their own positive factor.
  np.testing.assert_allclose(
      linear_attention.favor_features(k, w, is_query=False),
      reference.favor(k, w, False), rtol=1e-5)
  ratio = (np.asarray(linear_attention.favor_features(q, w, is_query=True),
                      np.float64) / reference.favor(q, w, True))
  np.testing.assert_allclose(ratio, ratio[..., :1] * np.ones_like(ratio),
                             rtol=1e-4)


def test_favor_projection_is_orthogonal_in_blocks_and_redrawable():
  w = np.asarray(linear_attention.favor_projection(jax.random.key(0), 20, 8))
  assert w.shape == (20, 8)
  unit = w / np.linalg.norm(w, axis=-1, keepdims=True)
  np.testing.assert_allclose(unit[:8] @ unit[:8].T, np.eye(8), atol=1e-5)
  np.testing.assert_allclose(unit[8:16] @ unit[8:16].T, np.eye(8), atol=1e-5)
  same = linear_attention.favor_projection(jax.random.key(0), 20, 8)
  other = linear_attention.favor_projection(jax.random.key(1), 20, 8)
  np.testing.assert_array_equal(w, same)
  assert np.abs(w - np.asarray(other)).max() > 0.1


def favor_error(num_features, seeds=4):
  """Mean relative error of bidirectional FAVOR+ attention against exact
  softmax attention over ``seeds`` projection seeds (fixed data)."""
  r = np.random.default_rng(0)
  q, k, v = (0.5 * r.standard_normal((1, 64, 2, 16)).astype(np.float32)
             for _ in range(3))
  seg = jnp.ones((1, 64), jnp.int32)

  @jax.jit
  def run(seed):
    w = linear_attention.favor_projection(jax.random.key(seed), num_features,
                                          16)
    return linear(
        linear_attention.favor_features(q, w, is_query=True),
        linear_attention.favor_features(k, w, is_query=False), v, seg,
        causal=False)
  exact = reference.attention(q, k, v)
  return float(np.mean([reference.rel_err(run(s), exact)
                        for s in range(seeds)]))


@pytest.mark.slow
def test_favor_error_falls_as_features_grow():
  """Measured (seeds 0-3): 0.56, 0.30, 0.19 and 0.14 for 16, 64, 256 and
  1024 features."""
  errors = [favor_error(m) for m in (16, 64, 256, 1024)]
  assert all(a > 1.25 * b for a, b in zip(errors, errors[1:])), errors
  assert errors[-1] < 0.16, errors


@pytest.mark.parametrize('feature_map', ['elu', 'favor'])
def test_linear_recurrent_decoding_equals_the_parallel_causal_form(
    feature_map):
  """Token by token from the state (S, z), as cached decoding runs it."""
  q, k, v = qkv(6, n=10)
  qf, kf, _, _ = _features(feature_map, q, k)
  visible = np.ones((B, 10), np.int32)
  visible[0, 3] = 0  # a hidden key
  want, final = linear(qf, kf, v, visible,
                                                  causal=True, chunk=4)
  state = linear_attention.init_state(B, KV, qf.shape[-1], D)
  outs = []
  for t in range(10):
    out, state = linear(
        qf[:, t:t + 1], kf[:, t:t + 1], v[:, t:t + 1], visible[:, t:t + 1],
        causal=True, state=state)
    outs.append(out)
  got = np.concatenate(outs, axis=1)
  real = visible > 0
  np.testing.assert_allclose(got[real], np.asarray(want)[real], rtol=1e-5,
                             atol=1e-6)
  for a, b in zip(state, final):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert state[0].shape == (B, KV, qf.shape[-1], D)  # O(1) in the length


# ----------------------------------------------------------------- models --

KINDS = {
    'local': dict(attention_kind='local', attention_window=2),
    'local_global_alibi_gqa': dict(attention_kind='local', attention_window=3,
                                   attention_global_tokens=2,
                                   positional='alibi', num_kv_heads=2),
    'local_xla_pre_scan': dict(attention_kind='local', attention_window=2,
                               attention_impl='xla', norm_position='pre',
                               scan_layers=True),
    'linear_elu': dict(attention_kind='linear'),
    'linear_favor_rope_gqa_peri': dict(
        attention_kind='linear', linear_feature_map='favor', favor_features=16,
        positional='rope', num_kv_heads=2, norm_position='peri'),
}


@functools.lru_cache(maxsize=None)
def build(**changes):
  """A tiny model, its params and its jitted ``apply(params, *args, **kw)``."""
  m, params = test_variants.build(**{'num_encoder_layers': 1, **changes})
  return m, params, jax.jit(lambda p, *a, **kw: m.apply({'params': p}, *a, **kw))


def batch(seed=0, b=3, s=9, t=11):
  r = np.random.default_rng(seed)
  inputs = r.integers(3, 24, (b, s)).astype(np.int32)
  targets = r.integers(3, 24, (b, t)).astype(np.int32)
  inputs[0, s - 3:] = 0
  targets[0, t - 4:] = 0
  return inputs, targets


def assert_close_where_real(a, b, targets, atol):
  real = (np.asarray(targets) != 0)[..., None]
  np.testing.assert_allclose(np.where(real, a, 0), np.where(real, b, 0),
                             atol=atol)


# The two richest kinds are quick tests (encoder-decoder; their decoder-only
# models are slow cases), the others are marked slow.
CORE = ('local_global_alibi_gqa', 'linear_favor_rope_gqa_peri')


@pytest.mark.parametrize('model_kind', [
    'encoder_decoder', pytest.param('decoder_only', marks=pytest.mark.slow)])
@pytest.mark.parametrize('kind', [
    k if k in CORE else pytest.param(k, marks=pytest.mark.slow)
    for k in KINDS])
def test_cached_decoding_equals_the_full_model(model_kind, kind):
  m, params, apply = build(model_kind=model_kind, **KINDS[kind])
  inputs, targets = batch()
  cached = decode.cached_logits(m, params, inputs, targets)
  assert_close_where_real(cached, apply(params, inputs, targets), targets,
                          atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize('model_kind, kind', [
    ('decoder_only', 'local_global_alibi_gqa'),
    ('encoder_decoder', 'linear_favor_rope_gqa_peri')])
def test_greedy_decoding_equals_recomputing_everything(model_kind, kind):
  m, params, _ = build(model_kind=model_kind, **KINDS[kind])
  inputs, _ = batch()
  greedy = decode.greedy_decode(m, params, inputs, max_decode_len=12)
  np.testing.assert_array_equal(
      greedy, decode.naive_greedy_decode(m, params, inputs, max_decode_len=12))


@pytest.mark.parametrize('kind', ['local_global_alibi_gqa',
                                  'linear_favor_rope_gqa_peri'])
def test_cache_does_not_grow_with_the_output(kind):
  m, params, _ = build(**KINDS[kind])
  inputs, _ = batch()
  sizes = [sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(
      jax.eval_shape(lambda: decode_steps.init_cache(m, {'params': params}, inputs,
                                                      n)))
               if 'self_attention' in jax.tree_util.keystr(p))
           for n in (8, 64)]
  assert sizes[0] == sizes[1] > 0


@pytest.mark.slow
def test_beam_search_reorders_the_ring_buffer():
  """Every cache leaf has a batch axis, so beams copy and reorder it; one
  beam is greedy decoding."""
  m, params, _ = build(**KINDS['local_global_alibi_gqa'])
  inputs, _ = batch()
  beam, _ = decode.beam_search(m, params, inputs, beam_size=1, alpha=0.0,
                               max_decode_len=10)
  np.testing.assert_array_equal(
      beam, decode.greedy_decode(m, params, inputs, max_decode_len=10))


@pytest.mark.parametrize('kind', [
    'local', pytest.param('linear_elu', marks=pytest.mark.slow)])
def test_padding_changes_nothing(kind):
  """More padding on the source and the targets leaves the real logits of
  the encoder-decoder unchanged (and linear attention's decoder-only model
  too: no distance enters it)."""
  inputs, targets = batch()
  kinds = ['encoder_decoder'] + (['decoder_only'] if kind == 'linear_elu'
                                 else [])
  for model_kind in kinds:
    _, params, apply = build(model_kind=model_kind, **KINDS[kind])
    run = functools.partial(apply, params)
    padded = run(jnp.pad(inputs, ((0, 0), (0, 7))),
                 jnp.pad(targets, ((0, 0), (0, 5))))[:, :targets.shape[1]]
    assert_close_where_real(padded, run(inputs, targets), targets, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['local', 'linear_favor_rope_gqa_peri'])
def test_packed_segments_do_not_leak(kind):
  """A packed row gives each sequence the logits it has alone, in the
  encoder-decoder (encoder and decoder self-attention) and the encoder-only
  model; the second sequence starts mid-chunk. (Global tokens are the first
  slots of a row, so in a packed row only its first sequence has them.)"""
  _, params, apply = build(**KINDS[kind])
  a_in, a_out = np.array([[5, 6, 7, 8, 9, 1]]), np.array([[8, 9, 10, 11, 1]])
  b_in, b_out = np.array([[10, 11, 12, 1]]), np.array([[12, 13, 14, 15, 1]])
  cat = lambda x, y: jnp.asarray(np.concatenate([x, y], 1))
  ids = lambda x, y: cat(np.full_like(x, 1), np.full_like(y, 2))
  pos = lambda x, y: cat(np.arange(x.shape[1])[None],
                         np.arange(y.shape[1])[None])
  packed = apply(params, cat(a_in, b_in), cat(a_out, b_out),
                 inputs_segmentation=ids(a_in, b_in),
                 targets_segmentation=ids(a_out, b_out),
                 inputs_position=pos(a_in, b_in),
                 targets_position=pos(a_out, b_out))
  np.testing.assert_allclose(packed[:, :5], apply(params, a_in, a_out),
                             atol=1e-5)
  np.testing.assert_allclose(packed[:, 5:], apply(params, b_in, b_out),
                             atol=1e-5)
  _, tag_params, tag_apply = build(model_kind='encoder_only', num_labels=3,
                                   **KINDS[kind])
  run = lambda x, **kw: tag_apply(tag_params, x, **kw)
  packed = run(cat(a_in, b_in), inputs_segmentation=ids(a_in, b_in),
               inputs_position=pos(a_in, b_in))
  np.testing.assert_allclose(packed[:, :6], run(a_in), atol=1e-5)
  np.testing.assert_allclose(packed[:, 6:], run(b_in), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['local_global_alibi_gqa', 'linear_elu'])
def test_trains_with_dropout(kind):
  m, params, _ = build(**KINDS[kind])
  m = model.build(m.config.replace(dropout_rate=0.1, attention_dropout_rate=(
      0.1 if kind.startswith('local') else 0.0)))
  inputs, targets = batch(b=4)
  tx = optax.adam(3e-3)
  state = train_state.TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
      rng=jax.random.key_data(jax.random.key(0)),
      bad_step=jnp.full((), -1, jnp.int32))
  step, _ = train_steps.jit_steps(m, tx, label_smoothing=0.0)
  losses = []
  for _ in range(20):
    state, metrics = step(state, dict(inputs=inputs, targets=targets))
    losses.append(float(metrics['loss'] / metrics['tokens']))
  assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize('changes, message', [
    (dict(attention_kind='sparse'), 'attention_kind'),
    (dict(attention_kind='local'), 'attention_window >= 1'),
    (dict(attention_kind='local', attention_window=-2), 'attention_window'),
    (dict(attention_window=4), "for attention_kind='local'"),
    (dict(attention_global_tokens=2), "for attention_kind='local'"),
    (dict(attention_kind='local', attention_window=4,
          attention_impl='pallas'), 'no Pallas kernel'),
    (dict(attention_kind='local', attention_window=4,
          attention_global_tokens=1, attention_impl='xla'), 'blockwise only'),
    (dict(attention_kind='linear', positional='alibi'), 'ALiBi'),
    (dict(attention_kind='linear', attention_dropout_rate=0.1), 'drop out'),
    (dict(attention_kind='linear', attention_impl='xla'), 'one implementation'),
    (dict(attention_kind='linear', linear_feature_map='relu'),
     'linear_feature_map'),
    (dict(linear_feature_map='favor'), "for attention_kind='linear'"),
    (dict(attention_kind='linear', favor_features=64), "linear_feature_map="),
    (dict(norm_position='sandwich'), 'norm_position'),
])
def test_bad_settings_are_clear_errors(changes, message):
  with pytest.raises(ValueError, match=message):
    config.ModelConfig(**changes)


def test_attention_maps_refuse_local_and_linear_attention():
  """They form no weight matrix to draw."""
  m, params, _ = build(**KINDS['local'])
  inputs, targets = batch()
  with pytest.raises(ValueError, match='full attention'):
    decode.attention_maps(m, params, inputs, targets)


def test_a_workdir_from_before_these_fields_still_resumes():
  """Its saved config lacks attention_kind & co.: they held their defaults."""
  from experiments.configs import toy
  from xfmr_jax import run_config
  here = toy.get_config().to_dict()
  old = {**here, 'model': {k: v for k, v in here['model'].items()
                           if not k.startswith(('attention_kind', 'attention_w',
                                                'attention_g', 'linear_',
                                                'favor_'))}}
  run_config.check_resumable(old, here, 'workdir')  # no error
  local = {**here, 'model': {**here['model'], 'attention_kind': 'local',
                             'attention_window': 8}}
  with pytest.raises(run_config.ConfigError, match='attention_kind'):
    run_config.check_resumable(old, local, 'workdir')
