"""Where a step's time goes: a per-operation profile of a compiled program.

    python -m experiments.benchmark.op_profile --size base --what beam4
    python -m experiments.benchmark.op_profile --size small --what train

Compiles one of the benchmark's programs (our train step, or a decoder on
the decode benchmark's batch), times a few calls, then runs it again under
``jax.profiler`` and reads the kernel events of the trace: each names the
HLO instruction it ran. Every instruction is looked up in the compiled HLO
(read by :mod:`experiments.benchmark.hlo_text`) for its source (the
``op_name`` metadata: which layer and primitive), the bytes of its operands
and result, and, for a matrix product (a ``dot``, or a fusion that holds
one), its FLOPs. Kernels are then summed by source with
the layer index merged (``decoder_*/ffn/dot_general``: all layers' FFN
products together), per call, with the GFLOP/s and GB/s each group ran at.

A kernel's time is its wall time on the thread that ran it; XLA runs
independent kernels on the two cores side by side, so the kernels' sum can
exceed the call's wall time; the profiler also slows many small kernels,
so the wall time of the profiled calls is reported beside the others. GB/s
counts each operand and the result once (an in-place update counts its
whole buffer): for a product with a few rows it is the rate at which the
weights were read, to hold against ``jnp.sum``'s bandwidth (the decode
benchmark's ``bandwidth``).
"""
from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import glob
import gzip
import json
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmark.common import (DROPOUT, SIZES, log, machine,
                                          random_batch)
from experiments.benchmark.decode import decode_params
from experiments.benchmark.hlo_text import flops, parse_hlo, shape_bytes
from experiments.benchmark.train import JaxTrain
from xfmr_jax import config as config_lib
from xfmr_jax import decode
from xfmr_jax.model import Transformer

WHATS = ('train', 'beam4', 'greedy', 'greedy_b1')

_CONTROL = ('while', 'conditional', 'call')
# op_name parts that are transformations, not source: jit(f), jvp(Model)...
_WRAPPER = r'(jit|pjit|jvp|transpose|remat|checkpoint|vmap)\(.*\)'


def origin(name: str, instructions: dict, computations: dict,
           frames: dict, users_of: dict) -> str:
  """An instruction's source group: its :func:`source`, taken from the
  instructions it fuses when it has no ``op_name`` of its own; a primitive
  outside any module (the optimizer's, the loss's) also names the function
  and line that traced it. ``users_of``: name -> the instructions that
  read it."""
  def named(n):
    ins = instructions[n]
    if ins.op_name or ins.calls not in computations:
      return ins
    inner = [instructions[i] for i in computations[ins.calls]
             if instructions[i].op_name]
    return inner[-1] if inner else ins   # the root is listed last

  def label(ins):
    key = source(ins.op_name)
    if '/' not in key and ins.stack_frame in frames:
      key = f'{key} in {frames[ins.stack_frame]}'
    return key

  found = named(name)
  if found.op_name:
    return label(found)
  # XLA rewrote it (a one-row product becomes a matrix-vector ``dot``
  # without metadata); the operation that consumes it keeps the source.
  users = [named(u) for u in users_of.get(name, ())]
  user = next((u for u in users if u.op_name), None)
  opcode = instructions[name].opcode
  if user is None:
    return f'({opcode}, no source: XLA-made)'
  return f'{opcode} feeding {label(user)}'


def source(op_name: str) -> str:
  """The readable source of an ``op_name``: transformation and control-flow
  wrappers dropped, the backward pass marked, layer indices merged
  (``decoder_3`` -> ``decoder_*``)."""
  backward = 'transpose(' in op_name
  parts = []
  for part in op_name.split('/'):
    if re.fullmatch(_WRAPPER, part):
      continue
    if part in ('while', 'body', 'cond', 'closed_call', 'branch_0_fun',
                'branch_1_fun', 'rematted_computation'):
      continue
    parts.append(re.sub(r'_\d+$', '_*', part))
  text = '/'.join(parts) or '(unnamed)'
  return f'backward: {text}' if backward else text


def kernel_events(trace_dir: str, module: str) -> list:
  """``(instruction name, microseconds)`` of every kernel the trace recorded
  for the HLO module ``module``."""
  paths = glob.glob(f'{trace_dir}/**/*.trace.json.gz', recursive=True)
  if not paths:
    raise RuntimeError(f'jax.profiler wrote no trace under {trace_dir}')
  with gzip.open(paths[0]) as f:
    events = json.load(f)['traceEvents']
  return [(e['args']['hlo_op'], e['dur']) for e in events
          if e.get('ph') == 'X' and 'hlo_op' in e.get('args', {})
          and e['args'].get('hlo_module') == module]


