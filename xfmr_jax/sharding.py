"""Sharding across devices: one mesh, one table of rules.

Every parameter and the main activations carry *logical* axis names (``vocab``,
``embed``, ``joined_kv``, ``mlp``, ``layers``; ``batch``, ``length`` for
activations). :data:`RULES` maps them onto the three axes of the device mesh
``('data', 'fsdp', 'model')``; the mesh shape picks the layout:

==============  ===================  =============================================
layout          mesh (data,fsdp,model)  what is split
==============  ===================  =============================================
``dp``          ``(-1, 1, 1)``       the batch; parameters replicated
``fsdp``        ``(1, -1, 1)``       the batch, and parameters + optimiser state
                                     along ``embed``
``tp``          ``(1, 1, -1)``       heads (``joined_kv``), FFN (``mlp``) and
                                     ``vocab`` (Megatron-style); batch replicated
``fsdp_tp``     ``(1, -1, 2)``       both
==============  ===================  =============================================

``-1`` means "all remaining devices". Rules are read in order and a mesh axis
is used at most once per array, so an activation ``[batch, length, embed]``
gets ``batch -> ('data', 'fsdp')`` and leaves ``embed`` whole, while a weight
``[embed, mlp]`` gets ``('fsdp', 'model')``. A dimension that a mesh axis does
not divide stays unsplit along that axis.

    mesh = sharding.make_mesh((2, 4, 1))
    state, shardings = train_state.create_train_state(model, tx, 0, mesh)
    train_fn, eval_fn = train_steps.jit_steps(model, tx, 0.1, mesh=mesh,
                                        state_shardings=shardings)
    state, metrics = train_fn(state, sharding.global_batch(batch, mesh))

This module knows meshes, rules and arrays only; the train state's layout is
derived in :mod:`xfmr_jax.train_state`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

log = logging.getLogger('xfmr_jax')

MESH_AXES = ('data', 'fsdp', 'model')
BATCH_AXES = ('data', 'fsdp')  # the batch is split over both

# logical axis -> mesh axes, in order of precedence.
RULES = (
    ('batch', ('data', 'fsdp')),  # examples: data parallel (+ FSDP's share)
    ('vocab', 'model'),           # embedding rows / logits       (tensor par.)
    ('joined_kv', 'model'),       # attention heads x head_dim    (tensor par.)
    ('heads', 'model'),           # [.., heads, head_dim] activations
    ('mlp', 'model'),             # FFN hidden units              (tensor par.)
    ('embed', 'fsdp'),            # model width of every weight   (FSDP)
    ('length', None),
    ('layers', None),             # the nn.scan layer stack
)

PARALLELISM = {
    'dp': (-1, 1, 1),
    'fsdp': (1, -1, 1),
    'tp': (1, 1, -1),
    'fsdp_tp': (1, -1, 2),
}


# ------------------------------------------------------------------- mesh --

def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple:
  """``(data, fsdp, model)`` with at most one ``-1`` filled in."""
  shape = tuple(int(s) for s in shape)
  if len(shape) != len(MESH_AXES):
    raise ValueError(f'mesh_shape must have {len(MESH_AXES)} entries '
                     f'{MESH_AXES}, got {shape}')
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f'mesh_shape {shape}: sizes must be positive, with at '
                     'most one -1')
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f'mesh_shape {shape} does not divide {num_devices} '
                       'devices')
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ValueError(f'mesh_shape {shape} needs {math.prod(shape)} devices, '
                     f'there are {num_devices}')
  return shape


def make_mesh(mesh_shape: Sequence[int] = (-1, 1, 1),
              devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
  """A ``('data', 'fsdp', 'model')`` mesh with Auto axes over ``devices``."""
  devices = jax.devices() if devices is None else list(devices)
  shape = resolve_mesh_shape(mesh_shape, len(devices))
  return jax.make_mesh(shape, MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=devices)


def mesh_shape_from_config(config) -> tuple:
  """``config.mesh_shape`` if set, else the ``config.parallelism`` preset."""
  shape = tuple(config.get('mesh_shape') or ())
  if shape:
    return shape
  name = config.get('parallelism') or 'dp'
  if name not in PARALLELISM:
    raise ValueError(f'parallelism={name!r} is not one of '
                     f'{tuple(PARALLELISM)}')
  return PARALLELISM[name]


def rules_from_config(config) -> tuple:
  """``config.logical_axis_rules`` (pairs) if set, else :data:`RULES`."""
  rules = config.get('logical_axis_rules') or ()
  if not rules:
    return RULES
  out = []
  for name, axes in rules:
    if isinstance(axes, list):
      axes = tuple(axes)
    out.append((name, axes))
  return tuple(out)


@contextlib.contextmanager
def use(mesh, rules=RULES):
  """Run outside ``jit`` under ``mesh`` and ``rules`` (activations follow them)."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def traced_under(fn, mesh, rules):
  """``fn`` that traces with the mesh's abstract axes and the rules active."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
        nn.logical_axis_rules(rules):
      return fn(*args, **kwargs)
  return wrapped


# -------------------------------------------------------------- shardings --

def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh) -> NamedSharding:
  """``[batch, ...]`` arrays: rows split over ``('data', 'fsdp')``."""
  return NamedSharding(mesh, P(BATCH_AXES))


def _fit(spec: P, shape, mesh) -> P:
  """Drop the mesh axes of ``spec`` that do not divide their dimension."""
  out = []
  for i, axes in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if axes is None else (axes,) if isinstance(axes, str) else axes
    kept, size = [], 1
    for a in names:
      if shape[i] % (size * mesh.shape[a]) == 0:
        kept.append(a)
        size *= mesh.shape[a]
    out.append(None if not kept else kept[0] if len(kept) == 1 else
               tuple(kept))
  return P(*out)


def logical_to_shardings(logical_specs, abstract, mesh, rules=RULES):
  """NamedShardings for ``abstract`` (shapes) from logical PartitionSpecs."""
  def one(spec, x):
    mesh_spec = nn.logical_to_mesh_axes(tuple(spec), rules)
    return NamedSharding(mesh, _fit(mesh_spec, x.shape, mesh))
  return jax.tree.map(one, logical_specs, abstract,
                      is_leaf=lambda s: isinstance(s, P))


def global_batch(batch: dict, mesh, *, replicated_input: bool = False) -> dict:
  """Process-local numpy rows -> global ``jax.Array`` batch split over data axes.

  Each process passes its own rows (``make_train_iterator`` shards by
  process); with ``replicated_input`` every process passes the same whole
  batch (evaluation). Non-array entries (text) are dropped.
  """
  sharding = batch_sharding(mesh)
  out = {}
  for k, v in batch.items():
    v = np.asarray(v)
    if v.dtype.kind not in 'iufb':
      continue
    out[k] = jax.make_array_from_process_local_data(
        sharding, v, v.shape if replicated_input else None)
  return out


def describe(tree) -> dict:
  """``{path: PartitionSpec}`` of the jax.Arrays in ``tree`` (for logs, tests)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(k): v.sharding.spec for k, v in flat
          if isinstance(getattr(v, 'sharding', None), NamedSharding)}


