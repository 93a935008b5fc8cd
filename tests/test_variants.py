"""The later variants: RoPE, ALiBi, GQA/MQA, SwiGLU, bias-free layers, the
decoder-only and encoder-only models, and the attention implementations."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import reference
from xfmr_jax import attention, config, decode, decode_steps, layers, model
from xfmr_jax import positional, token_ids, train_state, train_steps

TINY = dict(vocab_size=24, d_model=32, num_heads=4, d_ff=64,
            num_encoder_layers=2, num_decoder_layers=2, max_len=64,
            dropout_rate=0.0, share_embeddings=False)


def np_rotary(x, positions):
  """RoPE written out pair by pair, float64."""
  x = np.asarray(x, np.float64)
  out = np.empty_like(x)
  d = x.shape[-1]
  for i in range(d // 2):
    angle = positions[..., None] * 10000.0 ** (-2 * i / d)  # [b, l, 1]
    a, b = x[..., 2 * i], x[..., 2 * i + 1]
    out[..., 2 * i] = a * np.cos(angle) - b * np.sin(angle)
    out[..., 2 * i + 1] = a * np.sin(angle) + b * np.cos(angle)
  return out


@functools.lru_cache(maxsize=None)
def build(**changes):
  """A tiny model (any kind) and its float32 params."""
  cfg = config.ModelConfig(**{**TINY, **changes})
  m = model.build(cfg)
  dummy = jnp.ones((1, 4), jnp.int32)
  params = nn.unbox(jax.jit(m.init)(jax.random.key(3), dummy, dummy))['params']
  return m, params


def example_batch(seed=0, batch=3, s=7, t=6, vocab=24):
  rng = np.random.default_rng(seed)
  inputs = rng.integers(3, vocab, (batch, s)).astype(np.int32)
  targets = rng.integers(3, vocab, (batch, t)).astype(np.int32)
  inputs[0, s - 2:] = 0
  targets[0, t - 2:] = 0
  inputs[1, -1] = token_ids.EOS
  return jnp.asarray(inputs), jnp.asarray(targets)


# -------------------------------------------------------------------- RoPE --

def test_rotary_matches_the_formula(rng):
  x = rng.normal(size=(2, 5, 3, 8))
  pos = rng.integers(0, 60, (2, 5))
  got = positional.rotary(jnp.asarray(x, jnp.float32), jnp.asarray(pos))
  np.testing.assert_allclose(got, np_rotary(x, pos), atol=2e-5)


def test_rope_scores_depend_only_on_the_relative_offset(rng):
  q = jnp.asarray(rng.normal(size=(1, 6, 2, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 6, 2, 16)), jnp.float32)
  m = jnp.asarray([[0, 3, 5, 9, 10, 20]])
  n = jnp.asarray([[1, 2, 8, 4, 30, 0]])
  scores = lambda a, b: jnp.einsum('bqhd,bkhd->bhqk', positional.rotary(q, a),
                                   positional.rotary(k, b))
  base = scores(m, n)
  for shift in (1, 7, 50):
    np.testing.assert_allclose(scores(m + shift, n + shift), base, atol=1e-4)
  # ... and they do depend on the offset.
  assert float(jnp.max(jnp.abs(scores(m, n + 1) - base))) > 0.1


def test_rope_model_ignores_a_common_shift_of_all_positions():
  """Under RoPE (and ALiBi) nothing absolute enters: shifting every position
  by k leaves an encoder's output unchanged; sinusoids do not."""
  inputs, _ = example_batch()
  positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
  for scheme, invariant in (('rope', True), ('alibi', True),
                            ('sinusoidal', False)):
    m, params = build(model_kind='encoder_only', num_labels=5,
                      positional=scheme)
    run = lambda pos: m.apply({'params': params}, inputs, inputs_position=pos)
    diff = float(jnp.max(jnp.abs(run(positions + 13) - run(positions))))
    assert (diff < 1e-4) == invariant, (scheme, diff)


# ------------------------------------------------------------------- ALiBi --

def test_alibi_slopes_follow_the_paper():
  np.testing.assert_allclose(positional.alibi_slopes(8),
                             [2.0 ** -i for i in range(1, 9)])
  np.testing.assert_allclose(positional.alibi_slopes(4),
                             [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8])
  # 6 heads: the 4-head slopes, then every other slope of 8 heads.
  np.testing.assert_allclose(positional.alibi_slopes(6),
                             [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8,
                              2.0 ** -1, 2.0 ** -3])


