"""Train the encoder-only model on the toy tagging task.

``python -m experiments.train_tagger`` trains a BERT-style encoder with a
token head (``ModelConfig(model_kind='encoder_only')``) to tag every source
word of `toy_translate` with its syntactic role (subject, verb, object,
prepositional phrase, relative clause, conjunction; see
:mod:`xfmr_jax.data.toy_tagging`), and reports token accuracy on the
validation split next to the majority-tag baseline. It uses the same train
and eval steps as translation: the tags are the ``targets``.
"""
from __future__ import annotations

import itertools
import logging
import time

from absl import app, flags
import numpy as np

from experiments import entry

log = logging.getLogger('xfmr_jax')


def train_tagger(*, dataset: str = 'toy_translate', data_dir: str | None = None,
                 steps: int = 300, batch_size: int = 32, max_length: int = 64,
                 vocab_size: int = 1000, eval_sentences: int = 500,
                 seed: int = 0, **model_changes) -> dict:
  """Train and evaluate; returns accuracy, baseline and timing.

  ``model_changes`` override the small encoder's :class:`ModelConfig` fields
  (d_model 64, 4 heads, 2 layers, d_ff 256, no dropout).
  """
  from xfmr_jax import config as config_lib, model, optim, train_state
  from xfmr_jax import train_steps
  from xfmr_jax.data import get_source, pipeline, toy_tagging
  from xfmr_jax.tokenizer import Tokenizer

  train_source = get_source(dataset, 'train', data_dir)
  eval_source = get_source(dataset, 'validation', data_dir)
  n = min(len(train_source), 20_000)
  texts = [s for s, _ in pipeline.read_pairs(train_source, list(range(n)))]
  tokenizer = Tokenizer.train(texts, None, vocab_size=vocab_size)
  cfg = config_lib.ModelConfig(**{
      **dict(vocab_size=tokenizer.vocab_size, d_model=64, num_heads=4,
             num_encoder_layers=2, num_decoder_layers=1, d_ff=256,
             dropout_rate=0.0, max_len=max_length, model_kind='encoder_only',
             num_labels=toy_tagging.NUM_CLASSES), **model_changes})
  net = model.build(cfg)
  tx = optim.make_optimizer(d_model=cfg.d_model, warmup_steps=min(100, steps),
                            lr_scale=1.0)
  import jax
  state = jax.jit(lambda: train_state.init_state(net, tx, seed))()
  train_step, eval_step = train_steps.jit_steps(net, tx, label_smoothing=0.0)
  batches = toy_tagging.make_tagging_batches(
      train_source, tokenizer, batch_size=batch_size, max_length=max_length,
      repeat=True, seed=seed)
  start = time.time()
  for step, batch in enumerate(itertools.islice(batches, steps)):
    state, metrics = train_step(state, batch)
    if (step + 1) % 50 == 0:
      log.info('step %d: loss %.4f', step + 1,
               float(metrics['loss']) / float(metrics['tokens']))
  train_s = time.time() - start
  indices = list(range(min(eval_sentences, len(eval_source))))
  eval_batches = list(toy_tagging.make_tagging_batches(
      eval_source, tokenizer, batch_size=batch_size, max_length=max_length,
      indices=indices))
  correct = total = 0.0
  for batch in eval_batches:
    m = eval_step(state.params, batch)
    correct += float(m['correct'])
    total += float(m['tokens'])
  return dict(accuracy=correct / total,
              majority_baseline=toy_tagging.majority_baseline(eval_batches),
              tokens=int(total), steps=steps, train_seconds=train_s,
              parameters=int(sum(np.size(p) for p in
                                 jax.tree.leaves(state.params))))


def _define_flags():
  """Command-line flags, defined only when run as a script (the library
  function above is imported by tests beside other scripts' flags)."""
  flags.DEFINE_string('dataset', 'toy_translate',
                      "'toy_translate' or 'toy_translate/small'.")
  flags.DEFINE_string('data_dir', '', "TFDS data_dir; '' = default.")
  flags.DEFINE_integer('steps', 300, 'Training steps.')
  flags.DEFINE_string('positional', 'sinusoidal', 'Positional scheme.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  log.setLevel(logging.INFO)
  log.addHandler(logging.StreamHandler())
  log.propagate = False
  f = flags.FLAGS
  if f.steps < 1:
    entry.fail(f'--steps must be at least 1, got {f.steps}')
  from xfmr_jax.config import POSITIONALS
  if f.positional not in POSITIONALS:
    entry.fail(f'--positional={f.positional!r} is not one of {POSITIONALS}')
  r = train_tagger(dataset=f.dataset, data_dir=f.data_dir or None,
                   steps=f.steps, positional=f.positional)
  print(f"tagging accuracy {r['accuracy']:.4f} on {r['tokens']} validation "
        f"tokens (majority tag {r['majority_baseline']:.4f}); "
        f"{r['parameters']:,} parameters, {r['steps']} steps in "
        f"{r['train_seconds']:.1f} s")


if __name__ == '__main__':
  _define_flags()
  entry.run(main)