def profile(run, hlo: str, *, calls: int = 3, top: int = 25) -> dict:
  """Times ``calls`` calls of ``run()`` (already compiled and warm), then
  profiles as many more, and attributes the kernels to ``hlo``, the compiled
  module's text (:mod:`experiments.benchmark.hlo_text`)."""
  instructions, computations, frames = parse_hlo(hlo)
  module = re.match(r'HloModule ([\w.\-]+)', hlo).group(1)
  users_of = collections.defaultdict(list)
  for user, ins in instructions.items():
    for operand in ins.operands:
      users_of[operand].append(user)
  walls = []
  for _ in range(calls):
    t0 = time.perf_counter()
    run()
    walls.append(time.perf_counter() - t0)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      t0 = time.perf_counter()
      for _ in range(calls):
        run()
      profiled = (time.perf_counter() - t0) / calls
    events = kernel_events(trace_dir, module)
  # A loop's or a branch's event spans the kernels of its body, which the
  # trace records too.
  events = [(n, us) for n, us in events
            if n not in instructions or instructions[n].opcode not in _CONTROL]
  if not events:
    raise RuntimeError(f'the trace holds no kernel of module {module}')
  groups = collections.defaultdict(lambda: dict(us=0.0, kernels=0, flops=0.0,
                                                bytes=0.0))
  total_us = matmul_us = matmul_flops = 0.0
  # Each instruction's source, FLOPs and bytes once, however often it ran.
  runs = collections.defaultdict(lambda: [0.0, 0])
  for name, us in events:
    runs[name][0] += us
    runs[name][1] += 1
  for name, (us, count) in runs.items():
    ins = instructions.get(name)
    key = (origin(name, instructions, computations, frames, users_of) if ins
           else f'({name})')
    f = count * flops(name, instructions, computations) if ins else 0.0
    moved = count * (shape_bytes(ins.shape) + sum(
        shape_bytes(instructions[o].shape) for o in ins.operands
        if o in instructions)) if ins else 0.0
    g = groups[key]
    g['us'] += us
    g['kernels'] += count
    g['flops'] += f
    g['bytes'] += moved
    total_us += us
    if f:
      matmul_us += us
      matmul_flops += f
  per_call = lambda us: us / 1e3 / calls
  rows = []
  for key, g in sorted(groups.items(), key=lambda kv: -kv[1]['us']):
    s = g['us'] / 1e6
    rows.append(dict(source=key, ms_per_call=per_call(g['us']),
                     kernels_per_call=g['kernels'] / calls,
                     share=g['us'] / total_us,
                     gflop_per_s=g['flops'] / s / 1e9 if g['flops'] else None,
                     gb_per_s=g['bytes'] / s / 1e9 if s else None))
  return dict(machine=machine(), calls=calls,
              wall_ms_per_call=float(np.median(walls)) * 1e3,
              profiled_wall_ms_per_call=profiled * 1e3,
              kernel_ms_per_call=per_call(total_us),
              kernels_per_call=len(events) / calls,
              matmul_ms_per_call=per_call(matmul_us),
              matmul_gflop_per_s=(matmul_flops / (matmul_us / 1e6) / 1e9
                                  if matmul_us else None),
              groups=rows[:top], groups_total=len(rows))


def build(what: str, size: str, *, batch: int | None = None,
          length: int = 64, changes: dict | None = None):
  """``(run, hlo, description)`` for one benchmark program, compiled
  and run once (``what`` in :data:`WHATS`; ``changes``: ModelConfig fields
  set beside the size's, such as ``scan_layers=True``)."""
  if what not in WHATS:
    raise ValueError(f'--what must be one of {WHATS}, got {what!r}')
  if size not in SIZES:
    raise ValueError(f'--size must be one of {sorted(SIZES)}, got {size!r}')
  spec = SIZES[size]
  fields = dict(spec['model'], dropout_rate=DROPOUT)
  unknown = set(changes or {}) - {f.name for f in
                                  dataclasses.fields(config_lib.ModelConfig)}
  if unknown:
    raise ValueError(f'--set: ModelConfig has no field {sorted(unknown)}')
  cfg = config_lib.ModelConfig(**{**fields, **(changes or {})})
  if what == 'train':
    rows = batch or spec['batch']
    step = JaxTrain(cfg, random_batch(cfg.vocab_size, rows, spec['length']))
    return (step, step.compiled.as_text(),
            f'train step, batch {rows} x {spec["length"]} + {spec["length"]}')
  rows = 1 if what == 'greedy_b1' else batch or spec['decode_batch']
  model = Transformer(cfg)
  params = decode_params(model, spec['length'])
  inputs = jnp.asarray(random_batch(cfg.vocab_size, rows, spec['length'],
                                    seed=1)['inputs'])
  if what == 'beam4':
    lowered = decode.beam_search.lower(model, params, inputs, beam_size=4,
                                       max_decode_len=length)
  else:
    lowered = decode.greedy_decode.lower(model, params, inputs,
                                         max_decode_len=length)
  compiled = lowered.compile()
  run = lambda: jax.block_until_ready(compiled(params, inputs))
  run()
  return run, compiled.as_text(), (f'{what}, {rows} sentences of '
                                   f'{spec["length"]} tokens, {length} steps')


