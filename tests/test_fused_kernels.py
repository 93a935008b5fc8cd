"""jax's real Pallas flash-attention kernels, run in interpret mode on the CPU.

``attention_impl='pallas'`` hands jax's TPU flash-attention kernel
(``jax.experimental.pallas.ops.tpu.flash_attention``) its arrays: the
``[batch, heads, length, d]`` layout, the key/value heads repeated per query
group, the mask folded into the additive bias ``ab``, and the scaling. Pallas
can interpret the kernel's own code on the CPU, so these tests check that
plumbing against the kernel itself, forward and backward (its custom VJP
kernels), instead of a stand-in written to the same assumptions. (The kernel
adds ``ab`` before it scales by ``sm_scale``; a stand-in that scaled first is
how a bias-scaling bug once went unseen.)

The kernel's blocks are 128 slots long, so the shapes here are multiples of
128; interpreting is slow, so they stay few.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import reference
from xfmr_jax import attention, masks, positional

pltpu = pytest.importorskip('jax.experimental.pallas.tpu')
flash = pytest.importorskip('jax.experimental.pallas.ops.tpu.flash_attention')


@pytest.fixture
def tpu_interpret(monkeypatch):
  """The library sees a TPU backend; Pallas interprets TPU kernels."""
  monkeypatch.setattr(jax, 'default_backend', lambda: 'tpu')
  with pltpu.force_tpu_interpret_mode():
    yield


def inputs(seed, q_len=128, k_len=256, heads=4, kv_heads=2, d=16):
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.normal(size=(2, q_len, heads, d)), jnp.float32)
  k, v = (jnp.asarray(r.normal(size=(2, k_len, kv_heads, d)), jnp.float32)
          for _ in range(2))
  return q, k, v


def test_the_library_finds_the_kernel():
  assert attention._pallas_flash() is flash.flash_attention


def test_pallas_kernel_with_gqa_mask_and_bias_matches_float64(tpu_interpret):
  q, k, v = inputs(0)
  r = np.random.default_rng(1)
  mask = np.asarray(r.random((2, 1, 128, 256)) < 0.7)
  mask[0, 0, 1] = False                            # a query that sees nothing
  bias = positional.alibi_bias(jnp.arange(128)[None], jnp.arange(256)[None], 4)
  got = attention.dot_product_attention(q, k, v, jnp.asarray(mask), bias,
                                        implementation='pallas')
  want = attention.dot_product_attention(q, k, v, jnp.asarray(mask), bias)
  np.testing.assert_allclose(got, want, atol=2e-5)
  assert np.all(np.asarray(got)[0, 1] == 0)
  # And against float64 NumPy without a bias: the kernel's own numerics.
  plain = attention.dot_product_attention(q, k, v, jnp.asarray(mask),
                                          implementation='pallas')
  ref = reference.masked_attention(q, k, v, mask)
  np.testing.assert_allclose(plain, ref, atol=2e-5)


def test_pallas_kernel_gradients_match_the_reference(tpu_interpret):
  """The kernel's backward kernels, through the causal packed mask a decoder
  builds (as a bias) and the GQA head repetition."""
  q, k, v = inputs(2, q_len=128, k_len=128)
  segments = jnp.asarray(np.repeat([[1, 2]], 64, axis=1).repeat(2, axis=0))
  mask = masks.SelfMask(segments, causal=True).dense()

  def loss(impl):
    return lambda q, k, v: jnp.sum(jnp.sin(attention.dot_product_attention(
        q, k, v, mask, implementation=impl)))
  got = jax.grad(loss('pallas'), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss('reference'), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=5e-5)


@pytest.mark.parametrize('causal', [True, False])
def test_self_masks_reach_the_kernel_as_segment_ids(tpu_interpret, causal):
  """A SelfMask goes to the kernel as its own segment ids and causal flag
  (no n x n bias): packed rows, padding and GQA as float64 NumPy has them."""
  q, k, v = inputs(3, q_len=128, k_len=128)
  segments = np.zeros((2, 128), np.int32)
  segments[0, :50], segments[0, 50:120] = 1, 2      # packed, then padding
  segments[1, :128] = 1
  mask = masks.SelfMask(jnp.asarray(segments), causal)
  got = attention.dot_product_attention(q, k, v, mask,
                                        implementation='pallas')
  want = reference.masked_attention(q, k, v,
                                    reference.segment_mask(segments, causal))
  np.testing.assert_allclose(got, want, atol=2e-5)
  assert np.all(np.asarray(got)[0, 120:] == 0)     # padding queries


@pytest.mark.slow
def test_a_model_on_the_pallas_kernel_equals_the_reference(tpu_interpret):
  """Encoder and decoder self-attention (segment ids) and cross-attention
  (the padding mask as a bias) of a whole encoder-decoder on the kernel."""
  import flax.linen as nn
  from xfmr_jax import config, model
  cfg = config.ModelConfig(vocab_size=24, d_model=32, num_heads=4,
                           num_kv_heads=2, d_ff=64, num_encoder_layers=1,
                           num_decoder_layers=1, max_len=128, dropout_rate=0.0)
  r = np.random.default_rng(4)
  inputs = r.integers(3, 24, (2, 128)).astype(np.int32)
  targets = r.integers(3, 24, (2, 128)).astype(np.int32)
  inputs[0, 90:], targets[0, 100:] = 0, 0
  ref = model.build(cfg)
  params = nn.unbox(jax.jit(ref.init)(jax.random.key(0), inputs[:, :4],
                                      targets[:, :4]))['params']
  pallas = model.build(cfg.replace(attention_impl='pallas'))
  want = ref.apply({'params': params}, inputs, targets)
  got = jax.jit(pallas.apply)({'params': params}, inputs, targets)
  real = (targets != 0)[..., None]
  np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0),
                             atol=5e-5)
