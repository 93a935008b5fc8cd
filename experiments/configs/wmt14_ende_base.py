"""WMT14 English-German, the paper's base model (Table 3, row "base").

The paper trains 100k steps on batches of about 25k source + 25k target tokens
(8 GPUs); 3072 rows of 256 tokens is that budget here, e.g. on 8 devices with
gradient accumulation if memory is short.
"""
from experiments.configs import default


def get_config():
  c = default.get_config()
  c.dataset = 'wmt14_translate/en-de'
  c.vocab_size = 37_000        # shared source-target BPE vocabulary
  c.max_length = 256
  c.eval_max_length = 256
  c.batch_size = 96
  c.num_train_steps = 100_000
  c.warmup_steps = 4000
  c.eval_every = 5000
  c.checkpoint_every = 2000
  c.bleu_samples = 1024
  c.beam_size = 4
  c.beam_alpha = 0.6
  c.model.update(scan_layers=True)
  return c
