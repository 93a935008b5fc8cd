"""Dropout draws 16-bit thresholds from hashed counter words; check
that it still means dropout: rate honoured, kept values scaled, independent."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xfmr_jax import attention, dropout


@pytest.mark.parametrize('rate', [0.1, 0.3, 0.5, 0.9])
@pytest.mark.parametrize('shape', [(32, 64, 192), (7, 1001)])  # even / odd width
def test_rate_and_scale_are_honoured(rate, shape):
  x = jnp.ones(shape, jnp.float32)
  y = np.asarray(jax.jit(dropout.dropout, static_argnums=1)(
      x, rate, jax.random.key(0)))
  kept = y != 0
  n = kept.size
  sigma = np.sqrt(rate * (1 - rate) / n)
  assert abs(kept.mean() - (1 - rate)) < 5 * sigma + 2 ** -16, kept.mean()
  np.testing.assert_allclose(y[kept], 1.0 / (1.0 - rate), rtol=1e-6)
  # Both halves of each 32-bit word are used, and they are independent: the
  # two halves of a row keep the same fraction, and agree as often as chance.
  if shape[-1] % 2 == 0:
    a, b = np.split(kept, 2, axis=-1)
    assert abs(a.mean() - b.mean()) < 10 * sigma
    agree = (a == b).mean()
    chance = (1 - rate) ** 2 + rate ** 2
    assert abs(agree - chance) < 10 * sigma, (agree, chance)


def test_mask_is_a_function_of_the_key():
  x = jnp.arange(1.0, 4097.0).reshape(64, 64)
  a = dropout.dropout(x, 0.2, jax.random.key(1))
  b = dropout.dropout(x, 0.2, jax.random.key(1))
  c = dropout.dropout(x, 0.2, jax.random.key(2))
  np.testing.assert_array_equal(a, b)
  assert np.any(np.asarray(a) != np.asarray(c))
  # Expectation is preserved: E[dropout(x)] = x.
  means = np.mean([np.asarray(dropout.dropout(x, 0.2, jax.random.key(k)))
                   for k in range(200)], axis=0)
  assert abs(means.mean() / np.asarray(x).mean() - 1) < 0.01


def test_module_and_rate_zero():
  x = jnp.ones((4, 6))
  mod = dropout.Dropout(0.5)
  np.testing.assert_array_equal(mod.apply({}, x, deterministic=True), x)
  y = mod.apply({}, x, deterministic=False,
                rngs={'dropout': jax.random.key(0)})
  assert set(np.unique(np.asarray(y))) <= {0.0, 2.0}
  np.testing.assert_array_equal(dropout.dropout(x, 0.0, None), x)
  with pytest.raises(ValueError):
    dropout.dropout(x, 1.0, jax.random.key(0))


def test_attention_dropout_uses_it():
  q = jax.random.normal(jax.random.key(0), (2, 16, 2, 8))
  out = attention.dot_product_attention(q, q, q, dropout_rate=0.25,
                                        dropout_rng=jax.random.key(3))
  ref = attention.dot_product_attention(q, q, q)
  assert out.shape == ref.shape and not np.allclose(out, ref)
  # With a zero rate the result is exactly the deterministic one.
  same = attention.dot_product_attention(q, q, q, dropout_rate=0.0,
                                         dropout_rng=jax.random.key(3))
  np.testing.assert_array_equal(same, ref)


def test_random_words_are_uniform_distinct_and_independent():
  words = np.asarray(dropout.random_words(jax.random.key(0), (256, 512)))
  n = words.size
  assert len(np.unique(words)) == n   # a bijection of the element index
  bits = (words[..., None] >> np.arange(32, dtype=np.uint32)) & 1
  sigma = 0.5 / np.sqrt(n)
  assert np.all(np.abs(bits.reshape(n, 32).mean(0) - 0.5) < 6 * sigma)
  # Neighbours (along a row and down a column) and the same element under a
  # neighbouring key agree on a bit as often as chance, for every bit.
  other = np.asarray(dropout.random_words(jax.random.key(1), (256, 512)))
  for a, b in [(words[:, 1:], words[:, :-1]), (words[1:], words[:-1]),
               (words, other)]:
    agree = 1 - (((a ^ b)[..., None] >> np.arange(32, dtype=np.uint32)) & 1)
    assert np.all(np.abs(agree.reshape(-1, 32).mean(0) - 0.5) < 6 * sigma)
  # Low 16-bit halves (the dropout thresholds) are uniform over 16 bins.
  counts = np.bincount((words & 0xFFFF).ravel() >> 12, minlength=16)
  expected = n / 16
  assert ((counts - expected) ** 2 / expected).sum() < 45   # chi2(15) p~1e-4


def test_dropout_masks_of_folded_keys_are_independent():
  x = jnp.ones((64, 256))
  key = jax.random.key(7)
  masks = [np.asarray(dropout.dropout(x, 0.5, jax.random.fold_in(key, i))) > 0
           for i in range(4)]
  for i in range(3):
    agree = (masks[i] == masks[i + 1]).mean()
    assert abs(agree - 0.5) < 6 * 0.5 / np.sqrt(x.size), agree
