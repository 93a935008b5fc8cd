"""The toy translation task on a CPU in minutes (the default config).

Sized so that ``python -m experiments.train_wmt`` passes 95% exact match on
the toy test split (95.5% measured; 93.95% with seed 1, see the README) within
10 minutes on a 2-core CPU. Dropout is off: the task has 150k rule-generated
pairs and the run's 900 batches of 64 see under half of them, none twice, so
there is nothing to overfit and dropout only slows learning.
"""
from experiments.configs import default


def get_config():
  c = default.get_config()
  c.dataset = 'toy_translate'
  c.vocab_size = 1000
  c.max_length = 64
  c.model.update(d_model=192, num_heads=4, num_encoder_layers=2,
                 num_decoder_layers=2, d_ff=768, max_len=256, dropout_rate=0.0)
  c.batch_size = 64
  c.num_train_steps = 900
  c.warmup_steps = 200
  c.lr_scale = 0.5
  c.log_every = 25
  c.eval_every = 450
  c.checkpoint_every = 300
  return c
