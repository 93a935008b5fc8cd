"""The default recipe (``experiments/configs/toy.py`` as it is) learns.

A short run on the small toy split, so a change that breaks the recipe (its
model, learning rate, schedule, batching) fails here in CI without timing
anything; the full run's results are in docs/toy_task.md.
"""
import json

from experiments.configs import toy
from xfmr_jax import training_loop

STEPS = 80
# Measured: the train loss (label-smoothed, per token) of steps 61-80 is
# 3.01 (seed 0) and 3.09 (seed 1), from 5.44 over steps 1-20; a recipe that
# does not learn stays above 5.
MAX_LOSS = 3.5


def test_short_run_of_the_default_recipe_learns(data_dir, tmp_path):
  c = toy.get_config()
  c.dataset = 'toy_translate/small'
  c.data_dir = str(data_dir)
  c.num_train_steps = STEPS
  c.log_every = 20
  c.eval_every = c.checkpoint_every = 10 * STEPS
  c.test_samples = c.bleu_samples = 32
  c.num_print_samples = 0
  training_loop.train_and_evaluate(c, str(tmp_path))
  rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  losses = [r['loss'] for r in rows if r['split'] == 'train']
  assert len(losses) == STEPS // 20
  assert losses[-1] < MAX_LOSS, losses
  assert losses[-1] < 0.6 * losses[0], losses
