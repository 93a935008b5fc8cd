"""Train steps timed one contender at a time, each in a fresh process.

``python -m experiments.benchmark`` measures the train step this way (``--in_process``:
:func:`experiments.benchmark.train.bench_train`'s single process instead).
In a single process every contender's compiled step, thread pools and
allocations live side by side, and they slow each other: our base step took
3,535 ms there with PyTorch built beside it and 1,845 ms alone, while the
foreign-load measure, which sees only other jobs, saw nothing. Here each
round starts one process per contender, one after the other, and only one is
alive at a time: it builds its step, runs two steps, then times at least
``PROCESS_WINDOW_S`` of steps (after ``common.SETTLE_S`` idle, measuring the
foreign load of the window) and reports back as one JSON line. The order
rotates from round to round, a window disturbed by other jobs is timed again
in a fresh process (up to ``retries`` times, then the least disturbed is
kept), and ratios are taken round by round.

Contenders: ``matmul`` (the ``jnp.dot`` peak MFU is taken against), ``main``
(our step with glibc's malloc defaults), ``main_trainer_malloc`` (the same
under the trainer's ``host_memory.reuse_freed_memory``, as ``python -m
experiments.train_wmt`` runs it), the variants (``train.VARIANTS``,
``train.MODEL_VARIANTS``: ModelConfig changes), ``flax_wmt`` (the flax
example's step), ``torch`` (PyTorch at the paper's dropout sites, passive
OpenMP waiting), ``torch_default`` (nn.Transformer's own dropout sites) and
``torch_active`` (the paper's sites under the user's OpenMP policy, by
default none).

This module imports no jax at the top: a child applies the malloc settings
and the OpenMP policy before anything loads jax or torch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import experiments.benchmark as package

CONTENDERS = ('matmul', 'main', 'main_trainer_malloc', 'flax_wmt', 'torch',
              'torch_default', 'torch_active')
TORCH_CONTENDERS = ('torch', 'torch_default', 'torch_active')
JAX_CONTENDERS = ('main', 'main_trainer_malloc')
# Each process times at least this many seconds of steps (``min_round_s``
# of ``timing``): its start, compile and warm-up cost far more, and a longer
# window averages out a scheduling hiccup.
PROCESS_WINDOW_S = 2.0
# How long one child may take (import, compile, warm-up, timed window).
CHILD_TIMEOUT_S = 900
_RESULT = 'isolated-result: '


def _build(spec: dict):
  """The contender's runner (in the child): call it for one step."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from experiments.benchmark import common, train  # pylint: disable=g-import-not-at-top
  from xfmr_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  name = spec['name']
  if name == 'matmul':
    return common.MatmulPeak(spec['peak_n'], jnp.float32)
  size = common.SIZES[spec['size']]
  cfg = config_lib.ModelConfig(**size['model'], dropout_rate=common.DROPOUT,
                               attention_impl='reference')
  batch = common.random_batch(cfg.vocab_size, size['batch'], size['length'])
  if name == 'flax_wmt':
    return train.FlaxWmtTrain(cfg, batch)
  if name in TORCH_CONTENDERS:
    from experiments.benchmark import torch_reference  # pylint: disable=g-import-not-at-top
    return torch_reference.TorchTrain(
        cfg, batch, sites='torch' if name == 'torch_default' else 'paper')
  # main, main_trainer_malloc or a variant: our step, with its changes.
  return train.JaxTrain(cfg.replace(**spec.get('changes', {})), batch)


def child(spec: dict) -> dict:
  """One contender's process: build, warm up, time one window."""
  from experiments.benchmark import common, load  # pylint: disable=g-import-not-at-top
  t_start = time.time()
  run = _build(spec)
  time.sleep(common.SETTLE_S)
  stop = load.window()
  calls, elapsed = common.timed(run, spec['calls'], spec['min_round_s'])
  out = dict(name=spec['name'], pid=os.getpid(), seconds=elapsed / calls,
             calls=calls, foreign_load=stop(), started=t_start,
             ended=time.time(),
             omp_wait_policy=os.environ.get('OMP_WAIT_POLICY'),
             first_step_s=getattr(run, 'first_step_s', None),
             compile_s=getattr(run, 'compile_s', None))
  if hasattr(run, 'memory'):
    out['memory'] = run.memory()
  elif hasattr(run, 'rss_delta'):
    out['memory'] = dict(rss_delta_bytes=run.rss_delta)
  if hasattr(run, 'flops'):
    out['flops'] = run.flops
  return out


