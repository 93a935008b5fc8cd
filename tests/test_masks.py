"""Mask builders: causal, padding, packed segments and their combination."""
import numpy as np

from xfmr_jax import masks


def test_causal_is_lower_triangular():
  m = np.asarray(masks.causal_mask(4))
  assert m.shape == (1, 1, 4, 4)
  np.testing.assert_array_equal(m[0, 0], np.tril(np.ones((4, 4), bool)))
  # Queries aligned to the end of a longer key sequence.
  m = np.asarray(masks.causal_mask(2, 5))[0, 0]
  np.testing.assert_array_equal(m, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])


def test_padding_hides_pad_queries_and_keys():
  q = np.array([[5, 6, 0]])
  k = np.array([[7, 0, 8, 0]])
  m = np.asarray(masks.padding_mask(q, k))
  assert m.shape == (1, 1, 3, 4)
  expected = np.array([[1, 0, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(m[0, 0], expected)


def test_segments_attend_only_inside_their_own_segment():
  seg = np.array([[1, 1, 2, 2, 2, 0]])
  m = np.asarray(masks.segment_mask(seg, seg))[0, 0]
  for i in range(6):
    for j in range(6):
      assert m[i, j] == (seg[0, i] == seg[0, j] != 0)


def test_combination_is_logical_and():
  seg = np.array([[1, 1, 2, 2]])
  tokens = np.array([[3, 4, 5, 0]])
  m = masks.combine_masks(masks.causal_mask(4), masks.padding_mask(tokens, tokens),
                          masks.segment_mask(seg, seg), None)
  expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0],
                       [0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(np.asarray(m)[0, 0], expected)
  assert masks.combine_masks(None, None) is None
