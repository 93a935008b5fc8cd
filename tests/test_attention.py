"""Scaled dot-product attention, head split/merge and the sqrt(d_k) argument."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests import reference
from xfmr_jax import attention, masks


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), lq=st.integers(1, 9), lk=st.integers(1, 11),
       h=st.integers(1, 4), d=st.sampled_from([1, 4, 8, 16]),
       seed=st.integers(0, 2**16), masked=st.booleans())
def test_matches_float64_reference(b, lq, lk, h, d, seed, masked):
  r = np.random.default_rng(seed)
  q, k, v = (r.standard_normal((b, n, h, d)).astype(np.float32)
             for n in (lq, lk, lk))
  mask = None
  if masked:  # random key padding with at least one visible key per row
    lengths = r.integers(1, lk + 1, size=b)
    mask = (np.arange(lk)[None, :] < lengths[:, None])[:, None, None, :]
  out = attention.dot_product_attention(q, k, v, mask)
  assert out.shape == (b, lq, h, d)
  assert reference.rel_err(out, reference.attention(q, k, v, mask)) < 1e-5


def test_weights_are_softmax_of_scaled_scores(rng):
  q, k = rng.standard_normal((2, 2, 5, 3, 8)).astype(np.float32)
  w = np.asarray(attention.attention_weights(q, k))
  scores = np.einsum('bqhd,bkhd->bhqk', q.astype(np.float64), k) / np.sqrt(8)
  expected = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
  np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_masked_keys_get_zero_weight_and_full_mask_is_finite(rng):
  q, k, v = rng.standard_normal((3, 1, 4, 2, 8)).astype(np.float32)
  mask = np.ones((1, 1, 4, 4), bool)
  mask[..., 2] = False          # key 2 hidden from everyone
  mask[..., 3, :] = False       # query 3 sees nothing
  out, w = attention.dot_product_attention(q, k, v, mask, return_weights=True)
  assert np.all(np.isfinite(out))
  np.testing.assert_array_equal(np.asarray(w)[..., 2], 0.0)
  np.testing.assert_array_equal(np.asarray(out)[:, 3], 0.0)
  ref = reference.attention(q[:, :3], k, v, mask[..., :3, :])
  assert reference.rel_err(out[:, :3], ref) < 1e-5
  grads = jax.grad(lambda q: attention.dot_product_attention(
      q, k, v, mask).sum())(q)
  assert np.all(np.isfinite(grads))


def test_split_merge_heads_round_trip(rng):
  x = rng.standard_normal((2, 5, 12)).astype(np.float32)
  split = attention.split_heads(x, 3)
  assert split.shape == (2, 5, 3, 4)
  np.testing.assert_array_equal(split[:, :, 1], x[:, :, 4:8])
  np.testing.assert_array_equal(attention.merge_heads(split), x)
  with pytest.raises(ValueError, match='not divisible'):
    attention.split_heads(x, 5)


@pytest.mark.parametrize('d_k', [16, 64, 256])
def test_sqrt_dk_scaling_keeps_unit_variance(d_k):
  """Section 3.2.1: q.k has variance d_k; dividing by sqrt(d_k) brings it to 1."""
  r = np.random.default_rng(d_k)
  q, k = r.standard_normal((2, 4000, d_k)).astype(np.float32)
  unscaled = np.einsum('nd,nd->n', q, k)
  scaled = unscaled / np.sqrt(d_k)
  assert abs(unscaled.var() / d_k - 1) < 0.1
  assert abs(scaled.var() - 1) < 0.1
  # And the function really scales: its logits have unit variance.
  w = attention.attention_weights(q[None, :64, None], k[None, :64, None])
  logits = np.log(np.asarray(w[0, 0], np.float64))
  logits -= logits.mean(-1, keepdims=True)
  direct = np.einsum('qd,kd->qk', q[:64], k[:64]) / np.sqrt(d_k)
  direct -= direct.mean(-1, keepdims=True)
  np.testing.assert_allclose(logits, direct, atol=2e-3)


def test_jit_vmap_and_grad(rng):
  q, k, v = rng.standard_normal((3, 4, 6, 2, 8)).astype(np.float32)
  mask = masks.causal_mask(6)
  eager = attention.dot_product_attention(q, k, v, mask)
  jitted = jax.jit(attention.dot_product_attention)(q, k, v, mask)
  np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-6)
  per_example = jax.vmap(lambda q, k, v: attention.dot_product_attention(
      q[None], k[None], v[None], mask)[0])(q, k, v)
  np.testing.assert_allclose(per_example, eager, rtol=1e-5, atol=1e-6)
  g = jax.grad(lambda q: jnp.sum(attention.dot_product_attention(
      q, k, v, mask) ** 2))(q)
  assert np.all(np.isfinite(g)) and np.any(g != 0)


@pytest.mark.parametrize('lq', [1, 4, 8])
def test_cache_layout_matches_reference_and_the_other_layout(rng, lq,
                                                            monkeypatch):
  """Keys and values laid out as a decoding cache keeps them ('bhkd'; a few
  queries take the keys-first form): same outputs and weights as the
  float64 reference and as the 'bkhd' layout, with grouped KV heads, a
  per-head bias, a key mask with a fully masked row, and weight dropout."""
  b, lk, h, kvh, d = 3, 7, 4, 2, 8
  q = rng.standard_normal((b, lq, h, d)).astype(np.float32)
  k, v = rng.standard_normal((2, b, lk, kvh, d)).astype(np.float32)
  kc, vc = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  bias = rng.standard_normal((1, h, lq, lk)).astype(np.float32)
  mask = rng.random((b, 1, lq, lk)) < 0.7
  mask[0, 0, 0] = False  # a query that sees nothing
  mask[1, 0, :, 0] = True
  ref = reference.masked_attention(q, k, v, mask.copy())
  # The reference has no bias: compare it without, then the forms with.
  out = attention.dot_product_attention(q, kc, vc, mask, kv_layout='bhkd')
  assert reference.rel_err(out, ref) < 1e-5
  np.testing.assert_array_equal(np.asarray(out)[0, 0], 0.0)
  rng_key = jax.random.key(3)
  run = lambda k, v, layout: attention.dot_product_attention(
      q, k, v, mask, bias, dropout_rate=0.3, dropout_rng=rng_key,
      return_weights=True, kv_layout=layout)
  cache_out, cache_w = run(kc, vc, 'bhkd')
  plain_out, plain_w = run(k, v, 'bkhd')
  monkeypatch.setattr(attention, 'FEW_QUERIES', 0)
  mm_out, mm_w = run(kc, vc, 'bhkd')
  for other_out, other_w in ((plain_out, plain_w), (mm_out, mm_w)):
    np.testing.assert_allclose(cache_w, other_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cache_out, other_out, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match='kv_layout'):
    attention.dot_product_attention(q, k, v, kv_layout='bshd')


@pytest.mark.parametrize('batch,g', [(1, 4), (1, 2), (2, 4), (3, 3)])
def test_grouped_beams_under_jit_match_reference(rng, batch, g):
  """A beam search's grouping: the g queries of a sentence attend over its
  cache block [heads, g * slots, d], a reshape inside the jitted step (batch
  of one sentence included, where an elementwise form of this once went
  wrong on XLA's CPU backend)."""
  slots, h, d = 14, 2, 16
  q = rng.standard_normal((batch, g, h, d)).astype(np.float32)
  k, v = rng.standard_normal((2, batch, h, g, slots, d)).astype(np.float32)
  mask = rng.random((batch, 1, g, g * slots)) < 0.5
  group = lambda x: x.reshape(batch, h, g * slots, d)
  out = jax.jit(lambda q, k, v, mask: attention.dot_product_attention(
      q, group(k), group(v), mask, kv_layout='bhkd'))(q, k, v, mask)
  as_bkhd = lambda x: np.asarray(group(x)).transpose(0, 2, 1, 3)
  ref = reference.masked_attention(q, as_bkhd(k), as_bkhd(v), mask)
  assert reference.rel_err(out, ref) < 1e-5


@pytest.mark.parametrize('parts', [1, 4])
def test_filled_cache_attention_reads_only_up_to_the_bound(rng, parts,
                                                          monkeypatch):
  """A decoding cache read up to the chunk bound at or above ``filled``:
  the slots past that bound hold NaN and the result is still the float64
  attention over the filled slots alone, at every bound (a traced ``filled``
  goes through the ``lax.switch``, a Python int picks its branch), with
  grouped KV heads and a per-head bias."""
  monkeypatch.setattr(attention, 'MIN_CHUNK_BYTES', 0)  # a small cache too
  batch, n, h, kvh, d, slots = 2, 3, 4, 2, 8, 64
  chunk = max(attention.MIN_CACHE_CHUNK, -(-slots // attention.CACHE_BOUNDS))
  assert slots // chunk > 1  # several branches
  q = rng.standard_normal((batch, parts * n, h, d)).astype(np.float32)
  # [batch, kv_heads, parts * slots, d]: each part's slots in turn
  k, v = rng.standard_normal((2, batch, kvh, parts * slots, d)).astype(
      np.float32)
  bias = rng.standard_normal((1, h, parts * n, parts * slots)).astype(
      np.float32)
  run = jax.jit(lambda k, v, mask, filled: attention.filled_cache_attention(
      q, k, v, mask, bias, filled=filled, parts=parts))
  slot = np.arange(parts * slots) % slots
  for filled in (1, chunk - 1, chunk, chunk + 1, slots - 1, slots):
    bound = -(-filled // chunk) * chunk
    kn, vn = k.copy(), v.copy()
    kn[:, :, slot >= bound], vn[:, :, slot >= bound] = np.nan, np.nan
    mask = rng.random((batch, 1, parts * n, parts * slots)) < 0.6
    mask[..., 0] = True
    mask[..., slot >= filled] = False  # the caller hides the empty slots
    outs = [run(kn, vn, mask, filled),
            attention.filled_cache_attention(q, kn, vn, mask, bias,
                                             filled=filled, parts=parts)]
    # float64, over the filled slots only
    idx = np.flatnonzero(slot < filled)
    filled_only = lambda x: x[:, :, idx].transpose(0, 2, 1, 3)  # 'bkhd'
    ref = reference.masked_attention(q, filled_only(k), filled_only(v),
                                     mask[..., idx], bias[..., idx])
    for out in outs:
      assert np.all(np.isfinite(out)), filled
      assert reference.rel_err(out, ref) < 1e-5, filled
