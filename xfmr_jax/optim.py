"""The paper's optimiser (section 5.3): Adam(0.9, 0.98, 1e-9) with warmup.

``lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)`` (equation 3),
optionally scaled, with optional global-norm clipping, gradient accumulation
and a moving average of the parameters (:func:`params_average`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

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


class ParamsAverageState(NamedTuple):
  """``average``: the moving average of the parameters after ``count``
  updates (a tree like the parameters)."""
  count: jax.Array
  average: Any


def params_average(decay: float) -> optax.GradientTransformation:
  """An exponential moving average of the parameters, kept in the optimizer
  state (read it with :func:`averaged_params`); the updates pass unchanged.

  The paper evaluates the average of its last checkpoints rather than the last
  one; a moving average is the same idea taken at every update. It goes last
  in a chain, where it sees the final updates, so it averages exactly the
  parameters ``optax.apply_updates`` writes. After ``n`` updates the decay is
  ``min(decay, (1 + n) / (10 + n))``: early on the average follows the
  parameters closely, so the random initialisation does not linger in it.
  """
  if not 0.0 < decay < 1.0:
    raise ValueError(f'params_average: decay must be in (0, 1), got {decay}')

  def init(params):
    return ParamsAverageState(count=jnp.zeros((), jnp.int32),
                              average=jax.tree.map(jnp.copy, params))

  def update(updates, state, params=None):
    if params is None:
      raise ValueError('params_average needs the parameters in update()')
    new = optax.apply_updates(params, updates)
    n = state.count.astype(jnp.float32)
    d = jnp.minimum(decay, (1.0 + n) / (10.0 + n))
    average = jax.tree.map(lambda a, p: (d * a + (1.0 - d) * p).astype(a.dtype),
                           state.average, new)
    return updates, ParamsAverageState(state.count + 1, average)

  return optax.GradientTransformation(init, update)


def make_optimizer(*, d_model: int, warmup_steps: int, lr_scale: float = 1.0,
                   learning_rate: optax.Schedule | None = None,
                   b1: float = 0.9, b2: float = 0.98, eps: float = 1e-9,
                   grad_clip_norm: float = 0.0, grad_accum_steps: int = 1,
                   ema_decay: float = 0.0) -> optax.GradientTransformation:
  """Adam with the paper's schedule (or ``learning_rate``).

  Args:
    learning_rate: a schedule that replaces the paper's (for example
      :func:`linear_schedule`).
    grad_clip_norm: clip gradients to this global norm (0 = off).
    grad_accum_steps: average gradients over this many micro-batches before an
      update (``optax.MultiSteps``); the schedule counts updates, not micro-steps.
    ema_decay: keep a moving average of the parameters with this decay
      (:func:`params_average`; 0 = none).
  """
  parts = []
  if grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(grad_clip_norm))
  if learning_rate is None:
    learning_rate = paper_schedule(d_model, warmup_steps, lr_scale)
  parts.append(optax.adam(learning_rate, b1=b1, b2=b2, eps=eps))
  if ema_decay:
    parts.append(params_average(ema_decay))
  tx = optax.chain(*parts)
  if grad_accum_steps > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=grad_accum_steps)
  return tx


def schedule_from_config(config) -> optax.Schedule:
  """The learning rate of each update of a training config's optimizer
  (:func:`from_config`). ``lr_schedule`` 'paper' is equation 3 scaled by
  ``lr_scale``; 'linear' (for fine-tuning) warms up to ``learning_rate`` and
  decays linearly over the run's ``num_train_steps``."""
  if config.get('lr_schedule', 'paper') == 'linear':
    return linear_schedule(config.learning_rate, config.warmup_steps,
                           config.num_train_steps)
  return paper_schedule(config.model.d_model, config.warmup_steps,
                        config.lr_scale)


def from_config(config) -> optax.GradientTransformation:
  """The optimizer of a training config (``ml_collections``, see
  ``experiments/configs``): what training builds and what loading a
  checkpoint restores into, so that the two agree on its state's tree."""
  return make_optimizer(
      d_model=config.model.d_model, warmup_steps=config.warmup_steps,
      lr_scale=config.lr_scale, learning_rate=schedule_from_config(config),
      b1=config.adam_b1, b2=config.adam_b2,
      eps=config.adam_eps, grad_clip_norm=config.grad_clip_norm,
      grad_accum_steps=config.grad_accum_steps,
      ema_decay=config.get('ema_decay', 0.0))  # older configs predate it


def _states_of(opt_state, kind) -> list:
  """The sub-states of type ``kind`` inside a (chained, wrapped) optax state."""
  is_kind = lambda x: isinstance(x, kind)
  return [s for s in jax.tree.leaves(opt_state, is_leaf=is_kind) if is_kind(s)]


def updates_applied(opt_state) -> jax.Array:
  """How many updates the optimizer has applied: the count of its learning-rate
  schedule. With gradient accumulation that is one per ``grad_accum_steps``
  micro-steps, and a step skipped for a non-finite loss does not count."""
  states = _states_of(opt_state, optax.ScaleByScheduleState)
  if len(states) != 1:
    raise ValueError(f'expected one learning-rate schedule in the optimizer '
                     f'state, found {len(states)}')
  return states[0].count


def last_learning_rate(opt_state, schedule: optax.Schedule) -> jax.Array:
  """The rate ``schedule`` gave the latest update applied (the first update's
  rate before any)."""
  return schedule(jnp.maximum(updates_applied(opt_state) - 1, 0))


def averaged_params(opt_state):
  """The moving average of :func:`params_average` in ``opt_state``, or None
  if the optimizer keeps none."""
  states = _states_of(opt_state, ParamsAverageState)
  return states[0].average if states else None


def eval_params(state):
  """The parameters to evaluate and translate with: the moving average when
  the optimizer keeps one, else the trained parameters."""
  average = averaged_params(state.opt_state)
  return state.params if average is None else average
