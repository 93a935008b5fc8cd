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


def for_imported(fields: dict, vocab_size: int, generation: dict):
  """The config an imported model's workdir records (``config.json``): this
  recipe with the imported model fields, vocabulary and decoding defaults
  (``generation``: ``beam_size``, ``beam_alpha``)."""
  config = get_config()
  config.model.update(fields)
  config.vocab_size = vocab_size
  config.beam_size = generation['beam_size']
  config.beam_alpha = generation['beam_alpha']
  config.max_length = min(config.max_length, fields['max_len'])
  config.eval_max_length = min(config.eval_max_length, fields['max_len'])
  return config
