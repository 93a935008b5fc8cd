"""Sharding checks on 8 simulated CPU devices: every layout trains like one
device, parameters sit where the rules say, checkpoints move between meshes,
decoding is unchanged, and two processes train together.

``tests/test_sharding.py`` runs this file in one pytest subprocess with
``JAX_NUM_CPU_DEVICES=8`` (the rest of the suite keeps one device) and reports
each check as its own test. Run it directly with
``JAX_NUM_CPU_DEVICES=8 python -m pytest tests/sharding_checks.py``.
"""
import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from xfmr_jax import checkpoint, decode, model as model_lib, optim, sharding
from xfmr_jax import train_state, train_steps
from xfmr_jax.config import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH, VOCAB, STEPS = 8, 64, 2
LAYOUTS = {'dp': (8, 1, 1), 'fsdp': (1, 8, 1), 'tp': (1, 1, 8),
           'fsdp_tp': (1, 4, 2), 'dp_fsdp': (2, 4, 1)}
TOL = dict(rtol=1e-5, atol=1e-5)


def model_and_optimizer(**changes):
  cfg = ModelConfig(**{**dict(
      vocab_size=VOCAB, d_model=32, num_heads=8, num_encoder_layers=1,
      num_decoder_layers=1, d_ff=64, max_len=32, dropout_rate=0.1), **changes})
  # Adam's eps = 1 makes an update ~ lr * g rather than lr * sign(g), so the
  # float noise of a different reduction order cannot flip near-zero updates.
  return model_lib.build(cfg), optim.make_optimizer(d_model=32,
                                                    warmup_steps=5, eps=1.0)


