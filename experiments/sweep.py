r"""Short trials of toy-task recipes, measured side by side.

    python -m experiments.sweep --trials=base,lr07,ls0 --steps=600 \
        --workdir=workdir/sweep --out=docs/toy_sweep.md

Each trial is one ``python -m experiments.train_wmt`` run in its own process
(the default toy config plus the trial's overrides), evaluated on
``--eval_sentences`` validation sentences every ``--eval_every`` steps. The
table has, per trial: the overrides, train tokens/s and steps/s, validation
exact match at each evaluation, test exact match and BLEU at the end, and
the wall time (dataset build, compilation and evaluation included). A trial that has finished
(its ``final_metrics.json`` exists) is read back, not run again, so an
interrupted sweep resumes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

# name -> config overrides (flag form, as on the train_wmt command line).
# The short trials of docs/toy_task.md vary the recipe of 64-row batches
# without the parameter average; the full-length ones compare averages.
NO_AVG = {'ema_decay': 0.0}
B64 = {'batch_size': 64, **NO_AVG}
TRIALS = {
    'base': B64,
    'lr035': {**B64, 'lr_scale': 0.35},
    'lr07': {**B64, 'lr_scale': 0.7},
    'ls0': {**B64, 'label_smoothing': 0.0},
    'ls02': {**B64, 'label_smoothing': 0.2},
    'ls0_lr1': {**B64, 'label_smoothing': 0.0, 'lr_scale': 1.0},
    'vocab600': {**B64, 'vocab_size': 600},
    'vocab2k': {**B64, 'vocab_size': 2000},
    'd128': {**B64, 'model.d_model': 128, 'model.d_ff': 512},
    'dec3': {**B64, 'model.num_decoder_layers': 3},
    'h8': {**B64, 'model.num_heads': 8},
    # The same number of rows (tokens) as 400 steps of 64 rows:
    'b128': {'batch_size': 128, 'num_train_steps': 200, 'eval_every': 100,
             **NO_AVG},
    'b32': {'batch_size': 32, 'num_train_steps': 800, 'eval_every': 400,
            **NO_AVG},
    'b16': {'batch_size': 16, 'num_train_steps': 1600, 'eval_every': 800,
            **NO_AVG},
    # The default recipe (toy.py as it is) and its parameter average.
    'default': {},
    'noema': NO_AVG,
    'ema098': {'ema_decay': 0.98},
    'ema0995': {'ema_decay': 0.995},
}


def command(name: str, workdir: str) -> list[str]:
  """The train_wmt command line of one trial."""
  f = flags.FLAGS
  overrides = {'num_train_steps': f.steps, 'eval_every': f.eval_every,
               'bleu_samples': f.eval_sentences,
               'test_samples': f.eval_sentences,
               'checkpoint_every': f.steps, 'num_print_samples': 0,
               'seed': f.seed, **TRIALS[name]}
  return [sys.executable, '-m', 'experiments.train_wmt', f'--workdir={workdir}',
          *(f'--config.{k}={v}' for k, v in overrides.items())]


def run_trial(name: str) -> dict:
  f = flags.FLAGS
  workdir = os.path.join(f.workdir, f'{name}_seed{f.seed}')
  final_path = os.path.join(workdir, 'final_metrics.json')
  wall = None
  if not os.path.exists(final_path):
    start = time.time()
    proc = subprocess.run(command(name, workdir), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False)
    wall = time.time() - start
    if proc.returncode:
      tail = '\n'.join(proc.stderr.strip().splitlines()[-5:])
      return dict(name=name, error=f'exit {proc.returncode}: {tail}')
  final = json.load(open(final_path))
  rows = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  evals = {r['step']: r['exact_match'] for r in rows if r['split'] == 'eval'}
  speeds = [r['tokens_per_sec'] for r in rows if r['split'] == 'train']
  tps = sorted(speeds)[len(speeds) // 2] if speeds else 0.0
  return dict(name=name, overrides=TRIALS[name], tokens_per_sec=tps,
              train_tokens_per_sec=final['train_tokens_per_sec'] or 0.0,
              train_steps_per_sec=final.get('train_steps_per_sec') or 0.0,
              val_exact_match=evals, steps=final['step'],
              test_exact_match=final['exact_match'], test_bleu=final['bleu'],
              wall_seconds=wall or final['wall_seconds'],
              parameters=final.get('parameters'))


def table(results: list[dict]) -> str:
  """Markdown: one row per trial; validation exact match (%) at each
  evaluation step, then test exact match and BLEU at the last step."""
  evals = sorted({s for r in results for s in r.get('val_exact_match', {})})
  head = ('| trial | overrides | params | train tok/s | steps/s | '
          + ''.join(f'val EM@{s} | ' for s in evals)
          + 'steps | test EM | test BLEU | wall |')
  lines = [head, '|' + '---|' * (9 + len(evals))]
  for r in results:
    if 'error' in r:
      lines.append(f"| {r['name']} | error: {r['error'][:80]} |")
      continue
    val = ''.join(f"{100 * r['val_exact_match'][s]:.1f} | "
                  if s in r['val_exact_match'] else ' | ' for s in evals)
    over = ', '.join(f'{k}={v}' for k, v in r['overrides'].items()) or '(toy.py)'
    lines.append(
        f"| {r['name']} | {over} | {(r['parameters'] or 0) / 1e6:.2f}M | "
        f"{r['train_tokens_per_sec']:,.0f} | "
        f"{r['train_steps_per_sec'] or float('nan'):.2f} | "
        f"{val}{r['steps']} | "
        f"{100 * r['test_exact_match']:.1f} | {r['test_bleu']:.2f} | "
        f"{r['wall_seconds'] / 60:.1f} min |")
  return '\n'.join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  f = flags.FLAGS
  unknown = [t for t in f.trials if t not in TRIALS]
  if unknown:
    sys.exit(f'error: unknown trials {unknown}; choose from {sorted(TRIALS)}')
  results = []
  for name in f.trials:
    results.append(run_trial(name))
    print(table(results[-1:]).splitlines()[-1], flush=True)
  text = table(results)
  print(text)
  if f.out:
    with open(f.out, 'w') as out:
      out.write(text + '\n')
  with open(os.path.join(f.workdir, 'sweep.json'), 'w') as out:
    json.dump(results, out, indent=2)


def _define_flags():
  """Command-line flags, defined only when run as a script (tests import
  the trials and the table beside other scripts' flags)."""
  flags.DEFINE_list('trials', ['base'], f'Trials to run: {sorted(TRIALS)}.')
  flags.DEFINE_integer('steps', 600, 'Training steps of every trial.')
  flags.DEFINE_integer('eval_every', 150, 'Steps between evaluations.')
  flags.DEFINE_integer('eval_sentences', 500,
                       'Validation sentences decoded per eval.')
  flags.DEFINE_integer('seed', 0, 'Random seed of every trial.')
  flags.DEFINE_string('workdir', 'workdir/sweep', 'One folder per trial.')
  flags.DEFINE_string('out', '', 'Write the Markdown table here too.')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