# --------------------------------------------------------------- decoding --

def jit_decode(fn, model, mesh, params_shardings, rules=RULES, **static):
  """A decode function of :mod:`xfmr_jax.decode` jitted with explicit shardings.

  ``jit_decode(decode.greedy_decode, model, mesh, shardings.params,
  max_decode_len=20)(params, inputs)``: params laid out by the rules, inputs
  ``[batch, s]`` split over the data axes, outputs replicated.
  """
  inner = getattr(fn, '__wrapped__', fn)
  body = traced_under(functools.partial(inner, model, **static), mesh, rules)
  return jax.jit(body, in_shardings=(params_shardings, batch_sharding(mesh)),
                 out_shardings=replicated(mesh))


# ------------------------------------------------------------- multi-host --

def _cluster_detected() -> bool:
  """A Cloud TPU pod, SLURM or Open MPI job that JAX can set up by itself."""
  try:
    from jax._src import clusters  # pylint: disable=g-import-not-at-top
    return any(env.is_env_present() for env in clusters.ClusterEnv._cluster_types
               if not env.opt_in_only_method)
  except Exception:  # private API: if it moves, fall back to explicit flags
    return False


def initialize_distributed(coordinator_address: str = '',
                           num_processes: int = 0, process_id: int = -1,
                           mode: str = 'auto') -> bool:
  """Call ``jax.distributed.initialize`` when this run is multi-process.

  ``mode``: 'auto' initialises when a coordinator address is given (argument or
  ``JAX_COORDINATOR_ADDRESS``), or on a Cloud TPU / SLURM / Open MPI cluster
  that JAX detects; 'on' always; 'off' never. The process count and id come
  from the arguments, else ``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``, else the
  cluster. Must run before anything touches a device. Returns whether it
  initialised.
  """
  if mode not in ('auto', 'on', 'off'):
    raise ValueError(f"distributed mode must be 'auto', 'on' or 'off', got "
                     f'{mode!r}')
  if mode == 'off':
    return False
  address = coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS')
  count = num_processes or int(os.environ.get('JAX_NUM_PROCESSES', 0)) or None
  pid = process_id if process_id >= 0 else (
      int(os.environ['JAX_PROCESS_ID']) if 'JAX_PROCESS_ID' in os.environ
      else None)
  if mode == 'auto' and not address and not _cluster_detected():
    return False
  jax.distributed.initialize(coordinator_address=address or None,
                             num_processes=count, process_id=pid)
  log.info('process %d of %d, %d local / %d global devices',
           jax.process_index(), jax.process_count(), jax.local_device_count(),
           jax.device_count())
  return True
