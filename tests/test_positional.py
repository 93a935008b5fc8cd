"""Sinusoidal positional encoding (section 3.5) and its relative-position properties."""
import numpy as np
import pytest

from tests import reference
from xfmr_jax import positional


@pytest.mark.parametrize('d_model', [4, 64, 512])
def test_equals_the_papers_formula(d_model):
  pos = np.array([0, 1, 2, 7, 50, 199])
  pe = np.asarray(positional.sinusoidal_encoding(pos, d_model))
  np.testing.assert_allclose(pe, reference.sinusoid(pos, d_model), atol=2e-5)


def test_batched_positions_gather_the_same_rows():
  table = np.asarray(positional.sinusoidal_encoding(np.arange(10), 16))
  packed = np.array([[0, 1, 2, 0, 1], [3, 4, 0, 0, 0]])
  pe = np.asarray(positional.sinusoidal_encoding(packed, 16))
  np.testing.assert_allclose(pe, table[packed], atol=1e-6)


@pytest.mark.parametrize('k', [1, 3, 17])
def test_one_fixed_matrix_per_offset(k):
  """PE(pos + k) = M_k PE(pos) for every pos, with M_k independent of pos."""
  d = 32
  pos = np.arange(0, 120)
  pe = reference.sinusoid(pos, d)
  shifted = reference.sinusoid(pos + k, d)
  m = positional.offset_matrix(k, d)
  np.testing.assert_allclose(pe @ m.T, shifted, atol=1e-9)
  # M_k is found by least squares from the data alone too, with no residual.
  fitted, *_ = np.linalg.lstsq(pe, shifted, rcond=None)
  np.testing.assert_allclose(pe @ fitted, shifted, atol=1e-8)


def test_dot_product_peaks_at_zero_offset_and_falls_off():
  d, p = 128, 60
  pe = reference.sinusoid(np.arange(120), d)
  dots = pe @ pe[p]
  assert np.argmax(dots) == p
  near = dots[p:p + 8]
  assert np.all(np.diff(near) < 0)          # falls off to the right ...
  assert np.all(np.diff(dots[p - 7:p + 1]) > 0)  # ... and rises to the peak
  # depends only on the distance: the same curve around another position
  np.testing.assert_allclose(dots[p - 5:p + 6],
                             (pe @ pe[30])[25:36], atol=1e-9)


def test_odd_width_is_rejected():
  with pytest.raises(ValueError, match='even'):
    positional.sinusoidal_encoding(np.arange(3), 7)


def test_halves_layout_is_the_interleaved_one_permuted():
  """Marian's layout: every sine first, then every cosine, same frequencies."""
  pos = np.array([0, 1, 5, 63])
  halves = np.asarray(positional.sinusoidal_encoding(pos, 16, layout='halves'))
  ref = reference.sinusoid(pos, 16)
  np.testing.assert_allclose(halves, np.concatenate([ref[:, 0::2],
                                                     ref[:, 1::2]], -1),
                             atol=2e-5)
  with pytest.raises(ValueError, match='layout'):
    positional.sinusoidal_encoding(pos, 16, layout='zigzag')
