"""Token-weighted losses and accuracy (label smoothing: paper section 5.4).

Every loss here is a function of four per-token statistics of the logits
``z`` (``[..., vocab]``): ``logsumexp(z)``, the target's logit, ``sum(z)`` and
``max(z)``. Reading them in one pass, and writing the gradient
``dL/dz = g_lse * softmax(z) + g_target * onehot + g_sum`` in one pass (a
custom VJP), avoids the several full passes over ``[tokens, vocab]`` that
differentiating ``log_softmax`` and ``take_along_axis`` costs, and accuracy
needs no separate ``argmax``. :func:`projected_token_metrics` also takes the
output projection inside the same VJP, so the logits are made once and their
gradient feeds both matmuls of the backward pass directly.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# The output projection is a model operation; the losses take it inside
# their VJP (and ``losses.project`` keeps naming it for callers).
from xfmr_jax.layers import project


def _stats(logits, targets):
  """``(lse, target_logit, sum, max)``, each float32 ``[...]``."""
  logits = logits.astype(jnp.float32)
  top = jnp.max(logits, axis=-1)
  lse = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
  # A gather reads one logit per token; a masked sum would read them all.
  target = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32),
                               axis=-1)[..., 0]
  return lse, target, jnp.sum(logits, axis=-1), top


def _is_target(logits, targets):
  vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return vocab_ids == targets[..., None]


def _stats_grad(logits, targets, lse, cotangents):
  """``d(stats)/d(logits)`` applied to the cotangents of :func:`_stats`:
  one elementwise pass, float32 ``[..., vocab]``."""
  g_lse, g_target, g_sum, _ = cotangents  # max(z) is not differentiated
  logits = logits.astype(jnp.float32)
  softmax = jnp.exp(logits - lse[..., None])
  return (g_lse[..., None] * softmax + g_sum[..., None]
          + jnp.where(_is_target(logits, targets), g_target[..., None], 0.0))


@jax.custom_vjp
def logit_stats(logits, targets):
  """Per-token ``(logsumexp, target logit, sum of logits, max logit)`` of
  ``logits`` ``[..., vocab]`` and int ``targets`` ``[...]``; differentiable in
  the logits (not through the max, which only scores accuracy)."""
  return _stats(logits, targets)


def _logit_stats_fwd(logits, targets):
  stats = _stats(logits, targets)
  return stats, (logits, targets, stats[0])


def _logit_stats_bwd(res, cotangents):
  logits, targets, lse = res
  grad = _stats_grad(logits, targets, lse, cotangents)
  return grad.astype(logits.dtype), None


logit_stats.defvjp(_logit_stats_fwd, _logit_stats_bwd)


@jax.custom_vjp
def projected_logit_stats(hidden, table, targets):
  """:func:`logit_stats` of ``project(hidden, table)``, differentiable in
  ``hidden`` ``[n, d]`` and ``table`` ``[vocab, d]``; ``targets`` is ``[n]``."""
  return _stats(project(hidden, table), targets)


def _projected_fwd(hidden, table, targets):
  logits = project(hidden, table)
  stats = _stats(logits, targets)
  return stats, (hidden, table, targets, logits, stats[0])


def _projected_bwd(res, cotangents):
  hidden, table, targets, logits, lse = res
  grad = _stats_grad(logits, targets, lse, cotangents).astype(hidden.dtype)
  d_hidden = jnp.einsum('nv,vd->nd', grad, table.astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
  d_table = jnp.einsum('nv,nd->vd', grad, hidden,
                       preferred_element_type=jnp.float32)
  return d_hidden.astype(hidden.dtype), d_table.astype(table.dtype), None


projected_logit_stats.defvjp(_projected_fwd, _projected_bwd)


def _from_stats(stats, weights, vocab: int, label_smoothing: float):
  """``(smoothed_loss, nll, correct)`` per token, times ``weights``."""
  lse, target, total, top = stats
  nll = lse - target
  if label_smoothing > 0:
    # The smoothed target q puts ``on`` on the right token and ``off`` on each
    # of the other V - 1: sum_v q_v (-log p_v) = on * nll + off * (sum_v
    # (-log p_v) - nll), with sum_v -log p_v = V * lse - sum(z). Its own
    # entropy is subtracted so that predicting q exactly costs 0.
    on, off = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
    smoothed = on * nll + off * (vocab * lse - total - nll)
    smoothed -= -(on * math.log(on) + (vocab - 1) * off * math.log(off))
  else:
    smoothed = nll
  # The target is the prediction when its logit is the largest (a tie with
  # another token counts as correct).
  correct = (target >= top).astype(jnp.float32)
  return smoothed * weights, nll * weights, correct * weights


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
  stats = logit_stats(logits, targets)
  loss, nll, _ = _from_stats(stats, weights, logits.shape[-1], label_smoothing)
  return loss, nll


def _sums(loss, nll, correct, weights) -> dict:
  return {'loss': loss.sum(), 'nll': nll.sum(), 'correct': correct.sum(),
          'tokens': weights.sum()}


def token_metrics(logits, targets, weights, label_smoothing: float) -> dict:
  """Sums over non-padding tokens: ``loss``, ``nll``, ``correct``, ``tokens``.

  Sums (not means) so that batches and devices add up exactly; divide by
  ``tokens`` for per-token values. ``logits`` ``[..., vocab]``; ``targets``,
  ``weights`` ``[...]``.
  """
  stats = logit_stats(logits, targets)
  return _sums(*_from_stats(stats, weights, logits.shape[-1], label_smoothing),
               weights)


def projected_token_metrics(hidden, table, targets, weights,
                            label_smoothing: float) -> dict:
  """:func:`token_metrics` of the logits ``project(hidden, table)``, with the
  projection inside the loss's VJP (the fast path for training).

  Args:
    hidden: ``[..., d_model]`` final decoder states.
    table: ``[vocab, d_model]`` output projection (e.g. the shared embedding).
    targets, weights: ``[...]``.
  """
  flat = hidden.reshape(-1, hidden.shape[-1])
  stats = projected_logit_stats(flat, table, targets.reshape(-1))
  stats = [s.reshape(targets.shape) for s in stats]
  return _sums(*_from_stats(stats, weights, table.shape[0], label_smoothing),
               weights)
