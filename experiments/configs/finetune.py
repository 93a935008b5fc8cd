"""Fine-tuning an imported (or any trained) model on your own sentence pairs.

    python -m experiments.train_wmt --config=experiments/configs/finetune.py \
        --config.init_from=IMPORTED --config.dataset='tsv:/data/{split}.tsv' \
        --workdir=FINETUNED

The model, its vocabulary and tokenizer come from ``init_from`` (see
``xfmr_jax.finetune.apply_init_from``); only dropout, dtype, remat and the
attention implementation can be set here. The learning rate warms up to a
small peak and decays linearly, as is usual when adapting a pretrained
translator: the paper's schedule (peak ~7e-4 at base size) would wash out
what the model knows.
"""
from experiments.configs import default


def get_config():
  c = default.get_config()
  c.dataset = 'tsv:/path/to/{split}.tsv'  # one "source<TAB>target" per line
  c.init_from = ''
  c.lr_schedule = 'linear'
  c.learning_rate = 5e-5
  c.warmup_steps = 200
  c.num_train_steps = 5000
  c.batch_size = 32
  c.max_length = 128
  c.eval_max_length = 256
  c.label_smoothing = 0.1
  c.grad_clip_norm = 1.0
  c.model.dropout_rate = 0.1
  c.eval_every = 1000
  c.checkpoint_every = 1000
  c.beam_size = 4
  c.beam_rules = 'hf'
  c.beam_alpha = 1.0
  c.bleu_samples = 256
  return c
