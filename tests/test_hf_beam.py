"""The ranking step of the Hugging Face-rules beam search against a float64
NumPy reference (the end-to-end match with ``generate`` is in
tests/test_marian.py, which needs torch)."""
import jax.numpy as jnp
import numpy as np
import pytest

from xfmr_jax import hf_beam
from xfmr_jax import top_k as topk
from xfmr_jax.token_ids import EOS, PAD


def _reference(logits, alive_logp, n):
  """Log-softmax per beam row, the pad id banned after it, then the n best
  of every beam's extensions, ties to the lower (beam, token) index."""
  batch, k = alive_logp.shape
  x = logits.astype(np.float64).reshape(batch, k, -1)
  top = x.max(-1, keepdims=True)
  logp = x - (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))
  logp[..., PAD] = -np.inf
  flat = (alive_logp[..., None] + logp).reshape(batch, -1)
  order = np.stack([np.lexsort((np.arange(flat.shape[1]), -row))[:n]
                    for row in flat])
  vocab = x.shape[-1]
  return (np.take_along_axis(flat, order, 1), order // vocab, order % vocab)


@pytest.mark.parametrize('vocab', [2003, 40])  # blocked top-k / one scan
def test_extensions_equal_a_full_log_softmax_ranking(vocab):
  rng = np.random.default_rng(0)
  batch, k = 3, 4
  n = 2 * k
  logits = rng.normal(size=(batch * k, vocab)).astype(np.float32)
  logits[0, PAD] = 50.0      # the best token of its row, but banned
  logits[5, PAD] = 4.0       # among the row's best few
  logits[6, [7, 11]] = 6.0   # an exact tie inside a row
  logits[9, :] = logits[10, :]  # two beams of a sentence alike
  alive = rng.normal(size=(batch, k)).astype(np.float32)
  alive[2, 1] = alive[2, 2]
  logp, parent, token = hf_beam._best_extensions(  # pylint: disable=protected-access
      jnp.asarray(logits), jnp.asarray(alive), n, jnp.asarray(False))
  want_logp, want_parent, want_token = _reference(logits, alive, n)
  np.testing.assert_array_equal(np.asarray(parent), want_parent)
  np.testing.assert_array_equal(np.asarray(token), want_token)
  np.testing.assert_allclose(np.asarray(logp), want_logp, rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(token) == PAD)
  if vocab > 1000:  # the case ran block by block
    assert (vocab // topk.block_size(vocab, n + 1) >=
            topk.MIN_BLOCKS_PER_K * (n + 1))


def test_forced_step_leaves_only_eos():
  rng = np.random.default_rng(1)
  batch, k, vocab = 2, 3, 500
  logits = rng.normal(size=(batch * k, vocab)).astype(np.float32)
  alive = rng.normal(size=(batch, k)).astype(np.float32)
  logp, parent, token = hf_beam._best_extensions(  # pylint: disable=protected-access
      jnp.asarray(logits), jnp.asarray(alive), 2 * k, jnp.asarray(True))
  # Every beam's only extension is EOS at log-probability 0: the best is the
  # best alive beam's, ended.
  np.testing.assert_allclose(np.asarray(logp)[:, :k], -np.sort(-alive, 1),
                             rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(parent)[:, 0], alive.argmax(1))
  np.testing.assert_array_equal(np.asarray(token)[:, :k], EOS)
  assert np.all(np.isneginf(np.asarray(logp)[:, k:]))
