"""The fused loss: values and gradients against a float64 NumPy reference,
the projected path against the plain one, and the models' ``return_hidden``."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xfmr_jax import config as config_lib, losses, model as model_lib


def reference(hidden, table, targets, weights, eps):
  """float64 metrics and gradients of the summed smoothed loss."""
  h = hidden.astype(np.float64).reshape(-1, hidden.shape[-1])
  e = table.astype(np.float64)
  t, w = targets.reshape(-1), weights.reshape(-1).astype(np.float64)
  z = h @ e.T
  z = z - z.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  vocab = e.shape[0]
  q = np.full(z.shape, eps / (vocab - 1))
  q[np.arange(len(t)), t] = 1 - eps
  entropy = -(q * np.log(np.where(q > 0, q, 1.0))).sum(-1)
  loss = ((-(q * logp).sum(-1) - entropy) * w).sum()
  nll = (-logp[np.arange(len(t)), t] * w).sum()
  correct = ((logp.argmax(-1) == t) * w).sum()
  dz = w[:, None] * (np.exp(logp) - q)   # d loss / d logits
  return dict(loss=loss, nll=nll, correct=correct, tokens=w.sum(), d_logits=dz,
              d_hidden=(dz @ e).reshape(hidden.shape), d_table=dz.T @ h)


def problem(rng, batch=3, length=5, d=8, vocab=11):
  hidden = rng.standard_normal((batch, length, d)).astype(np.float32)
  table = rng.standard_normal((vocab, d)).astype(np.float32)
  targets = rng.integers(1, vocab, (batch, length))
  weights = (rng.random((batch, length)) > 0.3).astype(np.float32)
  return hidden, table, targets, weights


@pytest.mark.parametrize('eps', [0.0, 0.1])
def test_projected_metrics_and_gradients_match_numpy(rng, eps):
  hidden, table, targets, weights = problem(rng)
  ref = reference(hidden, table, targets, weights, eps)

  def loss(h, e):
    m = losses.projected_token_metrics(h, e, targets, weights, eps)
    return m['loss'], m
  (_, metrics), (d_h, d_e) = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1), has_aux=True))(hidden, table)
  for k in ('loss', 'nll', 'correct', 'tokens'):
    np.testing.assert_allclose(metrics[k], ref[k], rtol=2e-5, atol=1e-4)
  np.testing.assert_allclose(d_h, ref['d_hidden'], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(d_e, ref['d_table'], rtol=1e-4, atol=1e-5)


def test_plain_metrics_gradient_matches_numpy_and_autodiff(rng):
  hidden, table, targets, weights = problem(rng)
  logits = np.einsum('bld,vd->blv', hidden, table)
  ref = reference(hidden, table, targets, weights, 0.1)
  grad = jax.grad(lambda z: losses.token_metrics(z, targets, weights,
                                                 0.1)['loss'])(logits)
  np.testing.assert_allclose(grad.reshape(-1, table.shape[0]),
                             ref['d_logits'], rtol=1e-4, atol=1e-6)

  # The custom gradient equals plain autodiff of the textbook formula.
  def textbook(z):
    logp = jax.nn.log_softmax(z)
    q = jax.nn.one_hot(targets, z.shape[-1]) * (0.9 - 0.1 / 10) + 0.1 / 10
    return (-(q * logp).sum(-1) * weights).sum()
  np.testing.assert_allclose(grad, jax.grad(textbook)(logits), rtol=1e-5,
                             atol=1e-6)


def test_accuracy_counts_the_largest_logit():
  logits = jnp.array([[[3.0, 1.0, 0.0], [0.0, 2.0, 2.0], [1.0, 5.0, 0.0]]])
  targets = jnp.array([[0, 2, 0]])
  m = losses.token_metrics(logits, targets, jnp.ones((1, 3)), 0.1)
  # Token 0 is right; token 1 ties for the top (counted right); token 2 is not.
  assert float(m['correct']) == 2.0


def test_bfloat16_hidden_gives_gradients_of_the_input_dtypes(rng):
  hidden, table, targets, weights = problem(rng)

  def loss(h, e):
    return losses.projected_token_metrics(h, e, targets, weights, 0.1)['loss']
  d_h, d_e = jax.grad(loss, argnums=(0, 1))(jnp.asarray(hidden, jnp.bfloat16),
                                             jnp.asarray(table))
  assert d_h.dtype == jnp.bfloat16 and d_e.dtype == jnp.float32
  ref = reference(hidden, table, targets, weights, 0.1)
  np.testing.assert_allclose(d_e, ref['d_table'], rtol=0.05, atol=0.02)


@pytest.mark.parametrize('changes', [
    pytest.param(dict(), marks=pytest.mark.slow), dict(share_embeddings=False),
    dict(model_kind='decoder_only', share_embeddings=False)])
def test_return_hidden_projects_to_the_logits(rng, changes):
  cfg = config_lib.ModelConfig(vocab_size=23, d_model=16, num_heads=2,
                               num_encoder_layers=1, num_decoder_layers=1,
                               d_ff=32, max_len=32, **changes)
  model = model_lib.build(cfg)
  inputs = jnp.asarray(rng.integers(2, 23, (2, 7)), jnp.int32)
  targets = jnp.asarray(rng.integers(2, 23, (2, 5)), jnp.int32)
  params = nn.unbox(model.init(jax.random.key(0), inputs, targets)['params'])
  if not cfg.share_embeddings:
    # The untied projection keeps the parameter of a bias-free nn.Dense.
    assert params['logits']['kernel'].shape == (16, 23)
  logits = model.apply({'params': params}, inputs, targets)
  hidden, table = model.apply({'params': params}, inputs, targets,
                              return_hidden=True)
  assert hidden.shape == (2, 5, 16) and table.shape == (23, 16)
  np.testing.assert_allclose(losses.project(hidden, table), logits,
                             rtol=1e-5, atol=1e-5)
