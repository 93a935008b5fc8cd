"""Train state and the jitted train and eval steps.

A batch is a dict of int32 ``[batch, length]`` arrays: ``inputs``, ``targets``
and, for packed rows, ``inputs_segmentation``, ``targets_segmentation``,
``inputs_position``, ``targets_position`` (see :mod:`xfmr_jax.data.packing`).
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
from flax import struct
import jax
import jax.numpy as jnp
import optax

from xfmr_jax import losses
from xfmr_jax.model import Transformer

MODEL_KEYS = ('inputs', 'targets', 'inputs_segmentation', 'targets_segmentation',
              'inputs_position', 'targets_position')


class TrainState(struct.PyTreeNode):
  """Everything a resumed run needs, as one pytree (checkpointed whole).

  ``rng`` is raw key data; the dropout key of step ``s`` is
  ``fold_in(rng, s)``, so a resumed run draws the same masks.
  ``bad_step`` is the first step whose loss or gradients were not finite (-1
  if none); from then on updates are skipped so the state stays good.
  """
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  bad_step: jax.Array


def model_inputs(batch: dict) -> dict:
  return {k: batch[k] for k in MODEL_KEYS if k in batch}


def init_state(model: Transformer, tx: optax.GradientTransformation,
               seed: int, length: int = 8) -> TrainState:
  """Fresh state. Call under ``jax.jit`` (with ``out_shardings`` when sharded)."""
  params_key, dropout_key = jax.random.split(jax.random.key(seed))
  dummy = jnp.ones((1, length), jnp.int32)
  params = nn.unbox(model.init(params_key, dummy, dummy)['params'])
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(params),
                    rng=jax.random.key_data(dropout_key),
                    bad_step=jnp.full((), -1, jnp.int32))


def _loss_fn(params, batch, model, dropout_key, label_smoothing):
  logits = model.apply({'params': params}, **model_inputs(batch),
                       deterministic=dropout_key is None,
                       rngs=None if dropout_key is None else
                       {'dropout': dropout_key})
  weights = (batch['targets'] > 0).astype(jnp.float32)
  metrics = losses.token_metrics(logits, batch['targets'], weights,
                                 label_smoothing)
  # Mean over this batch's tokens: every token weighs the same.
  return metrics['loss'] / jnp.maximum(metrics['tokens'], 1.0), metrics


def train_step(state: TrainState, batch: dict, *, model: Transformer,
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
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  ok = finite & (state.bad_step < 0)
  keep = lambda new, old: jax.tree.map(
      lambda n, o: jnp.where(ok, n, o), new, old)
  new_state = state.replace(
      step=state.step + 1,
      params=keep(params, state.params),
      opt_state=keep(opt_state, state.opt_state),
      bad_step=jnp.where((state.bad_step < 0) & ~finite, state.step,
                         state.bad_step))
  metrics = dict(metrics, grad_norm=grad_norm)
  return new_state, metrics


def eval_step(params, batch: dict, *, model: Transformer,
              label_smoothing: float) -> dict:
  """Summed loss/NLL/accuracy over the real tokens of one batch."""
  _, metrics = _loss_fn(params, batch, model, None, label_smoothing)
  return metrics


def jit_steps(model: Transformer, tx: optax.GradientTransformation,
              label_smoothing: float, nan_at_step: int = -1):
  """The jitted ``(train_step, eval_step)``; the train state is donated."""
  train = jax.jit(functools.partial(train_step, model=model, tx=tx,
                                    label_smoothing=label_smoothing,
                                    nan_at_step=nan_at_step),
                  donate_argnums=0)
  evaluate = jax.jit(functools.partial(eval_step, model=model,
                                       label_smoothing=label_smoothing))
  return train, evaluate
