"""Token-weighted losses and accuracy (label smoothing: paper section 5.4)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def smoothed_cross_entropy(logits, targets, weights, label_smoothing: float):
  """Cross-entropy against label-smoothed targets, and the plain NLL.

  The smoothed target puts ``1 - eps`` on the right token and spreads ``eps``
  uniformly over the other ``V - 1``. Its own entropy is subtracted, so a model
  that predicts exactly the smoothed distribution has loss 0.

  Args:
    logits: float ``[batch, length, vocab]``.
    targets: int ``[batch, length]``.
    weights: float ``[batch, length]``, 0 at padding.

  Returns:
    ``(smoothed_loss, nll)`` per token, each float32 ``[batch, length]`` and
    already multiplied by ``weights``.
  """
  vocab = logits.shape[-1]
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  if label_smoothing <= 0:
    return nll * weights, nll * weights
  on, off = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
  # sum_v q_v (-log p_v) with q = off everywhere except on at the target.
  smoothed = on * nll - off * (jnp.sum(log_probs, axis=-1) + nll)
  entropy = -(on * jnp.log(on) + (vocab - 1) * off * jnp.log(off))
  return (smoothed - entropy) * weights, nll * weights


def token_metrics(logits, targets, weights, label_smoothing: float) -> dict:
  """Sums over non-padding tokens: ``loss``, ``nll``, ``correct``, ``tokens``.

  Sums (not means) so that batches and devices add up exactly; divide by
  ``tokens`` for per-token values.
  """
  loss, nll = smoothed_cross_entropy(logits, targets, weights, label_smoothing)
  correct = (jnp.argmax(logits, -1) == targets) * weights
  return {'loss': loss.sum(), 'nll': nll.sum(), 'correct': correct.sum(),
          'tokens': weights.sum()}
