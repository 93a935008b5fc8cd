"""The toy translation task on a CPU in minutes (the default config).

The model is ``xfmr_jax.config.toy()``; the measured results of this recipe
(and of the alternatives tried by ``python -m experiments.sweep``) are in
docs/toy_task.md. Dropout is off: the task has 150k rule-generated pairs and
the run's 1500 batches of 32 rows see under half of them, none twice, so
there is nothing to overfit and dropout only slows learning.
"""
import dataclasses

from experiments.configs import default
from xfmr_jax import config as model_presets


def get_config():
  c = default.get_config()
  c.dataset = 'toy_translate'
  model = dataclasses.asdict(model_presets.toy())  # the one toy model
  c.vocab_size = model.pop('vocab_size')
  c.model.update({k: v for k, v in model.items() if k in c.model})
  c.max_length = 64
  # 32 rows a step: at the same tokens per second, twice the updates of 64
  # rows learn faster in a run this short (see the sweep in docs/toy_task.md).
  c.batch_size = 32
  c.num_train_steps = 1500
  c.warmup_steps = 200
  c.lr_scale = 0.5
  # Evaluate and translate with a moving average of the parameters: in a run
  # this short the last update's parameters still carry the noise of its
  # learning rate (see docs/toy_task.md for what it gains).
  c.ema_decay = 0.99
  c.log_every = 25
  c.eval_every = 750
  c.checkpoint_every = 500
  return c