def batches(n=STEPS, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    b = {'inputs': rng.integers(3, VOCAB, (BATCH, 12)).astype(np.int32),
         'targets': rng.integers(3, VOCAB, (BATCH, 10)).astype(np.int32)}
    b['inputs'][:, 9:] = 0  # some padding
    b['targets'][::2, 7:] = 0
    out.append(b)
  return out


def mesh_of(shape):
  return sharding.make_mesh(shape, jax.devices()[:int(np.prod(shape))])


_STEPS = {}


def steps_for(shape):
  """``(mesh, shardings, train_fn)`` per mesh shape, jitted once per module."""
  if shape not in _STEPS:
    model, tx = model_and_optimizer()
    mesh = mesh_of(shape)
    shardings = train_state.state_shardings(model, tx, mesh)
    train_fn, _ = train_steps.jit_steps(model, tx, 0.1, mesh=mesh,
                                  state_shardings=shardings)
    _STEPS[shape] = mesh, shardings, train_fn
  return _STEPS[shape]


def run(shape, state=None, data=None):
  mesh, _, train_fn = steps_for(shape)
  if state is None:
    model, tx = model_and_optimizer()
    state, _ = train_state.create_train_state(model, tx, 0, mesh)
  losses = []
  for b in batches() if data is None else data:
    state, metrics = train_fn(state, sharding.global_batch(b, mesh))
    losses.append(float(metrics['loss']))
  return state, losses


def train_unsharded(**changes):
  """The unsharded code path (no mesh) on one device: the reference."""
  model, tx = model_and_optimizer(**changes)
  state = jax.jit(lambda: train_state.init_state(model, tx, 0))()
  train_fn, _ = train_steps.jit_steps(model, tx, 0.1)
  losses = []
  for b in batches():
    state, metrics = train_fn(state, b)
    losses.append(float(metrics['loss']))
  return jax.device_get(state), losses


@pytest.fixture(scope='module')
def single_device():
  return train_unsharded()


def assert_trees_close(a, b, **tol):
  a, b = jax.device_get(a), jax.device_get(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, **(tol or TOL))


def test_needs_eight_devices():
  assert jax.device_count() == 8, 'run with JAX_NUM_CPU_DEVICES=8'


# ---------------------------------------------------------------- layouts --

# fsdp_tp and dp_fsdp: 2-D meshes, trained on (and compared with a continued
# run) by test_checkpoint_restores_onto_other_meshes in the default run.
SLOW_LAYOUTS = ('fsdp_tp', 'dp_fsdp')
assert set(SLOW_LAYOUTS) <= set(LAYOUTS)


@pytest.mark.parametrize('layout', [
    pytest.param(k, marks=pytest.mark.slow) if k in SLOW_LAYOUTS else k
    for k in LAYOUTS])
def test_layout_trains_like_one_device(layout, single_device):
  ref_state, ref_losses = single_device
  state, losses = run(LAYOUTS[layout])
  np.testing.assert_allclose(losses, ref_losses, **TOL)
  assert_trees_close(state.params, ref_state.params)
  assert_trees_close(state.opt_state, ref_state.opt_state)
  assert int(state.step) == STEPS
  # The state keeps the layout it was created with (donated, not re-laid).
  _, shardings, _ = steps_for(LAYOUTS[layout])
  for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
    assert leaf.sharding == want


def test_mesh_shapes_and_presets():
  assert sharding.resolve_mesh_shape((-1, 1, 1), 8) == (8, 1, 1)
  assert sharding.resolve_mesh_shape((2, -1, 2), 8) == (2, 2, 2)
  for bad in ((3, -1, 1), (2, 2, 1), (-1, -1, 1), (8, 1)):
    with pytest.raises(ValueError):
      sharding.resolve_mesh_shape(bad, 8)
  mesh = sharding.make_mesh(sharding.PARALLELISM['fsdp_tp'])
  assert dict(mesh.shape) == {'data': 1, 'fsdp': 4, 'model': 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


# ------------------------------------------------------------------ rules --

def spec(tree, *path):
  for p in path:
    tree = tree[p]
  return tree.sharding.spec


def test_parameters_and_optimizer_state_follow_the_rules():
  model, tx = model_and_optimizer()
  mesh = mesh_of((1, 4, 2))  # fsdp x model
  state, _ = train_state.create_train_state(model, tx, 0, mesh)
  p = state.params
  emb = p['source_embed']['embedding']
  assert emb.sharding.spec == P('model', 'fsdp')   # [vocab, embed]
  assert emb.addressable_shards[0].data.shape == (VOCAB // 2, 32 // 4)
  attn = p['encoder_0']['self_attention']
  for name in ('query', 'key', 'value'):
    assert spec(attn, name, 'kernel') == P('fsdp', 'model')  # heads on model
    assert spec(attn, name, 'bias') == P('model')
  assert spec(attn, 'out', 'kernel') == P('model', 'fsdp')
  ffn = p['decoder_0']['ffn']
  assert spec(ffn, 'wi') == P('fsdp', 'model')       # [embed, mlp]
  assert spec(ffn, 'wo') == P('model', 'fsdp')       # [mlp, embed]
  assert spec(ffn, 'bi') == P('model')
  assert spec(p, 'decoder_0', 'ffn_block', 'norm', 'scale') == P('fsdp')
  # Adam's moments are laid out like the parameters; the count is replicated.
  adam, = [s for s in jax.tree.leaves(
      state.opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
  for moments in (adam.mu, adam.nu):
    assert sharding.describe(moments) == sharding.describe(p)
  assert adam.count.sharding.spec == P()
  assert state.step.sharding.is_fully_replicated
  assert state.rng.sharding.is_fully_replicated
  # No device holds a whole FSDP/TP-sharded matrix.
  wi = ffn['wi']
  assert wi.addressable_shards[0].data.size * 8 == wi.size


def test_pure_data_parallel_replicates_parameters():
  model, tx = model_and_optimizer()
  shardings = train_state.state_shardings(model, tx, mesh_of((8, 1, 1)))
  assert all(s.is_fully_replicated for s in jax.tree.leaves(shardings))


def test_scanned_stack_and_activations_follow_the_rules():
  model, tx = model_and_optimizer(scan_layers=True)
  shardings = train_state.state_shardings(model, tx, mesh_of((1, 4, 2)))
  wi = shardings.params['encoder']['ffn']['wi']
  assert wi.spec == P(None, 'fsdp', 'model')  # [layers, embed, mlp]
  rules = sharding.RULES
  import flax.linen as nn
  # Activations [batch, length, embed]: batch takes data and fsdp, so embed
  # stays whole; a weight's embed takes fsdp.
  assert nn.logical_to_mesh_axes(('batch', 'length', 'embed'), rules) == P(
      ('data', 'fsdp'), None, None)
  assert nn.logical_to_mesh_axes(('embed', 'mlp'), rules) == P('fsdp', 'model')


def test_axes_that_do_not_divide_stay_whole():
  model, tx = model_and_optimizer(vocab_size=63)
  shardings = train_state.state_shardings(model, tx, mesh_of((1, 4, 2)))
  assert shardings.params['source_embed']['embedding'].spec == P(None, 'fsdp')


def test_state_is_created_sharded_by_one_jit():
  """The init is one jit whose outputs are already the FSDP shards: each
  device's output buffer holds 1/8 of the sharded parameters."""
  model, tx = model_and_optimizer()
  mesh = mesh_of((1, 8, 1))
  shardings = train_state.state_shardings(model, tx, mesh)
  init = jax.jit(sharding.traced_under(lambda: train_state.init_state(model, tx, 0),
                                       mesh, sharding.RULES),
                 out_shardings=shardings)
  compiled = init.lower().compile()
  assert jax.tree.leaves(compiled.output_shardings) == jax.tree.leaves(
      shardings)
  stats = compiled.memory_analysis()
  if stats is not None:
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(lambda: train_state.init_state(model, tx, 0))))
    assert stats.output_size_in_bytes < total / 2


# ------------------------------------------------------------ checkpoints --

def test_checkpoint_restores_onto_other_meshes(tmp_path):
  data = batches(STEPS + 1, seed=1)
  state, _ = run((2, 4, 1), data=data[:STEPS])
  saved = jax.device_get(state)
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(STEPS, state, checkpoint.gather_data_state({'pos': 7}), {})
  ckpt.wait()
  expected, expected_loss = run((2, 4, 1), state=state, data=data[STEPS:])
  model, tx = model_and_optimizer()
  for shape in ((1, 1, 1), (8, 1, 1), (1, 4, 2)):
    mesh, shardings, _ = steps_for(shape)
    target = train_state.abstract_state(model, tx, mesh)
    step, restored, data_state, _ = ckpt.restore(target)
    assert step == STEPS and checkpoint.process_data_state(data_state) == {
        'pos': 7}
    for leaf, want in zip(jax.tree.leaves(restored), jax.tree.leaves(
        shardings)):
      assert leaf.sharding == want, shape
    assert_trees_close(restored, saved, rtol=0, atol=0)
    after, loss = run(shape, state=restored, data=data[STEPS:])
    np.testing.assert_allclose(loss, expected_loss, **TOL)
    assert_trees_close(after, expected)
  ckpt.close()


# --------------------------------------------------------------- decoding --

def test_decode_under_a_mesh_gives_the_same_tokens(single_device):
  model, _ = model_and_optimizer()
  params = single_device[0].params
  inputs = batches(1, seed=2)[0]['inputs']
  want = np.asarray(decode.greedy_decode(model, params, inputs,
                                         max_decode_len=12))
  mesh, shardings, _ = steps_for((1, 4, 2))
  sharded = jax.device_put(params, shardings.params)
  greedy = sharding.jit_decode(decode.greedy_decode, model, mesh,
                               shardings.params, max_decode_len=12)
  out = greedy(sharded, inputs)
  assert out.sharding.is_fully_replicated
  np.testing.assert_array_equal(np.asarray(out), want)
  # The path Translator takes: the plain jitted function under the mesh.
  with sharding.use(mesh):
    beam, _ = decode.beam_search(model, sharded, inputs, beam_size=2,
                                 max_decode_len=12)
  want_beam, _ = decode.beam_search(model, params, inputs, beam_size=2,
                                    max_decode_len=12)
  np.testing.assert_array_equal(np.asarray(beam), np.asarray(want_beam))


def test_decode_under_a_mesh_reading_the_filled_slots(single_device,
                                                      monkeypatch):
  """The cache read up to its filled slots (a lax.switch per step, here
  forced on at this small size) under a mesh: the same tokens as one
  device reading the whole cache."""
  from xfmr_jax import attention
  model, _ = model_and_optimizer()
  params = single_device[0].params
  inputs = batches(1, seed=2)[0]['inputs']
  want = [np.asarray(decode.greedy_decode(model, params, inputs,
                                          max_decode_len=12)),
          np.asarray(decode.beam_search(model, params, inputs, beam_size=2,
                                        max_decode_len=12)[0])]
  monkeypatch.setattr(attention, 'MIN_CHUNK_BYTES', 0)
  monkeypatch.setattr(attention, 'MIN_CACHE_CHUNK', 4)  # 12 slots: 3 bounds
  jax.clear_caches()  # the constants are read while tracing
  mesh, shardings, _ = steps_for((1, 4, 2))
  sharded = jax.device_put(params, shardings.params)
  with sharding.use(mesh):
    got = [np.asarray(decode.greedy_decode(model, sharded, inputs,
                                           max_decode_len=12)),
           np.asarray(decode.beam_search(model, sharded, inputs, beam_size=2,
                                         max_decode_len=12)[0])]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


# --------------------------------------------------------------- variants --

VARIANTS = {
    'decoder_only_gqa_rope_swiglu': dict(
        model_kind='decoder_only', num_kv_heads=2, positional='rope',
        activation='swiglu', use_bias=False, norm_type='rmsnorm',
        norm_position='pre'),
    'mqa_alibi_xla_attention': dict(num_kv_heads=1, positional='alibi',
                                    attention_impl='xla', scan_layers=True),
    'local_global_alibi_gqa': dict(
        attention_kind='local', attention_window=4, attention_global_tokens=2,
        positional='alibi', num_kv_heads=2),
    'decoder_only_linear_favor_rope_peri': dict(
        model_kind='decoder_only', attention_kind='linear',
        linear_feature_map='favor', positional='rope', num_kv_heads=2,
        norm_position='peri', scan_layers=True),
}


# The default run keeps the decoder-only GQA model; an encoder-decoder under
# the same mesh trains and decodes in the layout and decode checks above.
SLOW_VARIANTS = ('mqa_alibi_xla_attention', 'local_global_alibi_gqa',
                 'decoder_only_linear_favor_rope_peri')
assert set(SLOW_VARIANTS) <= set(VARIANTS)


@pytest.mark.parametrize('variant', [
    pytest.param(k, marks=pytest.mark.slow) if k in SLOW_VARIANTS else k
    for k in VARIANTS])
def test_variant_trains_and_decodes_like_one_device(variant):
  model, tx = model_and_optimizer(**VARIANTS[variant])
  state, want = train_unsharded(**VARIANTS[variant])
  mesh = mesh_of((1, 4, 2))
  sharded, shardings = train_state.create_train_state(model, tx, 0, mesh)
  train_sharded, _ = train_steps.jit_steps(model, tx, 0.1, mesh=mesh,
                                     state_shardings=shardings)
  losses = []
  for b in batches():
    sharded, metrics = train_sharded(sharded, sharding.global_batch(b, mesh))
    losses.append(float(metrics['loss']))
  np.testing.assert_allclose(losses, want, **TOL)
  assert_trees_close(sharded.params, state.params)
  # The smaller key/value projections are split over 'model' like the rest.
  kv = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(
      sharded.params) if 'key' in jax.tree_util.keystr(path) and
        leaf.ndim >= 2]
  assert kv and all(leaf.sharding.spec[-1] == 'model' for leaf in kv)
  inputs = batches(1, seed=2)[0]['inputs']
  greedy = sharding.jit_decode(decode.greedy_decode, model, mesh,
                               shardings.params, max_decode_len=12)
  np.testing.assert_array_equal(
      np.asarray(greedy(sharded.params, inputs)),
      np.asarray(decode.greedy_decode(model, state.params, inputs,
                                      max_decode_len=12)))


# ------------------------------------------------------------- multi-host --

def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_two_processes_train_together(tmp_path, single_device):
  port = _free_port()
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(('JAX_', 'XLA_'))}
  procs = [subprocess.Popen(
      [sys.executable, '-m', 'tests.multiprocess_worker', str(port), str(i),
       str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=240)
      assert p.returncode == 0, err[-3000:]
      outs.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  ref_state, ref_losses = single_device
  ref_sum = float(sum(np.sum(x) for x in jax.tree.leaves(ref_state.params)))
  for i, o in enumerate(outs):
    assert o['process'] == i and o['local_devices'] == 2
    np.testing.assert_allclose(o['losses'], ref_losses, **TOL)
    np.testing.assert_allclose(o['checksum'], ref_sum, rtol=1e-5)
    assert o['restored_step'] == STEPS
    assert o['data_state'] == {'me': i}  # each process got its own position
  assert (tmp_path / 'checkpoints' / str(STEPS)).is_dir()
