"""Do positional schemes generalise to sentences longer than any in training?

``python -m experiments.length_generalization`` trains the toy translation
task once per positional scheme (sinusoidal, learned, RoPE, ALiBi) with the
same config, step budget, tokenizer and seeds, then reports exact match and
BLEU on ``test`` (lengths seen in training, 3-30 words) and on ``long`` (31-60
words, longer than every training sentence), and exact match by source length.

The paper (section 3.5) chose sinusoids hoping they "extrapolate to sequence
lengths longer than the ones encountered during training"; RoPE and ALiBi were
later proposed with the same aim. ``--attention`` adds the self-attention
kinds for long inputs beside full attention (``local``: a sliding window of
``--window`` tokens; ``linear``: elu + 1 linear attention), each with every
scheme. Runs are resumable: a run whose workdir holds ``final_metrics.json``
is not trained again.

  python -m experiments.length_generalization --workdir=workdir/lengths \\
      --json=docs/length_generalization.json --plot=docs/length_generalization.png
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

from absl import app, flags
import numpy as np

from xfmr_jax.extras import require

_SCHEMES = flags.DEFINE_list(
    'schemes', ['sinusoidal', 'learned', 'rope', 'alibi'], 'Positional schemes.')
_ATTENTION = flags.DEFINE_list(
    'attention', ['full'], "Self-attention kinds: 'full', 'local', 'linear'.")
_WINDOW = flags.DEFINE_integer('window', 8, "Tokens on each side a query sees "
                               "with --attention=local.")
_SEEDS = flags.DEFINE_list('seeds', ['0'], 'Training seeds (one run each).')
_STEPS = flags.DEFINE_integer('steps', 800, 'Training steps per run (the toy '
                              "config's budget).")
_WORKDIR = flags.DEFINE_string('workdir', 'workdir/length_generalization',
                               'One sub-directory per run.')
_JSON = flags.DEFINE_string('json', '', 'Write the results here.')
_PLOT = flags.DEFINE_string('plot', '', 'Write the exact-match-by-length '
                            'plot here (PNG).')
_DATASET = flags.DEFINE_string('dataset', 'toy_translate',
                               "'toy_translate' or 'toy_translate/small'.")
_DATA_DIR = flags.DEFINE_string('data_dir', '', "TFDS data_dir; '' = default.")
_EVAL_LIMIT = flags.DEFINE_integer('eval_limit', 0, 'Sentences scored per '
                                   'split (0 = all).')
_BIN = 5  # source words per length bin in the plot

log = logging.getLogger('xfmr_jax')


def label(scheme: str, attention: str = 'full') -> str:
  """The run's name in tables and workdirs: the scheme, plus its attention
  kind when that is not full attention."""
  if attention == 'local':
    return f'{scheme}, local w={_WINDOW.value}'
  return scheme if attention == 'full' else f'{scheme}, {attention}'


def scheme_config(scheme: str, seed: int, steps: int, tokenizer_path: str,
                  attention: str = 'full'):
  from experiments.configs import toy
  c = toy.get_config()
  c.dataset = _DATASET.value
  c.data_dir = _DATA_DIR.value
  c.model.positional = scheme
  c.model.attention_kind = attention
  if attention == 'local':
    c.model.attention_window = _WINDOW.value
  c.seed = seed
  c.num_train_steps = steps
  c.eval_every = steps
  c.checkpoint_every = steps
  c.keep_checkpoints = 1
  c.tokenizer_path = tokenizer_path
  c.test_samples = 64  # the trainer's own test report; run_one scores all
  return c


def by_length(samples) -> dict:
  """Exact match per bin of ``_BIN`` source words: ``{bin_start: [hits, n]}``."""
  bins = {}
  for s in samples:
    start = (len(s['source'].split()) - 1) // _BIN * _BIN + 1
    hit, n = bins.get(start, (0, 0))
    bins[start] = (hit + (s['output'] == s['reference']), n + 1)
  return {k: bins[k] for k in sorted(bins)}


def run_one(scheme: str, seed: int, steps: int, tokenizer_path: str,
            attention: str = 'full') -> dict:
  """Train (unless done) and evaluate one scheme; returns its results."""
  from xfmr_jax import evaluation, run_config, training_loop
  from xfmr_jax.workdir import Workdir
  name = label(scheme, attention).replace(', ', '_').replace('=', '')
  workdir = Workdir(os.path.join(_WORKDIR.value, f'{name}_seed{seed}'))
  result_path = os.path.join(workdir.path, 'length_results.json')
  if os.path.exists(result_path):
    with open(result_path) as f:
      return json.load(f)
  config = scheme_config(scheme, seed, steps, tokenizer_path, attention)
  start = time.time()
  if not workdir.finished():
    metrics = training_loop.train_and_evaluate(config, workdir.path)
    if 'stopped_by' in metrics:  # SIGTERM/SIGINT: checkpointed, not finished
      sys.exit(f'{scheme} seed {seed}: training stopped by '
               f"{metrics['stopped_by']}; run again to resume it")
  train_s = time.time() - start
  trained = workdir.load()
  config = trained.config
  translator = evaluation.translator(config, trained.model, trained.params,
                                     trained.tokenizer)
  result = dict(scheme=label(scheme, attention), seed=seed, steps=steps,
                train_seconds=round(train_s, 1))
  for split in ('test', 'long'):
    source = run_config.data_source(config, split)
    m = evaluation.evaluate_translation(translator, source, _EVAL_LIMIT.value)
    result[split] = dict(bleu=m['bleu'], exact_match=m['exact_match'],
                         by_length=by_length(m['samples']))
    print(f"{result['scheme']} seed {seed} {split}: BLEU {m['bleu']:.2f}, exact match "
          f"{m['exact_match']:.4f}", flush=True)
  with open(result_path, 'w') as f:
    json.dump(result, f, indent=1)
  return result


def table(results) -> str:
  """Markdown table per scheme: the mean over seeds (and min-max if several)."""
  rows = ['| positions | test EM | test BLEU | long EM | long BLEU | seeds |',
          '|---|---:|---:|---:|---:|---:|']
  for scheme in dict.fromkeys(r['scheme'] for r in results):
    rs = [r for r in results if r['scheme'] == scheme]

    def cell(split, key, scale, unit):
      v = [scale * r[split][key] for r in rs]
      text = f'{np.mean(v):.1f}{unit}'
      return text + (f' ({min(v):.1f}-{max(v):.1f})' if len(v) > 1 else '')
    rows.append(f"| {scheme} | {cell('test', 'exact_match', 100, '%')} | "
                f"{cell('test', 'bleu', 1, '')} | "
                f"{cell('long', 'exact_match', 100, '%')} | "
                f"{cell('long', 'bleu', 1, '')} | {len(rs)} |")
  return '\n'.join(rows)


def plot(results, path: str) -> None:
  """Exact match by source-length bin: the mean over seeds, and their range."""
  matplotlib = require('matplotlib', 'the length-generalization plot')
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  seeds = sorted({r['seed'] for r in results})
  for scheme in dict.fromkeys(r['scheme'] for r in results):
    per_seed = []  # one {bin: exact match} per run
    for r in (r for r in results if r['scheme'] == scheme):
      bins = {}
      for split in ('test', 'long'):
        for start, (hit, n) in r[split]['by_length'].items():
          h0, n0 = bins.get(int(start), (0, 0))
          bins[int(start)] = (h0 + hit, n0 + n)
      per_seed.append({k: 100 * h / n for k, (h, n) in bins.items()})
    xs = sorted(set.intersection(*(set(b) for b in per_seed)))
    ys = np.array([[b[x] for x in xs] for b in per_seed])
    centres = [x + (_BIN - 1) / 2 for x in xs]
    line, = ax.plot(centres, ys.mean(0), marker='o', label=scheme)
    if len(per_seed) > 1:
      ax.fill_between(centres, ys.min(0), ys.max(0), alpha=0.15,
                      color=line.get_color())
  ax.axvline(30.5, color='gray', linestyle='--', linewidth=1)
  ax.text(31.5, 88, 'longer than any\ntraining sentence', fontsize=8,
          color='gray')
  ax.set_xlabel('source length (words)')
  ax.set_ylabel('exact match (%)')
  ax.set_ylim(-2, 102)
  what = (f'mean of seeds {", ".join(map(str, seeds))}, range shaded'
          if len(seeds) > 1 else f'seed {seeds[0]}')
  ax.set_title(f'Toy translation: exact match by source length ({what})',
               fontsize=10)
  ax.legend(loc='lower left')
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.getLogger().setLevel(logging.WARNING)
  log.setLevel(logging.INFO)
  log.addHandler(logging.StreamHandler())
  log.propagate = False
  from xfmr_jax import run_config
  from xfmr_jax.run_tokenizer import get_tokenizer
  from xfmr_jax.tokenizer import MODEL_FILENAME
  from xfmr_jax.config import POSITIONALS
  from xfmr_jax.config import ATTENTION_KINDS
  for scheme in _SCHEMES.value:
    if scheme not in POSITIONALS:
      sys.exit(f'error: unknown scheme {scheme!r}; choose from {POSITIONALS}')
  for kind in _ATTENTION.value:
    if kind not in ATTENTION_KINDS:
      sys.exit(f'error: unknown attention {kind!r}; choose from '
               f'{ATTENTION_KINDS}')
  # One tokenizer for every run, so the schemes differ in positions only.
  os.makedirs(_WORKDIR.value, exist_ok=True)
  config = scheme_config(_SCHEMES.value[0], 0, _STEPS.value, '')
  get_tokenizer(config, _WORKDIR.value,
                run_config.data_source(config, config.train_split))
  tokenizer_path = os.path.join(os.path.abspath(_WORKDIR.value),
                                MODEL_FILENAME)
  results = [run_one(scheme, int(seed), _STEPS.value, tokenizer_path, kind)
             for seed in _SEEDS.value for kind in _ATTENTION.value
             for scheme in _SCHEMES.value]
  print(table(results))
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(results, f, indent=1)
  if _PLOT.value:
    plot(results, _PLOT.value)


if __name__ == '__main__':
  app.run(main)
