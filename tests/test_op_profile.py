"""The per-operation profile: HLO parsing, FLOPs, attribution, the CLI."""
import inspect
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmark import hlo_text, op_profile


def _program(rows):
  """Two products under named scopes, a tanh between: ``[rows, 256] @
  [256, 1024]``, then ``@ [1024, 128]``."""
  def f(x, w1, w2):
    with jax.named_scope('wide'):
      h = jnp.tanh(x @ w1)
    with jax.named_scope('narrow'):
      return h @ w2
  rng = np.random.default_rng(0)
  args = [jnp.asarray(rng.standard_normal(s), jnp.float32)
          for s in ((rows, 256), (256, 1024), (1024, 128))]
  compiled = jax.jit(f).lower(*args).compile()
  run = lambda: jax.block_until_ready(compiled(*args))
  return run, compiled.as_text(), args


def test_parsed_hlo_gives_shapes_bytes_product_flops_and_frames():
  _, hlo, args = _program(rows=16)
  instructions, computations, frames = hlo_text.parse_hlo(hlo)
  # Each product's stack frame names the function, file and line of its `@`.
  lines, first = inspect.getsourcelines(_program)
  expected = {f'_program.<locals>.f (test_op_profile.py:{first + k})'
              for k, line in enumerate(lines) if ' @ w' in line}
  assert len(expected) == 2
  assert {frames[i.stack_frame] for i in instructions.values()
          if i.opcode == 'dot'} == expected
  fused = {i.calls for i in instructions.values() if i.opcode == 'fusion'}
  # The entry computation: the one no instruction calls.
  entry, = [c for c in computations if not any(
      re.search(rf'%{re.escape(c)}\b', i.attributes)
      for i in instructions.values())]
  params = [instructions[n] for n in computations[entry]
            if instructions[n].opcode == 'parameter']
  assert sorted(hlo_text.shape_bytes(p.shape) for p in params) == \
      sorted(a.nbytes for a in args)
  total = sum(hlo_text.flops(n, instructions, computations)
              for c, names in computations.items() if c not in fused
              for n in names)
  assert total == 2 * 16 * 256 * 1024 + 2 * 16 * 1024 * 128
  assert hlo_text.shape_bytes('(f32[2,3]{1,0}, s32[], pred[4])') == 24 + 4 + 4


def test_source_drops_wrappers_marks_backward_and_merges_layers():
  assert op_profile.source(
      'jit(beam_search)/while/body/closed_call/Transformer.decode_step/'
      'decoder_3/ffn_block/ffn/dot_general') == \
      'Transformer.decode_step/decoder_*/ffn_block/ffn/dot_general'
  assert op_profile.source(
      'jit(train_step)/transpose(jvp(Transformer))/Transformer.encode/'
      'encoder_0/attention_block/norm/reduce_sum') == \
      'backward: Transformer.encode/encoder_*/attention_block/norm/reduce_sum'


@pytest.mark.parametrize('rows', [16, 1])
def test_profile_attributes_each_product_to_its_scope(rows):
  run, hlo, _ = _program(rows)
  run()
  res = op_profile.profile(run, hlo, calls=2, top=50)
  groups = {g['source']: g for g in res['groups']}
  assert sum(g['share'] for g in res['groups']) == pytest.approx(1.0)
  wide = [g for k, g in groups.items() if 'wide' in k and g['gflop_per_s']]
  narrow = [g for k, g in groups.items() if 'narrow' in k and g['gflop_per_s']]
  # Each product lands in its own scope's group, once per call (a one-row
  # product, which XLA rewrites without metadata, through its consumer).
  assert len(wide) == 1 and len(narrow) == 1
  for g, flops in ((wide[0], 2 * rows * 256 * 1024),
                   (narrow[0], 2 * rows * 1024 * 128)):
    assert g['kernels_per_call'] == 1
    seconds = g['ms_per_call'] / 1e3
    assert g['gflop_per_s'] == pytest.approx(flops / seconds / 1e9, rel=1e-6)
  assert res['matmul_ms_per_call'] <= res['kernel_ms_per_call']
  assert res['wall_ms_per_call'] > 0


def test_cli_profiles_a_train_step_and_refuses_unknown_programs(tmp_path,
                                                                  capsys):
  out = tmp_path / 'profile.json'
  op_profile.main(['--size', 'tiny', '--what', 'train', '--calls', '1',
                   '--top', '5', '--json', str(out)])
  res = json.loads(out.read_text())
  assert len(res['groups']) == 5 and res['groups_total'] > 5
  sources = [g['source'] for g in res['groups']]
  assert sources == [g['source'] for g in sorted(
      res['groups'], key=lambda g: -g['ms_per_call'])]
  assert '| ms / call |' in capsys.readouterr().out
  with pytest.raises(SystemExit, match='--what must be one of'):
    op_profile.main(['--size', 'tiny', '--what', 'sampling'])
  with pytest.raises(SystemExit, match='--size must be one of'):
    op_profile.main(['--size', 'huge'])
  with pytest.raises(SystemExit, match='--calls must be at least 1, got 0'):
    op_profile.main(['--size', 'tiny', '--calls', '0'])
  with pytest.raises(SystemExit, match=r"no field \['scan'\]"):
    op_profile.main(['--size', 'tiny', '--set', 'scan=True'])
  with pytest.raises(SystemExit, match='--set takes FIELD=VALUE'):
    op_profile.main(['--size', 'tiny', '--set', 'scan_layers'])


def test_set_changes_the_profiled_model():
  """``--set`` changes the model: the scanned stack runs its layers in a
  loop, so each layer's kernels are one group without a layer index."""
  res = op_profile.profile(*op_profile.build(
      'greedy', 'tiny', length=4,
      changes=op_profile._changes(['scan_layers=True']))[:2],
      calls=1, top=500)
  sources = ' '.join(g['source'] for g in res['groups'])
  assert 'decoder_*' not in sources and 'decoder/' in sources
  assert op_profile._changes(['positional=rope', 'd_ff=64']) == dict(
      positional='rope', d_ff=64)
