"""The train state: one pytree holding everything a resumed run needs, and
its creation, plain or laid out over a device mesh.

Sharded creation reads the logical axis names that ``init`` leaves on every
parameter (``nn.Partitioned`` boxes) and turns them into shardings with
:mod:`xfmr_jax.sharding`'s rules, so each device creates only its own shards.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax import struct
import jax
import jax.numpy as jnp
import optax

from xfmr_jax import sharding


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


def boxed_init_state(model: nn.Module, tx: optax.GradientTransformation,
                     seed: int, length: int = 8) -> TrainState:
  """Fresh state whose params and optimiser moments are still ``nn.Partitioned``
  boxes carrying their logical axis names (``nn.get_partition_spec`` reads
  them; :func:`state_shardings` turns them into shardings)."""
  params_key, dropout_key = jax.random.split(jax.random.key(seed))
  dummy = jnp.ones((1, length), jnp.int32)
  params = model.init(params_key, dummy, dummy)['params']
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(params),
                    rng=jax.random.key_data(dropout_key),
                    bad_step=jnp.full((), -1, jnp.int32))


def init_state(model: nn.Module, tx: optax.GradientTransformation,
               seed: int, length: int = 8) -> TrainState:
  """Fresh state. Call under ``jax.jit``; for a sharded state use
  :func:`create_train_state` (``jit`` with ``out_shardings``)."""
  return nn.unbox(boxed_init_state(model, tx, seed, length))


# --------------------------------------------------------- sharded creation --

def state_shardings(model, tx, mesh, rules=sharding.RULES, seed: int = 0):
  """``TrainState`` of NamedShardings: params and optimiser state by rules."""
  boxed = jax.eval_shape(lambda: boxed_init_state(model, tx, seed))
  specs = nn.get_partition_spec(boxed)
  return sharding.logical_to_shardings(specs, nn.unbox(boxed), mesh, rules)


def abstract_state(model, tx, mesh, rules=sharding.RULES, seed: int = 0):
  """``ShapeDtypeStruct`` train state with shardings: a restore target."""
  shapes = jax.eval_shape(lambda: init_state(model, tx, seed))
  shardings = state_shardings(model, tx, mesh, rules, seed)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=s),
                      shapes, shardings)


def create_train_state(model, tx, seed: int, mesh, rules=sharding.RULES):
  """``(state, shardings)``: the state is created already sharded by one jit."""
  shardings = state_shardings(model, tx, mesh, rules, seed)
  init = jax.jit(sharding.traced_under(lambda: init_state(model, tx, seed),
                               mesh, rules), out_shardings=shardings)
  return init(), shardings
