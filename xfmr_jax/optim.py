"""The paper's optimiser (section 5.3): Adam(0.9, 0.98, 1e-9) with warmup.

``lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)`` (equation 3),
optionally scaled, with optional global-norm clipping and gradient accumulation.
"""
from __future__ import annotations

import jax
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


def updates_applied(opt_state) -> jax.Array:
  """How many updates the optimizer has applied: the count of its learning-rate
  schedule. With gradient accumulation that is one per ``grad_accum_steps``
  micro-steps, and a step skipped for a non-finite loss does not count."""
  states = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
            if isinstance(s, optax.ScaleByScheduleState)]
  if len(states) != 1:
    raise ValueError(f'expected one learning-rate schedule in the optimizer '
                     f'state, found {len(states)}')
  return states[0].count


def last_learning_rate(opt_state, schedule: optax.Schedule) -> jax.Array:
  """The rate ``schedule`` gave the latest update applied (the first update's
  rate before any)."""
  return schedule(jnp.maximum(updates_applied(opt_state) - 1, 0))
