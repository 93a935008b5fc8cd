r"""Full, local and linear attention against sequence length n.

    python -m experiments.benchmark.long_attention --out docs/long_attention

For each attention kind and n = 256 .. 16384 it times forward + backward
(the gradient of a scalar loss with respect to parameters and input) of

* ``layer``: one causal self-attention layer
  (``multi_head_attention.MultiHeadAttention``, d_model 256, 4 heads of 64),
  batch 1;
* ``model``: a small decoder-only model (d_model 256, 4 heads, 2 layers,
  d_ff 1024, vocabulary 1000, RoPE), batch 1, n/2 source + n/2 target tokens,
  the training loss.

Memory is what XLA's compiled program needs (``memory_analysis``: arguments
+ outputs + temporaries), which needs no run, so the largest n that fits in
``--memory_gib`` is found by compiling at doubling n (up to ``--max_fit_n``)
without allocating it. Runs whose program needs more than ``--run_gib`` are
compiled but not timed. Timings are the fastest of ``--reps`` runs after a
warm-up, the kinds interleaved round by round, so load from other jobs falls
on all alike; the slope a in ``time ~ n^a`` is fitted over the timed n >= 1024.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmark.common import log, machine
from xfmr_jax import config, losses, masks, model, multi_head_attention
from xfmr_jax.extras import require

KINDS = {
    'full': dict(),
    'local (w=256)': dict(attention_kind='local', attention_window=256),
    'linear elu': dict(attention_kind='linear'),
    'linear favor (m=128)': dict(attention_kind='linear',
                                 linear_feature_map='favor',
                                 favor_features=128),
}
MODEL = dict(vocab_size=1000, d_model=256, num_heads=4, num_encoder_layers=1,
             num_decoder_layers=2, d_ff=1024, dropout_rate=0.0,
             positional='rope', model_kind='decoder_only')
GIB = 2 ** 30


def layer_problem(changes: dict, n: int):
  """``(loss(params, x), params, x)`` for one causal attention layer."""
  cfg = config.ModelConfig(**{**MODEL, 'max_len': n, **changes})
  attn = multi_head_attention.MultiHeadAttention(cfg, cfg.attention_kind)
  x = jax.random.normal(jax.random.key(0), (1, n, cfg.d_model))
  mask = masks.SelfMask(jnp.ones((1, n), jnp.int32), causal=True)
  params = nn.unbox(jax.eval_shape(attn.init, jax.random.key(0), x, x,
                                   mask))['params']
  params = jax.tree.map(lambda s: jnp.full(s.shape, 0.02, s.dtype), params)

  def loss(p, x):
    return jnp.sum(jnp.square(attn.apply({'params': p}, x, x, mask)))
  return loss, params, x


def model_problem(changes: dict, n: int):
  """``(loss(params, batch), params, batch)`` for the small model."""
  cfg = config.ModelConfig(**{**MODEL, 'max_len': n, **changes})
  m = model.build(cfg)
  r = np.random.default_rng(0)
  batch = {k: jnp.asarray(r.integers(2, 1000, (1, n // 2)), jnp.int32)
           for k in ('inputs', 'targets')}
  params = nn.unbox(jax.jit(m.init)(jax.random.key(0), batch['inputs'][:, :8],
                                    batch['targets'][:, :8]))['params']

  def loss(p, b):
    hidden, table = m.apply({'params': p}, b['inputs'], b['targets'],
                            return_hidden=True)
    return losses.projected_token_metrics(
        hidden, table, b['targets'], jnp.ones(b['targets'].shape), 0.0)['loss']
  return loss, params, batch


def compiled(problem, changes, n):
  loss, params, data = problem(changes, n)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)) if problem is
                 layer_problem else jax.value_and_grad(loss))
  exe = step.lower(params, data).compile()
  m = exe.memory_analysis()
  needed = (m.argument_size_in_bytes + m.output_size_in_bytes -
            m.alias_size_in_bytes + m.temp_size_in_bytes)
  return exe, params, data, int(needed)


def slope(ns, times):
  """Least-squares a of ``log t = a log n + b``."""
  if len(ns) < 2:
    return None
  return float(np.polyfit(np.log(ns), np.log(times), 1)[0])


def measure(args) -> dict:
  results = {}
  for name, problem in (('layer', layer_problem), ('model', model_problem)):
    rows = {kind: dict(n=[], seconds=[], bytes=[]) for kind in KINDS}
    for n in args.ns:
      runners = {}
      for kind, changes in KINDS.items():
        exe, params, data, needed = compiled(problem, changes, n)
        rows[kind]['n'].append(n)
        rows[kind]['bytes'].append(needed)
        if needed <= args.run_gib * GIB:
          runners[kind] = (exe, params, data)
        else:
          rows[kind]['seconds'].append(None)
        log(f'{name} n={n} {kind}: {needed / GIB:.2f} GiB')
      best = {kind: math.inf for kind in runners}
      for kind, (exe, params, data) in runners.items():
        jax.block_until_ready(exe(params, data))  # warm-up
      for _ in range(args.reps):
        for kind, (exe, params, data) in runners.items():
          time.sleep(0.1)
          t0 = time.perf_counter()
          jax.block_until_ready(exe(params, data))
          best[kind] = min(best[kind], time.perf_counter() - t0)
      for kind in runners:
        rows[kind]['seconds'].append(best[kind])
        log(f'{name} n={n} {kind}: {best[kind]:.4f} s')
      del runners
    for kind, row in rows.items():
      timed = [(n, t) for n, t in zip(row['n'], row['seconds'])
               if t is not None and n >= 1024]
      row['slope'] = slope(*zip(*timed)) if len(timed) >= 2 else None
      row['faster_than_full_from_n'] = None if kind == 'full' else (
          crossover(row, rows['full']))
      row['largest_n_that_fits'] = largest_fit(problem, KINDS[kind], args)
      log(f'{name} {kind}: slope {row["slope"]}, fits up to '
          f'{row["largest_n_that_fits"]}')
    results[name] = rows
  return results


def crossover(row, full):
  """The smallest n from which ``row`` is faster than full attention at
  every larger n (full attention counts as slower where it was not timed)."""
  faster = [t is not None and (f is None or t < f)
            for t, f in zip(row['seconds'], full['seconds'])]
  for i, n in enumerate(row['n']):
    if all(faster[i:]):
      return n
  return None


def largest_fit(problem, changes, args) -> int | None:
  """The largest power-of-two n (<= max_fit_n) whose program fits in
  ``memory_gib``, by compiling only."""
  best, n = None, 256
  while n <= args.max_fit_n:
    try:
      needed = compiled(problem, changes, n)[3]
    except Exception as e:  # pylint: disable=broad-except
      log(f'n={n}: {type(e).__name__}: {e}'[:200])
      break
    if needed > args.memory_gib * GIB:
      break
    best, n = n, 2 * n
  return best


# ------------------------------------------------------------------ report --

def table(results) -> str:
  out = []
  for name, rows in results.items():
    ns = rows['full']['n']
    out.append(f'\n**{name}**: forward + backward seconds (XLA memory, '
               'MiB)\n')
    out.append('| kind | ' + ' | '.join(f'n={n}' for n in ns) +
               ' | slope a | faster than full from | largest n in '
               f'{ARGS.memory_gib} GiB |')
    out.append('|---|' + '---:|' * (len(ns) + 3))
    for kind, row in rows.items():
      cells = [('-' if t is None else f'{t:.3g}') + f' ({b / 2**20:.0f})'
               for t, b in zip(row['seconds'], row['bytes'])]
      fit = row['largest_n_that_fits']
      fit = ('-' if fit is None else
             f'>= {fit}' if fit >= ARGS.max_fit_n else str(fit))
      out.append(f'| {kind} | ' + ' | '.join(cells) + ' | ' +
                 ('-' if row['slope'] is None else f"{row['slope']:.2f}") +
                 ' | ' + str(row['faster_than_full_from_n'] or '-') + ' | ' +
                 fit + ' |')
  return '\n'.join(out)


def plot(results, path):
  matplotlib = require('matplotlib', 'the long-attention plot')
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
  for col, (name, rows) in enumerate(results.items()):
    for kind, row in rows.items():
      timed = [(n, t) for n, t in zip(row['n'], row['seconds'])
               if t is not None]
      if timed:
        axes[0, col].loglog(*zip(*timed), 'o-', label=kind)
      axes[1, col].loglog(row['n'], np.asarray(row['bytes']) / 2 ** 20,
                          'o-', label=kind)
    axes[0, col].set_title(f'{name}: forward + backward time')
    axes[0, col].set_ylabel('seconds')
    axes[1, col].set_title(f'{name}: XLA program memory')
    axes[1, col].set_ylabel('MiB')
    for ax in axes[:, col]:
      ax.set_xlabel('sequence length n')
      ax.set_xscale('log', base=2)
      ax.grid(True, which='both', alpha=0.3)
  axes[0, 0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def parse_args(argv):
  p = argparse.ArgumentParser(prog='python -m experiments.benchmark.'
                              'long_attention',
                              description=__doc__.split('\n\n')[0])
  p.add_argument('--ns', default='256,512,1024,2048,4096,8192,16384')
  p.add_argument('--reps', type=int, default=3)
  p.add_argument('--run_gib', type=float, default=6.0,
                 help='time only programs that need at most this much')
  p.add_argument('--memory_gib', type=float, default=24.0)
  p.add_argument('--max_fit_n', type=int, default=262144)
  p.add_argument('--out', default='long_attention',
                 help='writes OUT.json, OUT.png and OUT.table.md')
  args = p.parse_args(argv)
  args.ns = [int(n) for n in args.ns.split(',')]
  return args


ARGS = None


def main(argv=None):
  global ARGS
  argv = sys.argv[1:] if argv is None else argv
  ARGS = args = parse_args(argv)
  results = measure(args)
  report = dict(command='python -m experiments.benchmark.long_attention ' +
                ' '.join(argv), machine=machine(), cpu_count=os.cpu_count(),
                results=results)
  with open(args.out + '.json', 'w') as f:
    json.dump(report, f, indent=1)
  text = table(results)
  with open(args.out + '.table.md', 'w') as f:
    f.write(text + '\n')
  plot(results, args.out + '.png')
  print(text)
  return report


if __name__ == '__main__':
  main()
