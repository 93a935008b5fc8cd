"""top_k.top_k: the same values and indices as a full sort of each row."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xfmr_jax import top_k as topk


def reference(x, k):
  """float64 NumPy: a stable sort of -x puts equal values in index order."""
  x = np.asarray(x, np.float64)
  order = np.argsort(-x, axis=-1, kind='stable')[..., :k]
  return np.take_along_axis(x, order, axis=-1), order


def check(x, k):
  length = x.shape[-1]
  # The shapes below are chosen to take the blocked path, not the fallback.
  assert length // topk.block_size(length, k) >= topk.MIN_BLOCKS_PER_K * k
  values, indices = jax.jit(topk.top_k, static_argnums=1)(jnp.asarray(x), k)
  want_values, want_indices = reference(x, k)
  assert indices.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(indices), want_indices)
  np.testing.assert_array_equal(np.asarray(values, np.float64), want_values)
  lax_values, lax_indices = jax.lax.top_k(jnp.asarray(x), k)
  np.testing.assert_array_equal(np.asarray(indices), np.asarray(lax_indices))
  np.testing.assert_array_equal(np.asarray(values), np.asarray(lax_values))


@pytest.mark.parametrize('shape,k', [((4, 1024), 1), ((2, 3, 2011), 4),
                                     ((5, 3001), 8), ((2, 8000), 31)])
def test_random_rows(shape, k):
  """Lengths that blocks divide and that leave a short last block (2011,
  3001 are prime), leading axes, k up to 31."""
  x = np.random.default_rng(k).standard_normal(shape).astype(np.float32)
  check(x, k)


def test_ties_go_to_the_lower_index():
  """Six distinct values over 3000 entries: every kept value is tied many
  times, inside blocks and across them."""
  x = np.random.default_rng(0).integers(0, 6, (6, 3000)).astype(np.float32)
  check(x, 8)
  # The largest value placed only in the short last block and at its end.
  y = np.zeros((2, 3001), np.float32)
  y[0, -1] = y[1, -3:] = 5.0
  check(y, 4)


def test_minus_infinity():
  """Rows with just k finite entries, one with fewer (then -inf entries are
  returned, lowest index first), as banned tokens give."""
  x = np.full((3, 2011), -np.inf, np.float32)
  rng = np.random.default_rng(1)
  x[0, rng.choice(2011, 4, replace=False)] = rng.standard_normal(4)
  x[1, [5, 2010]] = [1.0, 2.0]
  x[2, :] = rng.standard_normal(2011)
  x[2, 100:] = -np.inf
  check(x, 4)


def test_short_rows_and_bad_k():
  """Rows too short for blocks are one lax.top_k; k out of range is an error."""
  x = jnp.arange(10.0)[::-1]
  values, indices = topk.top_k(x, 3)
  np.testing.assert_array_equal(np.asarray(indices), [0, 1, 2])
  with pytest.raises(ValueError, match='1 <= k <= 10'):
    topk.top_k(x, 11)