def _child_main(spec: dict) -> None:
  # Before anything imports jax or torch: both read these settings once.
  if spec['name'] == 'main_trainer_malloc':
    from xfmr_jax import host_memory  # pylint: disable=g-import-not-at-top
    spec['malloc_applied'] = host_memory.reuse_freed_memory()
  from experiments.benchmark import torch_worker  # pylint: disable=g-import-not-at-top
  torch_worker.apply_wait_policy(spec['omp_wait_policy'])
  out = child(spec)
  out['malloc_applied'] = spec.get('malloc_applied')
  print(_RESULT + json.dumps(out), flush=True)


def run_child(name: str, size: str, *, calls: int | None, min_round_s: float,
              peak_n: int, changes: dict | None = None) -> dict:
  """Start one contender's process, wait for it, return its result
  (``changes``: a variant's ModelConfig changes)."""
  # The parent's package set PASSIVE in the environment the child inherits;
  # torch_active gets the policy the user had (None: unset).
  policy = (package.USER_OMP_WAIT_POLICY if name == 'torch_active'
            else 'PASSIVE')
  spec = dict(name=name, size=size, calls=calls, min_round_s=min_round_s,
              peak_n=peak_n, omp_wait_policy=policy, changes=changes or {})
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.benchmark.isolated',
       json.dumps(spec)], capture_output=True, text=True,
      timeout=CHILD_TIMEOUT_S, check=False, env=package.cold_env())
  lines = [l for l in proc.stdout.splitlines() if l.startswith(_RESULT)]
  if proc.returncode or not lines:
    raise RuntimeError(f'benchmark process for {name} ({size}) failed with '
                       f'exit code {proc.returncode}:\n{proc.stderr[-2000:]}')
  return json.loads(lines[-1][len(_RESULT):])