def format_profile(res: dict, title: str) -> str:
  lines = [f'{title} on {res["machine"]}',
           f'wall {res["wall_ms_per_call"]:.1f} ms a call (median of '
           f'{res["calls"]}; {res["profiled_wall_ms_per_call"]:.1f} ms while '
           f'profiled); kernels {res["kernel_ms_per_call"]:.1f} ms '
           f'({res["kernels_per_call"]:.0f} kernels) a call, of which matrix '
           f'products {res["matmul_ms_per_call"]:.1f} ms'
           + (f' at {res["matmul_gflop_per_s"]:.0f} GFLOP/s'
              if res['matmul_gflop_per_s'] else ''),
           '',
           '| ms / call | share | kernels / call | GFLOP/s | GB/s | source |',
           '|---:|---:|---:|---:|---:|---|']
  fmt = lambda v: '' if v is None else f'{v:.1f}'
  for r in res['groups']:
    lines.append(f'| {r["ms_per_call"]:.2f} | {100 * r["share"]:.1f}% | '
                 f'{r["kernels_per_call"]:.0f} | {fmt(r["gflop_per_s"])} | '
                 f'{fmt(r["gb_per_s"])} | `{r["source"]}` |')
  if res['groups_total'] > len(res['groups']):
    lines.append(f'({res["groups_total"] - len(res["groups"])} smaller '
                 'groups not shown)')
  return '\n'.join(lines)


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--size', default='small', help=f'one of {sorted(SIZES)}')
  p.add_argument('--what', default='beam4', help=f'one of {WHATS}')
  p.add_argument('--batch', type=int, default=None,
                 help="rows (default: the size's train or decode batch; "
                      'greedy_b1 decodes one)')
  p.add_argument('--length', type=int, default=64,
                 help='decoder steps of a decoding call')
  p.add_argument('--calls', type=int, default=3,
                 help='calls timed, then as many profiled')
  p.add_argument('--top', type=int, default=25, help='source groups shown')
  p.add_argument('--set', action='append', default=[], metavar='FIELD=VALUE',
                 help='a ModelConfig field to change, e.g. scan_layers=True '
                 '(repeatable)')
  p.add_argument('--json', default=None, help='write the profile here')
  return p.parse_args(argv)


def _changes(pairs) -> dict:
  """``['scan_layers=True', 'positional=rope']`` -> ``{'scan_layers': True,
  'positional': 'rope'}`` (a value that is no Python literal is a string)."""
  changes = {}
  for pair in pairs:
    name, sep, value = pair.partition('=')
    if not sep or not name:
      raise ValueError(f'--set takes FIELD=VALUE, got {pair!r}')
    try:
      changes[name] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      changes[name] = value
  return changes


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  for name in ('batch', 'length', 'calls', 'top'):
    value = getattr(args, name)
    if value is not None and value < 1:
      sys.exit(f'error: --{name} must be at least 1, got {value}')
  try:
    changes = _changes(args.set)
    run, hlo, title = build(args.what, args.size, batch=args.batch,
                            length=args.length, changes=changes)
  except ValueError as e:
    sys.exit(f'error: {e}')
  log(f'[{args.size}] {args.what}: profiling {args.calls} calls ...')
  res = profile(run, hlo, calls=args.calls, top=args.top)
  res.update(size=args.size, what=args.what, title=title, changes=changes)
  changed = ''.join(f', {pair}' for pair in args.set)
  print(format_profile(res, f'{args.size}{changed}: {title}'))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(res, f, indent=1)


if __name__ == '__main__':
  main()
