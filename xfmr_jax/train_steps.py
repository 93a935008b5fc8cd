"""The jitted train and eval steps.

A batch is a dict of int32 ``[batch, length]`` arrays: ``inputs``, ``targets``
and, for packed rows, ``inputs_segmentation``, ``targets_segmentation``,
``inputs_position``, ``targets_position`` (see :mod:`xfmr_jax.data.packing`).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from xfmr_jax import losses, sharding, train_state
from xfmr_jax.model import SequenceModel
from xfmr_jax.train_state import TrainState

MODEL_KEYS = ('inputs', 'targets', 'inputs_segmentation', 'targets_segmentation',
              'inputs_position', 'targets_position')


def model_inputs(batch: dict) -> dict:
  """The entries of ``batch`` that the model reads."""
  return {k: batch[k] for k in MODEL_KEYS if k in batch}


def _loss_fn(params, batch, model, dropout_key, label_smoothing):
  apply = functools.partial(
      model.apply, {'params': params}, **model_inputs(batch),
      deterministic=dropout_key is None,
      rngs=None if dropout_key is None else {'dropout': dropout_key})
  weights = (batch['targets'] > 0).astype(jnp.float32)
  if isinstance(model, SequenceModel):
    # The model stops before its vocabulary projection, which the loss takes
    # inside its own gradient (one pass over the [tokens, vocab] logits each
    # way instead of several).
    hidden, table = apply(return_hidden=True)
    metrics = losses.projected_token_metrics(hidden, table, batch['targets'],
                                             weights, label_smoothing)
  else:  # the encoder-only tagger's biased label head
    metrics = losses.token_metrics(apply(), batch['targets'], weights,
                                   label_smoothing)
  # Mean over this batch's tokens: every token weighs the same.
  return metrics['loss'] / jnp.maximum(metrics['tokens'], 1.0), metrics


def train_step(state: TrainState, batch: dict, *, model: nn.Module,
               tx: optax.GradientTransformation, label_smoothing: float,
               nan_at_step: int = -1):
  """One optimiser step. Returns ``(state, metrics)`` with summed metrics.

  ``nan_at_step`` poisons the loss at that step (fault injection for testing
  the non-finite guard; -1 = never).
  """
  dropout_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng),
                                   state.step)
  grad_fn = jax.value_and_grad(_loss_fn, has_aux=True)
  (loss, metrics), grads = grad_fn(state.params, batch, model, dropout_key,
                                   label_smoothing)
  if nan_at_step >= 0:
    poison = jnp.where(state.step == nan_at_step, jnp.nan, 0.0)
    loss = loss + poison
    grads = jax.tree.map(lambda g: g + poison, grads)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  ok = finite & (state.bad_step < 0)

  def update(s):
    updates, opt_state = tx.update(grads, s.opt_state, s.params)
    return optax.apply_updates(s.params, updates), opt_state

  # A branch rather than where(ok, new, old) over every leaf: the update then
  # writes the donated buffers in place (several times faster at base size),
  # and a skipped step touches nothing.
  params, opt_state = jax.lax.cond(ok, update,
                                   lambda s: (s.params, s.opt_state), state)
  new_state = state.replace(
      step=state.step + 1,
      params=params,
      opt_state=opt_state,
      bad_step=jnp.where((state.bad_step < 0) & ~finite, state.step,
                         state.bad_step))
  metrics = dict(metrics, grad_norm=grad_norm)
  return new_state, metrics


def eval_step(params, batch: dict, *, model: nn.Module,
              label_smoothing: float) -> dict:
  """Summed loss/NLL/accuracy over the real tokens of one batch."""
  _, metrics = _loss_fn(params, batch, model, None, label_smoothing)
  return metrics


def jit_steps(model: nn.Module, tx: optax.GradientTransformation,
              label_smoothing: float, nan_at_step: int = -1, *, mesh=None,
              state_shardings=None, rules=None):
  """The jitted ``(train_step, eval_step)``; the train state is donated.

  With ``mesh`` (and the ``state_shardings`` of
  :func:`xfmr_jax.train_state.create_train_state`) both are jitted with explicit
  shardings: the state keeps its layout, batches are split over the data axes
  and the metrics come back replicated; activations follow ``rules``.
  """
  train = functools.partial(train_step, model=model, tx=tx,
                            label_smoothing=label_smoothing,
                            nan_at_step=nan_at_step)
  evaluate = functools.partial(eval_step, model=model,
                               label_smoothing=label_smoothing)
  if mesh is None:
    return jax.jit(train, donate_argnums=0), jax.jit(evaluate)
  rules = sharding.RULES if rules is None else rules
  if state_shardings is None:
    state_shardings = train_state.state_shardings(model, tx, mesh, rules)
  batch, rep = sharding.batch_sharding(mesh), sharding.replicated(mesh)
  train = jax.jit(sharding.traced_under(train, mesh, rules),
                  in_shardings=(state_shardings, batch),
                  out_shardings=(state_shardings, rep), donate_argnums=0)
  evaluate = jax.jit(sharding.traced_under(evaluate, mesh, rules),
                     in_shardings=(state_shardings.params, batch),
                     out_shardings=rep)
  return train, evaluate
