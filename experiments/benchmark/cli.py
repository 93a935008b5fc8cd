"""The command line: which sizes and benchmarks to run, then the report.

``python -m experiments.benchmark`` runs ``main`` (see the package docstring
for what is measured); ``main(argv)`` returns the results it printed and,
with ``--json PATH``, wrote.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys

import jax

import experiments.benchmark as package
from experiments.benchmark import load as load_lib
from experiments.benchmark.common import (MIN_ROUND_S, SIZES, device_peak_bytes,
                                          machine)
from experiments.benchmark.decode import bench_decode
from experiments.benchmark.gpu_check import gpu_check
from experiments.benchmark.isolated import PROCESS_WINDOW_S, bench_train_isolated
from experiments.benchmark.report import format_tables, write_json
from experiments.benchmark.torch_reference import torch_available
from experiments.benchmark.train import MODEL_VARIANTS, VARIANTS, bench_train


def parse_args(argv):
  p = argparse.ArgumentParser(prog='python -m experiments.benchmark',
                              description=package.__doc__.split('\n\n')[0])
  p.add_argument('--sizes', default='toy,small,base',
                 help='comma-separated subset of ' + ','.join(SIZES))
  p.add_argument('--json', default=None, help='write the results here')
  p.add_argument('--rounds', type=int, default=5,
                 help='timed train rounds (after warm-up)')
  p.add_argument('--decode_reps', type=int, default=2)
  p.add_argument('--decode_len', type=int, default=64)
  p.add_argument('--decode_batch', type=int, default=None,
                 help='decode batch (default: per size, see SIZES)')
  p.add_argument('--decode_sizes', default=None,
                 help='sizes to decode (default: --sizes)')
  p.add_argument('--variants', default=None,
                 help='sizes that also run the no-dropout/scan/remat variants '
                 '(default: all of --sizes; "none" for none)')
  p.add_argument('--model_variants', default='',
                 help="sizes that also time the model variants "
                 '(' + ', '.join(MODEL_VARIANTS) + ')')
  p.add_argument('--peak_n', type=int, default=2048,
                 help='matrix size of the matmul peak')
  p.add_argument('--no_torch', action='store_true')
  p.add_argument('--no_flax_wmt', action='store_true',
                 help="skip the yardstick: flax examples/wmt's train step "
                 'and beam search')
  p.add_argument('--min_round_s', type=float, default=MIN_ROUND_S,
                 help='each contender runs at least this long per round')
  p.add_argument('--process_window_s', type=float, default=PROCESS_WINDOW_S,
                 help='each train-step process times at least this long '
                 '(its start and compile cost far more)')
  p.add_argument('--retries', type=int, default=load_lib.MAX_RETRIES,
                 help='times a round disturbed by other jobs is run again')
  p.add_argument('--in_process', action='store_true',
                 help='time the train steps side by side in this process '
                 '(faster, but contenders slow each other; by default each '
                 'runs in a fresh process of its own, one at a time: see '
                 'isolated.py)')
  p.add_argument('--gpu_check', action='store_true',
                 help='the one-shot accelerator check (falls back on CPU)')
  p.add_argument('--quick', action='store_true',
                 help='tiny sizes, few and short rounds, one retry, in this '
                 'process (for tests)')
  args = p.parse_args(argv)
  if args.quick:
    args.sizes, args.rounds, args.decode_reps = 'tiny', 2, 1
    args.variants = args.variants or 'none'
    args.decode_len, args.peak_n = min(args.decode_len, 8), 256
    args.min_round_s = min(args.min_round_s, 0.1)
    args.process_window_s = min(args.process_window_s, 0.1)
    args.retries = min(args.retries, 1)
    args.in_process = True
  sizes = [s for s in args.sizes.split(',') if s]
  bad = [s for s in sizes if s not in SIZES]
  if bad:
    p.error(f'unknown sizes {bad}; choose from {list(SIZES)}')
  args.sizes = sizes
  args.decode_sizes = (sizes if args.decode_sizes is None else
                       [s for s in args.decode_sizes.split(',') if s])
  args.variants = (sizes if args.variants is None else
                   [s for s in args.variants.split(',') if s not in ('', 'none')])
  args.model_variants = [s for s in args.model_variants.split(',') if s]
  return args


def main(argv=None) -> dict:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  res = dict(command='python -m experiments.benchmark ' +
             ' '.join(sys.argv[1:] if argv is None else argv),
             jax_version=jax.__version__, cpu_count=os.cpu_count(),
             memory_method=('device memory_stats peak_bytes_in_use'
                            if device_peak_bytes() is not None else
                            'xla_step_bytes: compiled memory_analysis '
                            '(arguments + outputs - donated + temporaries); '
                            'rss_delta_bytes: sampled process RSS growth '
                            'over build, compile and first two steps'),
             flops_method='analytic model FLOPs (3 x forward matmuls and '
             'attention); MFU vs float32 jnp.dot peak of the same rounds',
             timing_method=f'each contender timed for >= {args.min_round_s} '
             's per round (several calls, seconds per call), alternating; '
             'foreign_load = (machine busy CPU s from /proc/stat - CPU s of '
             'this process, its children and workers) / wall s; a round '
             f'with foreign load > {load_lib.DISTURBED_LOAD} core is run '
             f'again, up to {args.retries} times')
  res['machine'] = machine()
  if args.gpu_check:
    res.update(gpu_check(quick=args.quick))
  else:
    use_torch = not args.no_torch and torch_available()
    if not use_torch:
      res['torch_skipped'] = ('--no_torch' if args.no_torch else
                              'torch is not installed (pip install '
                              '".[bench]")')
    else:
      import torch  # pylint: disable=g-import-not-at-top
      res['torch_version'] = torch.__version__
      res['torch_threads'] = os.cpu_count()
      res['torch_omp_wait_policy'] = dict(
          torch=os.environ.get('OMP_WAIT_POLICY'),
          torch_active=package.USER_OMP_WAIT_POLICY)
    timing = dict(min_round_s=args.min_round_s, retries=args.retries)
    if not args.in_process:
      res['timing_method'] = (
          'train: each contender in a fresh process of its own, one at a '
          'time, the order rotating round by round; each process times >= '
          f'{args.process_window_s} s of steps after two warm-up steps; foreign '
          'load = (machine busy CPU s - that process\'s CPU s) / wall s, a '
          f'window above {load_lib.DISTURBED_LOAD} core is timed again in a '
          f'fresh process, up to {args.retries} times. Decoding: ' +
          res['timing_method'])
    def train(size):
      variants = {**(VARIANTS if size in args.variants else {}),
                  **(MODEL_VARIANTS if size in args.model_variants else {})}
      bench = bench_train if args.in_process else bench_train_isolated
      return bench(size, rounds=args.rounds, use_torch=use_torch,
                   peak_n=args.peak_n, flax_wmt=not args.no_flax_wmt,
                   variants=variants, timing=timing if args.in_process else
                   dict(timing, min_round_s=args.process_window_s))
    res['train'] = [train(s) for s in args.sizes]
    res['decode'] = [bench_decode(s, reps=args.decode_reps,
                                  use_torch=use_torch, length=args.decode_len,
                                  batch_size=args.decode_batch,
                                  flax_wmt=not args.no_flax_wmt, timing=timing)
                     for s in args.decode_sizes]
  res['max_rss_bytes'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(format_tables(res))
  if args.json:
    write_json(res, args.json)
  return res
