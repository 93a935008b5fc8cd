"""Properties of the full encoder-decoder model."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import reference
from xfmr_jax import config, layers, model

TINY = dict(vocab_size=50, d_model=32, num_heads=4, d_ff=64,
            num_encoder_layers=2, num_decoder_layers=2, max_len=64)


def build(**changes):
  cfg = config.ModelConfig(**{**TINY, **changes})
  m = model.Transformer(cfg)
  dummy = jnp.ones((1, 4), jnp.int32)
  params = nn.unbox(m.init(jax.random.key(0), dummy, dummy)['params'])
  return m, params


def tokens(rng, shape, low=3):
  return rng.integers(low, TINY['vocab_size'], size=shape).astype(np.int32)


def apply(m, params, *args, **kw):
  """Jitted apply (eager Flax dispatches op by op and is slow on CPU)."""
  fn = jax.jit(lambda p, a, k: m.apply({'params': p}, *a, **k))
  return np.asarray(fn(params, args, kw), np.float64)


@pytest.mark.parametrize('norm_position', ['post', 'pre'])
def test_logits_shape_and_causality(rng, norm_position):
  m, params = build(norm_position=norm_position)
  src, tgt = tokens(rng, (2, 7)), tokens(rng, (2, 9))
  logits = apply(m, params, src, tgt)
  assert logits.shape == (2, 9, TINY['vocab_size'])
  i = 4
  changed = tgt.copy()
  changed[:, i + 1:] = tokens(rng, changed[:, i + 1:].shape)
  other = apply(m, params, src, changed)
  # Logits at position j see targets < j (the decoder input is shifted right),
  # so changing targets after i leaves positions 0..i+1 exactly as they were.
  np.testing.assert_allclose(other[:, :i + 2], logits[:, :i + 2], atol=1e-6)
  assert np.abs(other[:, i + 2:] - logits[:, i + 2:]).max() > 1e-3


@pytest.mark.parametrize('changes', [{}, dict(norm_position='pre'),
                                     dict(positional='learned')])
def test_padding_does_not_change_real_positions(rng, changes):
  m, params = build(**changes)
  src, tgt = tokens(rng, (2, 6)), tokens(rng, (2, 5))
  logits = apply(m, params, src, tgt)
  pad_src = np.pad(src, ((0, 0), (0, 4)))
  pad_tgt = np.pad(tgt, ((0, 0), (0, 3)))
  padded = apply(m, params, pad_src, pad_tgt)
  np.testing.assert_allclose(padded[:, :5], logits, atol=1e-5)


def test_packed_rows_equal_separate_runs(rng):
  m, params = build()
  (sa, ta), (sb, tb) = [(tokens(rng, (1, ls)), tokens(rng, (1, lt)))
                        for ls, lt in ((5, 4), (3, 6))]
  alone_a = apply(m, params, sa, ta)
  alone_b = apply(m, params, sb, tb)
  src = np.concatenate([sa, sb, np.zeros((1, 2), np.int32)], 1)
  tgt = np.concatenate([ta, tb, np.zeros((1, 1), np.int32)], 1)
  seg = lambda a, b, pad: np.array([[1] * a + [2] * b + [0] * pad])
  pos = lambda a, b, pad: np.array([list(range(a)) + list(range(b)) + [0] * pad])
  packed = apply(m, params, src, tgt, inputs_segmentation=seg(5, 3, 2),
                 targets_segmentation=seg(4, 6, 1),
                 inputs_position=pos(5, 3, 2), targets_position=pos(4, 6, 1))
  np.testing.assert_allclose(packed[:, :4], alone_a, atol=1e-5)
  np.testing.assert_allclose(packed[:, 4:10], alone_b, atol=1e-5)


def test_encoder_is_permutation_equivariant_only_without_positions(rng):
  src = tokens(rng, (1, 8))
  perm = rng.permutation(8)
  for positional, equivariant in (('none', True), ('sinusoidal', False)):
    m, params = build(positional=positional)
    enc = lambda x: np.asarray(m.apply({'params': params}, x,
                                       method=model.Transformer.encode))
    diff = np.abs(enc(src[:, perm]) - enc(src)[:, perm]).max()
    assert (diff < 1e-5) == equivariant, (positional, diff)


def test_jit_vmap_grad_and_dropout(rng):
  m, params = build()
  src, tgt = tokens(rng, (3, 6)), tokens(rng, (3, 5))
  eager = np.asarray(m.apply({'params': params}, src, tgt))
  jitted = apply(m, params, src, tgt)
  np.testing.assert_allclose(jitted, eager, atol=1e-5)
  # vmap over sentences, each applied as a batch of one (jitted: vmap run
  # eagerly dispatches op by op, 5x slower for the same check).
  single = jax.jit(jax.vmap(
      lambda s, t: m.apply({'params': params}, s[None], t[None])[0]))
  np.testing.assert_allclose(single(src, tgt), eager, atol=1e-5)

  def loss(p, rng_key):
    logits = m.apply({'params': p}, src, tgt, deterministic=False,
                     rngs={'dropout': rng_key})
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 3])
  loss = jax.jit(loss)
  grads = jax.jit(jax.grad(loss))(params, jax.random.key(1))
  leaves = jax.tree.leaves(grads)
  assert all(np.all(np.isfinite(g)) for g in leaves)
  assert sum(float(np.abs(g).sum()) for g in leaves) > 0
  # dropout is on when not deterministic, and depends on the key
  assert loss(params, jax.random.key(1)) != loss(params, jax.random.key(2))


def _stack_layers(params, prefix, n):
  layers_ = [params.pop(f'{prefix}_{i}') for i in range(n)]
  params[prefix] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers_)
  return params


@pytest.mark.parametrize('changes', [
    dict(scan_layers=True),
    pytest.param(dict(remat=True), marks=pytest.mark.slow),
    pytest.param(dict(scan_layers=True, remat=True), marks=pytest.mark.slow)])
def test_scanned_and_remat_stacks_match_unrolled(rng, changes):
  m, params = build()
  src, tgt = tokens(rng, (2, 6)), tokens(rng, (2, 5))
  other, other_params = build(**changes)
  if changes.get('scan_layers'):
    params_for_other = _stack_layers(_stack_layers(dict(params), 'encoder', 2),
                                     'decoder', 2)
    assert jax.tree.structure(params_for_other) == jax.tree.structure(
        other_params)
  else:
    params_for_other = params
  np.testing.assert_allclose(apply(other, params_for_other, src, tgt),
                             apply(m, params, src, tgt), atol=1e-5)
  loss = lambda mod, p: jnp.sum(mod.apply({'params': p}, src, tgt) ** 2)
  g_ref = jax.jit(jax.grad(lambda p: loss(m, p)))(params)
  g = jax.jit(jax.grad(lambda p: loss(other, p)))(params_for_other)
  if changes.get('scan_layers'):
    g_ref = _stack_layers(_stack_layers(dict(g_ref), 'encoder', 2), 'decoder', 2)
  # One relative error over all gradients: some (the key bias) are zero in
  # exact arithmetic and only float noise in practice.
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
  assert reference.rel_err(flat(g), flat(g_ref)) < 1e-5


def test_shared_embedding_is_scaled_and_tied(rng):
  m, params = build(positional='none', num_encoder_layers=1)
  emb = np.asarray(params['source_embed']['embedding'])
  src = tokens(rng, (1, 3))
  x = m.apply({'params': params}, src, method=lambda mod, s: mod.source_embed(s))
  np.testing.assert_allclose(x, emb[src] * np.sqrt(TINY['d_model']), rtol=1e-6)
  assert 'target_embed' not in params and 'logits' not in params
  _, unshared = build(share_embeddings=False)
  assert {'source_embed', 'target_embed', 'logits'} <= set(unshared)


def test_pure_layer_norm_and_ffn_match_numpy(rng):
  x = rng.standard_normal((2, 3, 16)).astype(np.float32)
  scale, bias = rng.standard_normal((2, 16)).astype(np.float32)
  np.testing.assert_allclose(layers.layer_norm(x, scale, bias),
                             reference.layer_norm(x, scale, bias), rtol=1e-5,
                             atol=1e-5)
  w1, w2 = rng.standard_normal((16, 32)), rng.standard_normal((32, 16))
  b1, b2 = rng.standard_normal(32), rng.standard_normal(16)
  expected = np.maximum(0, x @ w1 + b1) @ w2 + b2
  got = layers.feed_forward(*(a.astype(np.float32) for a in (x, w1, b1, w2, b2)))
  assert reference.rel_err(got, expected) < 1e-5


def test_linear_and_its_gradients_match_numpy(rng):
  # layers.linear flattens the token axes before the product; values and
  # both gradients must be those of x @ w on the unflattened input.
  x = rng.standard_normal((3, 5, 8))
  w = rng.standard_normal((8, 6))
  dy = rng.standard_normal((3, 5, 6))
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  y, vjp = jax.vjp(layers.linear, f32(x), f32(w))
  dx, dw = vjp(f32(dy))
  assert y.shape == (3, 5, 6)
  assert reference.rel_err(y, np.einsum('bld,do->blo', x, w)) < 1e-6
  assert reference.rel_err(dx, np.einsum('blo,do->bld', dy, w)) < 1e-6
  assert reference.rel_err(dw, np.einsum('bld,blo->do', x, dy)) < 1e-6


def test_dense_has_the_parameters_of_nn_dense(rng):
  # Same names, shapes and initial values as flax's nn.Dense with the same
  # initialisers, so checkpoints written before layers.Dense still load.
  x = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
  ours = layers.dense(5, ('embed', 'mlp'), 'proj')
  theirs = nn.Dense(5, kernel_init=nn.initializers.xavier_uniform())
  p_ours = nn.unbox(ours.init(jax.random.key(3), x))['params']
  p_theirs = theirs.init(jax.random.key(3), x)['params']
  assert jax.tree.structure(p_ours) == jax.tree.structure(p_theirs)
  for a, b in zip(jax.tree.leaves(p_ours), jax.tree.leaves(p_theirs)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(ours.apply({'params': p_ours}, x),
                             theirs.apply({'params': p_theirs}, x),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('name, lo, hi', [('base', 63e6, 65e6),
                                          ('big', 213e6 * 0.97, 213e6 * 1.03)])
def test_preset_parameter_counts(name, lo, hi):
  cfg = config.PRESETS[name]()
  dummy = jnp.ones((1, 4), jnp.int32)
  shapes = jax.eval_shape(model.Transformer(cfg).init, jax.random.key(0),
                          dummy, dummy)
  count = sum(p.size for p in jax.tree.leaves(shapes['params']))
  assert lo <= count <= hi, count


@pytest.mark.parametrize('changes, message', [
    (dict(d_model=30, num_heads=4), 'not divisible'),
    (dict(num_heads=0), 'positive'),
    (dict(dropout_rate=1.5), 'dropout_rate'),
    (dict(norm_position='middle'), 'norm_position'),
])
def test_bad_config_is_rejected(changes, message):
  with pytest.raises(ValueError, match=message):
    config.ModelConfig(**{**TINY, **changes})
