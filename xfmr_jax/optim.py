"""The paper's optimiser (section 5.3): Adam(0.9, 0.98, 1e-9) with warmup.

``lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)`` (equation 3),
optionally scaled, with optional global-norm clipping and gradient accumulation.
"""
from __future__ import annotations

import jax.numpy as jnp
import optax


def paper_schedule(d_model: int, warmup_steps: int,
                   scale: float = 1.0) -> optax.Schedule:
  """Equation 3. ``count`` is optax's 0-based update count; the paper's step is
  ``count + 1`` (so the first update has a small, non-zero rate)."""
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model ** -0.5 * jnp.minimum(step ** -0.5,
                                                 step * warmup_steps ** -1.5)
  return schedule


def make_optimizer(*, d_model: int, warmup_steps: int, lr_scale: float = 1.0,
                   b1: float = 0.9, b2: float = 0.98, eps: float = 1e-9,
                   grad_clip_norm: float = 0.0,
                   grad_accum_steps: int = 1) -> optax.GradientTransformation:
  """Adam with the paper's schedule.

  Args:
    grad_clip_norm: clip gradients to this global norm (0 = off).
    grad_accum_steps: average gradients over this many micro-batches before an
      update (``optax.MultiSteps``); the schedule counts updates, not micro-steps.
  """
  parts = []
  if grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(grad_clip_norm))
  parts.append(optax.adam(paper_schedule(d_model, warmup_steps, lr_scale),
                          b1=b1, b2=b2, eps=eps))
  tx = optax.chain(*parts)
  if grad_accum_steps > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=grad_accum_steps)
  return tx
