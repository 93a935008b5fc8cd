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


def linear_schedule(peak: float, warmup_steps: int,
                    total_steps: int) -> optax.Schedule:
  """Fine-tuning's schedule: linear warmup to ``peak`` over ``warmup_steps``
  updates, then a linear decay that would reach 0 one update after
  ``total_steps`` (so every update of the run moves the weights). ``count``
  is 0-based, as in :func:`paper_schedule`."""
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    warm = step / max(warmup_steps, 1)
    decay = (total_steps + 1.0 - step) / max(total_steps + 1 - warmup_steps, 1)
    return peak * jnp.clip(jnp.minimum(warm, decay), 0.0, 1.0)
  return schedule


def make_optimizer(*, d_model: int, warmup_steps: int, lr_scale: float = 1.0,
                   learning_rate: optax.Schedule | None = None,
                   b1: float = 0.9, b2: float = 0.98, eps: float = 1e-9,
                   grad_clip_norm: float = 0.0,
                   grad_accum_steps: int = 1) -> optax.GradientTransformation:
  """Adam with the paper's schedule (or ``learning_rate``).

  Args:
    learning_rate: a schedule that replaces the paper's (for example
      :func:`linear_schedule`).
    grad_clip_norm: clip gradients to this global norm (0 = off).
    grad_accum_steps: average gradients over this many micro-batches before an
      update (``optax.MultiSteps``); the schedule counts updates, not micro-steps.
  """
  parts = []
  if grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(grad_clip_norm))
  if learning_rate is None:
    learning_rate = paper_schedule(d_model, warmup_steps, lr_scale)
  parts.append(optax.adam(learning_rate, b1=b1, b2=b2, eps=eps))
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