def test_alibi_bias_matches_the_formula(rng):
  qpos = rng.integers(0, 40, (2, 5))
  kpos = rng.integers(0, 40, (2, 7))
  got = np.asarray(positional.alibi_bias(jnp.asarray(qpos), jnp.asarray(kpos),
                                         4))
  slopes = positional.alibi_slopes(4)
  for b in range(2):
    for h in range(4):
      for i in range(5):
        for j in range(7):
          want = -slopes[h] * abs(qpos[b, i] - kpos[b, j])
          assert got[b, h, i, j] == pytest.approx(want, rel=1e-6, abs=1e-6)


# ----------------------------------------------------------------- GQA/MQA --

def test_gqa_with_as_many_kv_heads_as_heads_is_mha():
  inputs, targets = example_batch()
  mha, params = build()
  gqa, gqa_params = build(num_kv_heads=4)
  assert (jax.tree.map(jnp.shape, params) ==
          jax.tree.map(jnp.shape, gqa_params))
  np.testing.assert_allclose(gqa.apply({'params': params}, inputs, targets),
                             mha.apply({'params': params}, inputs, targets),
                             atol=1e-6)


def _repeat_kv(tree, group, head_dim):
  """GQA params -> MHA params: each K/V head's weights copied to its group."""
  def fix(path, x):
    names = [getattr(p, 'key', '') for p in path]
    if 'key' not in names and 'value' not in names:
      return x
    *lead, width = x.shape
    x = x.reshape(*lead, width // head_dim, head_dim)
    return jnp.repeat(x, group, axis=-2).reshape(*lead, width * group)
  return jax.tree_util.tree_map_with_path(fix, tree)


@pytest.mark.parametrize('kv_heads', [2, 1])
def test_gqa_equals_mha_with_each_kv_head_shared_by_its_group(kv_heads):
  inputs, targets = example_batch()
  gqa, params = build(num_kv_heads=kv_heads)
  mha, _ = build()
  want = mha.apply({'params': _repeat_kv(params, 4 // kv_heads, 8)}, inputs,
                   targets)
  np.testing.assert_allclose(gqa.apply({'params': params}, inputs, targets),
                             want, atol=1e-5)


@pytest.mark.parametrize('kind', ['encoder_decoder', 'decoder_only'])
def test_gqa_and_mqa_caches_hold_only_the_kv_heads(kind):
  inputs, _ = example_batch()
  sizes = {}
  for kv_heads in (0, 2, 1):
    m, params = build(model_kind=kind, num_kv_heads=kv_heads)
    cache = decode_steps.init_cache(m, {'params': params}, inputs, 10)
    keys = [x for p, x in jax.tree_util.tree_leaves_with_path(cache)
            if 'cached_key' in jax.tree_util.keystr(p)]
    # [batch, kv_heads, slots, head_dim]
    assert keys and all(k.shape[1] == (kv_heads or 4) for k in keys)
    sizes[kv_heads] = sum(x.size for x in jax.tree.leaves(cache))
  assert sizes[0] == 2 * sizes[2] == 4 * sizes[1]


# --------------------------------------------------- attention back-ends --

def test_xla_attention_equals_the_reference(rng):
  q = rng.normal(size=(2, 5, 4, 8)).astype(np.float32)
  k = rng.normal(size=(2, 7, 2, 8)).astype(np.float32)   # GQA: 2 KV heads
  v = rng.normal(size=(2, 7, 2, 8)).astype(np.float32)
  mask = rng.random((2, 1, 5, 7)) < 0.7
  mask[0, 0, 1] = False                                   # a fully masked row
  bias = positional.alibi_bias(jnp.arange(5)[None], jnp.arange(7)[None], 4)
  args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
  ref = attention.dot_product_attention(*args, bias)
  xla = attention.dot_product_attention(*args, bias, implementation='xla')
  np.testing.assert_allclose(xla, ref, atol=1e-5)
  assert np.all(np.asarray(xla)[0, 1] == 0)
  # Both against float64 NumPy, with the KV heads repeated per group.
  np_bias = np.asarray(bias, np.float64)
  scores_mask = np.broadcast_to(mask, (2, 4, 5, 7))
  k4, v4 = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
  qb = np.asarray(q, np.float64)
  s = np.einsum('bqhd,bkhd->bhqk', qb, k4) / np.sqrt(8) + np_bias
  s = np.where(scores_mask, s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True, where=scores_mask, initial=-1e30))
  w = w / np.maximum(w.sum(-1, keepdims=True), 1e-30)
  want = np.nan_to_num(np.einsum('bhqk,bkhd->bqhd', w, v4))
  np.testing.assert_allclose(ref, want, atol=1e-5)
  np.testing.assert_allclose(
      attention.dot_product_attention(*args[:3]),
      reference.attention(q, k4, v4), atol=1e-5)


def test_implementation_choice_is_explicit_and_safe():
  assert attention.resolve_implementation('auto', backend='cpu') == 'reference'
  for backend in ('gpu', 'tpu'):
    assert attention.resolve_implementation('auto', backend) == 'xla'
  with pytest.raises(ValueError, match='GPU'):
    attention.resolve_implementation('cudnn', backend='cpu')
  with pytest.raises(ValueError, match='TPU'):
    attention.resolve_implementation('pallas', backend='cpu')
  with pytest.raises(ValueError, match='dropout'):
    config.ModelConfig(attention_impl='xla', attention_dropout_rate=0.1)
  # A model asking for a kernel this CPU lacks fails when traced, clearly.
  m, params = build()
  cudnn = model.build(m.config.replace(attention_impl='cudnn'))
  with pytest.raises(ValueError, match='NVIDIA GPU'):
    cudnn.apply({'params': params}, *example_batch())


@pytest.mark.parametrize('kind', [
    'encoder_decoder', pytest.param('decoder_only', marks=pytest.mark.slow)])
def test_models_agree_across_attention_implementations(kind):
  inputs, targets = example_batch()
  ref, params = build(model_kind=kind, positional='alibi', num_kv_heads=2)
  xla, _ = build(model_kind=kind, positional='alibi', num_kv_heads=2,
                 attention_impl='xla')
  mask = (targets != 0)[..., None]
  np.testing.assert_allclose(
      jnp.where(mask, xla.apply({'params': params}, inputs, targets), 0),
      jnp.where(mask, ref.apply({'params': params}, inputs, targets), 0),
      atol=1e-5)


# ------------------------------------------------------ FFN and biases --

def test_swiglu_matches_the_formula(rng):
  x, wg, w1 = rng.normal(size=(3, 8)), rng.normal(size=(8, 6)), rng.normal(
      size=(8, 6))
  w2 = rng.normal(size=(6, 8))
  g = x @ wg
  want = (g / (1 + np.exp(-g)) * (x @ w1)) @ w2
  got = layers.swiglu_feed_forward(*(jnp.asarray(a, jnp.float32)
                                     for a in (x, wg, w1, w2)))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_swiglu_width_keeps_the_ffn_parameter_count():
  count = lambda **c: sum(x.size for x in jax.tree.leaves(jax.eval_shape(
      layers.FeedForward(config.base(**c)).init, jax.random.key(0),
      jnp.ones((1, 1, 512)))))
  relu = count()
  swiglu = count(activation='swiglu', d_ff=config.swiglu_d_ff(2048))
  assert config.swiglu_d_ff(2048) == 1368
  assert abs(swiglu - relu) / relu < 0.01


def test_bias_free_layers_have_no_biases():
  def biases(params):
    return [jax.tree_util.keystr(p) for p, _ in
            jax.tree_util.tree_leaves_with_path(params)
            if 'bias' in jax.tree_util.keystr(p) or "'b" in
            jax.tree_util.keystr(p)]
  with_bias = biases(build()[1])
  without = biases(build(use_bias=False)[1])
  assert any('query' in b for b in with_bias) and any("'bi'" in b
                                                     for b in with_bias)
  assert without and all('norm' in b for b in without)  # LayerNorm's beta


# ------------------------------------------------ the small cross-product --

# Model kind x positional scheme, the two switches the cache depends on; the
# other switches come in bundles, rotated so that each kind meets every
# bundle and each scheme two of them.
BUNDLES = (
    dict(num_kv_heads=1, activation='swiglu', norm_type='rmsnorm',
         norm_position='pre', use_bias=False),
    dict(num_kv_heads=2, activation='gelu', attention_impl='xla'),
    dict(num_kv_heads=2, norm_type='rmsnorm', scan_layers=True),
    dict(norm_position='pre', remat=True, use_bias=False),
)
COMBOS = {}
for _k, _kind in enumerate(('encoder_decoder', 'decoder_only')):
  for _p, _scheme in enumerate(('sinusoidal', 'learned', 'rope', 'alibi')):
    _b = (_p + _k) % len(BUNDLES)
    COMBOS[f'{_kind}-{_scheme}-bundle{_b}'] = dict(
        model_kind=_kind, positional=_scheme, **BUNDLES[_b])


# The default run keeps one combination per model kind with a scheme that
# decodes through attention positions (rope/learned/sinusoidal); the rest
# are further cases of the same checks.
SLOW_COMBOS = ('encoder_decoder-learned-bundle1',
               'encoder_decoder-rope-bundle2',
               'encoder_decoder-alibi-bundle3',
               'decoder_only-sinusoidal-bundle1',
               'decoder_only-alibi-bundle0')
assert set(SLOW_COMBOS) <= set(COMBOS), set(SLOW_COMBOS) - set(COMBOS)


@pytest.mark.parametrize('combo', [
    pytest.param(c, marks=pytest.mark.slow) if c in SLOW_COMBOS else c
    for c in COMBOS])
def test_variant_trains_and_decodes_with_the_cache(combo):
  changes = {**COMBOS[combo], 'dropout_rate': 0.1}
  m, params = build(**changes)
  inputs, targets = example_batch(batch=4)
  batch = dict(inputs=inputs, targets=targets)
  tx = optax.adam(3e-3)
  state = train_state.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=tx.init(params),
                           rng=jax.random.key_data(jax.random.key(0)),
                           bad_step=jnp.full((), -1, jnp.int32))
  step, _ = train_steps.jit_steps(m, tx, label_smoothing=0.0)
  losses = []
  for _ in range(20):
    state, metrics = step(state, batch)
    losses.append(float(metrics['loss'] / metrics['tokens']))
  assert losses[-1] < 0.7 * losses[0], losses
  params = state.params
  # The cached decoder equals the full model at every real target position.
  full = m.apply({'params': params}, inputs, targets)
  cached = decode.cached_logits(m, params, inputs, targets)
  real = (targets != 0)[..., None]
  np.testing.assert_allclose(jnp.where(real, cached, 0),
                             jnp.where(real, full, 0), atol=2e-4)
  if changes['positional'] in ('rope', 'alibi'):  # positions inside attention
    greedy = decode.greedy_decode(m, params, inputs, max_decode_len=8)
    np.testing.assert_array_equal(greedy, decode.naive_greedy_decode(
        m, params, inputs, max_decode_len=8))


# ------------------------------------------------------------ decoder-only --

def test_decoder_only_reads_a_row_as_if_it_had_no_padding():
  """More source padding moves the target part to later slots, but its
  positions count from the real source length: same logits."""
  for scheme in ('sinusoidal', 'rope', 'alibi', 'learned'):
    m, params = build(model_kind='decoder_only', positional=scheme)
    inputs, targets = example_batch(batch=2)
    padded = jnp.pad(inputs, ((0, 0), (0, 5)))
    run = jax.jit(lambda x: m.apply({'params': params}, x, targets))
    np.testing.assert_allclose(run(padded), run(inputs), atol=1e-5)


@pytest.mark.slow
def test_decoder_only_packed_row_equals_separate_rows():
  m, params = build(model_kind='decoder_only', positional='rope')
  a_in, a_out = jnp.asarray([[5, 6, 7, 1]]), jnp.asarray([[8, 9, 1]])
  b_in, b_out = jnp.asarray([[10, 11, 1]]), jnp.asarray([[12, 13, 14, 1]])
  packed = m.apply(
      {'params': params}, jnp.concatenate([a_in, b_in], 1),
      jnp.concatenate([a_out, b_out], 1),
      inputs_segmentation=jnp.asarray([[1, 1, 1, 1, 2, 2, 2]]),
      targets_segmentation=jnp.asarray([[1, 1, 1, 2, 2, 2, 2]]),
      inputs_position=jnp.asarray([[0, 1, 2, 3, 0, 1, 2]]),
      targets_position=jnp.asarray([[0, 1, 2, 0, 1, 2, 3]]))
  np.testing.assert_allclose(packed[:, :3],
                             m.apply({'params': params}, a_in, a_out),
                             atol=1e-5)
  np.testing.assert_allclose(packed[:, 3:],
                             m.apply({'params': params}, b_in, b_out),
                             atol=1e-5)


def test_encoder_only_refuses_to_decode():
  m, params = build(model_kind='encoder_only', num_labels=5)
  inputs, _ = example_batch()
  assert m.apply({'params': params}, inputs).shape == (3, 7, 5)
  with pytest.raises(ValueError, match='does not decode'):
    decode.greedy_decode(m, params, inputs, max_decode_len=4)
  with pytest.raises(ValueError, match='num_labels'):
    config.ModelConfig(model_kind='encoder_only')


# ------------------------------------------- short runs on the toy tasks --

@pytest.mark.slow
def test_decoder_only_learns_toy_translation(data_dir, tmp_path):
  """The trainer runs a decoder-only model end to end (training, eval loss,
  cached decoding for BLEU) and it learns far beyond the majority token."""
  from tests.test_train import tiny_config
  from xfmr_jax import data, run_config, training_loop
  from xfmr_jax.tokenizer import Tokenizer
  c = tiny_config(data_dir, num_train_steps=150, batch_size=16,
                  warmup_steps=30, lr_scale=1.0)
  c.model.update(model_kind='decoder_only', d_model=64, num_heads=4,
                 num_decoder_layers=2, d_ff=128, positional='rope',
                 num_kv_heads=2)
  metrics = training_loop.train_and_evaluate(c, str(tmp_path))
  tokenizer = Tokenizer.load(str(tmp_path / 'tokenizer.model'))
  batches = data.make_eval_batches(
      run_config.data_source(c, c.eval_split), tokenizer, batch_size=16,
      max_length=c.eval_max_length, limit=64)
  targets = np.concatenate([b['targets'][b['targets'] > 0] for b in batches])
  majority = np.bincount(targets).max() / targets.size
  assert metrics['eval_accuracy'] > max(0.25, 2 * majority), (
      metrics['eval_accuracy'], majority)
  assert np.isfinite(metrics['bleu'])


@pytest.mark.slow
def test_encoder_only_learns_the_tagging_task(data_dir):
  from experiments.train_tagger import train_tagger
  r = train_tagger(dataset='toy_translate/small', data_dir=str(data_dir),
                   steps=150, vocab_size=300, eval_sentences=300)
  assert r['majority_baseline'] < 0.4
  assert r['accuracy'] > r['majority_baseline'] + 0.3, r


# ------------------------------------------------------------------ Peri-LN --

def test_peri_ln_normalises_the_sublayer_input_and_output(rng):
  """``x + LayerNorm_out(f(LayerNorm_in(x)))`` against float64 NumPy, with
  both norms' own scales and biases; an exploding sublayer cannot blow up
  the residual stream."""
  cfg = config.ModelConfig(**{**TINY, 'norm_position': 'peri'})
  x = rng.normal(size=(2, 5, 32)).astype(np.float32)
  w = rng.normal(size=(32, 32)).astype(np.float32)
  sub = layers.Sublayer(cfg)
  fn = lambda h: 1000.0 * h @ w
  params = nn.unbox(sub.init(jax.random.key(0), x, fn, True))['params']
  assert set(params) == {'norm', 'output_norm'}
  params = jax.tree.map(lambda p: p + rng.normal(size=p.shape).astype(
      np.float32), params)
  got = sub.apply({'params': params}, x, fn, True)
  p64 = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
  inner = reference.layer_norm(x, p64['norm']['scale'], p64['norm']['bias'])
  want = x + reference.layer_norm(1000.0 * inner @ w.astype(np.float64),
                                  p64['output_norm']['scale'],
                                  p64['output_norm']['bias'])
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
  pre = layers.Sublayer(cfg.replace(norm_position='pre'))
  pre_out = pre.apply({'params': {'norm': params['norm']}}, x, fn, True)
  assert np.abs(got - x).max() < 20 < np.abs(pre_out - x).max()