def _summary(results, matmul, flops, tokens) -> dict:
  """One contender's row from its rounds' results."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from experiments.benchmark import load  # pylint: disable=g-import-not-at-top
  ts = np.array([r['seconds'] for r in results])
  row = dict(step_s=float(np.median(ts)), step_s_all=ts.tolist(),
             tokens_per_s=float(tokens / np.median(ts)),
             first_step_s=results[0]['first_step_s'],
             foreign_load=load.summary([r['foreign_load'] for r in results]),
             calls_per_round=results[0]['calls'],
             pids=[r['pid'] for r in results],
             memory=results[0].get('memory', {}),
             omp_wait_policy=results[0]['omp_wait_policy'],
             malloc_applied=results[0]['malloc_applied'])
  if matmul:  # MFU per round against the peak of the same round
    peak = np.array([m['flops'] / m['seconds'] for m in matmul])
    row['mfu'] = float(np.median(flops / ts / peak))
  if results[0]['compile_s'] is not None:
    row['compile_s'] = float(np.median([r['compile_s'] for r in results]))
  return row


def _least_disturbed(start, retries: int, threshold: float):
  """``start()`` (one child's result) until its window's foreign load is at
  most ``threshold``, at most ``retries`` more times; the least disturbed
  result and how many times it was run again."""
  best = None
  for attempt in range(retries + 1):
    res = start()
    load = res['foreign_load']
    if best is None or (load is not None and best['foreign_load'] is not None
                        and load < best['foreign_load']):
      best = res
    if load is None or load <= threshold:
      return best, attempt
  return best, retries


def bench_train_isolated(size: str, *, rounds: int, use_torch: bool,
                         peak_n: int, variants=None, flax_wmt: bool = True,
                         timing: dict | None = None, contenders=None,
                         run=run_child) -> dict:
  """One size's train step, each contender in a process of its own per
  round, one at a time; the same result layout as ``train.bench_train``
  (plus ``isolated``, each row's ``pids`` and ``malloc_applied``).

  ``variants``: name -> ModelConfig changes, or a function of the config
  returning them (``train.VARIANTS``, ``train.MODEL_VARIANTS``), timed as
  contenders of their own. ``contenders``: a subset of CONTENDERS (default:
  all that ``use_torch`` and ``flax_wmt`` allow; ``matmul`` is always
  timed). ``timing``: ``min_round_s``, ``retries``, ``threshold``. ``run``:
  starts one child (:func:`run_child`)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from experiments.benchmark import common, load  # pylint: disable=g-import-not-at-top
  from xfmr_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  timing = dict(timing or {})
  min_round_s = timing.get('min_round_s', PROCESS_WINDOW_S)
  retries = timing.get('retries', load.MAX_RETRIES)
  threshold = timing.get('threshold', load.DISTURBED_LOAD)
  spec = common.SIZES[size]
  cfg = config_lib.ModelConfig(**spec['model'], dropout_rate=common.DROPOUT,
                               attention_impl='reference')
  changes = {name: {} for name in JAX_CONTENDERS}
  changes.update({k: v(cfg) if callable(v) else dict(v)
                  for k, v in (variants or {}).items()})
  chosen = [c for c in (contenders or CONTENDERS) if c != 'matmul' and
            (use_torch or c not in TORCH_CONTENDERS) and
            (flax_wmt or c != 'flax_wmt')]
  # Ours first, then the variants, then the yardsticks.
  names = (['matmul'] + [c for c in chosen if c in JAX_CONTENDERS] +
           list(variants or {}) + [c for c in chosen if c not in JAX_CONTENDERS])
  results = {n: [] for n in names}
  calls, unavailable, retried = {}, {}, 0
  for r in range(rounds):
    k = r % len(names)  # rotate the order: no contender always goes first
    for name in [n for n in names[k:] + names[:k] if n not in unavailable]:
      common.log(f'[{size}] round {r + 1}/{rounds}: {name}, in a process of '
                 'its own ...')
      start = lambda name=name: run(
          name, size, calls=calls.get(name), min_round_s=min_round_s,
          peak_n=peak_n, changes=changes.get(name))
      try:
        best, again = _least_disturbed(start, retries, threshold)
      except (RuntimeError, subprocess.TimeoutExpired) as e:
        if name in ('main', 'matmul'):
          raise
        unavailable[name] = f'{type(e).__name__}: {str(e)[-200:]}'
        del results[name]  # its rounds so far have no partner
        common.log(f'[{size}] {name} unavailable: {unavailable[name]}')
        continue
      calls.setdefault(name, best['calls'])
      retried += again
      results[name].append(best)
  times = common.Timings({n: [x['seconds'] for x in rs]
                          for n, rs in results.items()})
  times.load = {n: [x['foreign_load'] for x in rs] for n, rs in results.items()}
  times.threshold, times.retried = threshold, retried
  times.disturbed_kept = sum(x is not None and x > threshold
                             for ls in times.load.values() for x in ls)
  batch, length = spec['batch'], spec['length']
  flops = common.train_flops(cfg, batch, length, length)
  tokens = batch * length * 2   # source + target tokens per step
  matmul = results.pop('matmul')
  out = dict(size=size, batch=batch, length=length, tokens_per_step=tokens,
             model=dataclasses.asdict(cfg), model_flops_per_step=flops,
             matmul_n=peak_n, rounds=rounds, isolated=True,
             matmul_peak_flops=float(np.median(
                 [m['flops'] / m['seconds'] for m in matmul])),
             runs={}, unavailable=unavailable, load=times.rounds_info())
  for name, rs in results.items():
    out['runs'][name] = _summary(rs, matmul, flops, tokens)
    if name in changes:
      out['runs'][name]['model_changes'] = changes[name]
  del times['matmul']
  out.update(common.ratios_vs(times))
  return out


if __name__ == '__main__':
  _child_main(json.loads(sys.argv[1]))
