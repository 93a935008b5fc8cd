"""The pieces every decoder is made of: cache set-up, one cached step, output
length, the pad ban and a fast logsumexp.

Greedy decoding and sampling (:mod:`xfmr_jax.decode`) and the beam search
(:mod:`xfmr_jax.beam_search`, under GNMT's or Hugging Face ``generate``'s
rules) are built from these functions, so that they agree on the decoding
conventions of :mod:`xfmr_jax.decode`: the decoder starts from the pad id 0,
EOS is id 1, the pad id is never emitted, and under a mesh the rows are split
over its data axes and the outputs come back replicated.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from xfmr_jax.blocks import shift_right
from xfmr_jax.token_ids import PAD

DECODE_EXTRA = 50  # tokens decoded beyond the input length (paper section 6.1)


def split_rows(inputs):
  """``[batch, s]``: rows over the data axes under a mesh and rules."""
  return nn.with_logical_constraint(inputs, ('batch', 'length'))


def replicated(x):
  """Outputs whole on every device (no-op without a mesh and rules)."""
  return nn.with_logical_constraint(x, (None,) * x.ndim)


def as_variables(params):
  """Accept a params tree or a full ``{'params': ...}`` variables dict."""
  return nn.unbox(params if 'params' in params else {'params': params})


def decode_length(config, input_length: int, max_decode_len=None, *,
                  extra: int = DECODE_EXTRA) -> int:
  """Output length: ``max_decode_len`` if given, else input length + ``extra``
  (the paper decodes up to 50 tokens past the input), capped by ``max_len``
  (a decoder-only model's positions count the source too)."""
  length = input_length + extra if max_decode_len is None else max_decode_len
  room = config.max_len
  if config.model_kind == 'decoder_only':
    room -= input_length
    if room <= 0:
      raise ValueError(f'inputs of length {input_length} leave no room to '
                       f'decode within max_len={config.max_len}')
  return min(length, room)


def no_pad(logits):
  """Forbid the pad id: in the teacher-forced model a 0 target is padding
  (masked out), so emitting it would make the cached decoder and the full
  model disagree. logits: ``[..., vocab]``."""
  return logits.at[..., PAD].set(-jnp.inf)


def logsumexp(x, maximum=None):
  """``logsumexp`` over the last axis in float32, ``[..., v] -> [..., 1]``
  (an all ``-inf`` row gives ``-inf``). ``maximum`` ``[..., 1]``, if given,
  is ``x``'s row maximum, known already (it saves a pass over ``x``).

  The exponentials are an elementwise pass and their sum a matrix-vector
  product: XLA's CPU backend runs ``exp`` inside a reduction on one core, so
  ``jax.nn.logsumexp`` is slower over a beam step's logits at Marian's
  vocabulary (see docs/benchmarks.md).
  """
  m = jnp.max(x, axis=-1, keepdims=True) if maximum is None else maximum
  m = m.astype(jnp.float32)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  total = jnp.dot(jnp.exp(x - m), jnp.ones((x.shape[-1],), jnp.float32),
                  preferred_element_type=jnp.float32)
  return m + jnp.log(total)[..., None]


def init_cache(model, variables, inputs, cache_len):
  """Run the model's ``init_cache`` (encoder and cross-attention K/V, or the
  decoder-only prefill) and return the ``cache`` collection."""
  if model.config.model_kind == 'encoder_only':
    raise ValueError('an encoder_only model tags tokens; it does not decode')
  _, state = model.apply(variables, inputs, cache_len,
                         method=model.init_cache, mutable=['cache'])
  return state['cache']


def step(model, variables, cache, inputs, out, t, cache_len):
  """Logits ``[batch, vocab]`` for position t and the updated cache.

  The decoder input at t is the output at t - 1 (the start symbol at 0):
  ``shift_right``, as in training. out: ``[batch, cache_len]``.
  """
  tokens = jax.lax.dynamic_slice_in_dim(shift_right(out), t, 1, axis=1)
  logits, state = model.apply({**variables, 'cache': cache}, inputs, tokens,
                              t, cache_len=cache_len,
                              method=model.decode_step, mutable=['cache'])
  return logits[:, 0], state['cache']
