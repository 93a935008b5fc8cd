"""Fields shared by every training config; each config overrides some of them.

Every field is documented here; ``--config.<field>=<value>`` overrides one on
the command line (an unknown field is an error).
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Data. dataset: 'toy_translate', 'wmt14_translate/de-en',
  # 'wmt17_translate/de-en' (a '/en-de' suffix or reverse=True flips the
  # direction), 'tsv:/path/{split}.tsv' or 'files:/p/{split}.src,/p/{split}.tgt'.
  c.dataset = 'toy_translate'
  c.data_dir = ''              # TFDS data_dir; '' = TFDS's default
  c.reverse = False            # translate target -> source
  c.train_split = 'train'
  c.eval_split = 'validation'
  c.test_split = 'test'
  c.max_length = 64            # tokens per packed training row (EOS included)
  c.eval_max_length = 128      # tokens per evaluation row
  c.length_policy = 'filter'   # or 'truncate' pairs longer than max_length
  c.pack = True
  c.data_workers = 0           # > 0: grain processes that read and tokenise
  # Tokenizer: trained on the train split unless tokenizer_path is given; it
  # is saved as <workdir>/tokenizer.model and reused when the run resumes.
  c.vocab_size = 1000
  c.tokenizer_type = 'bpe'     # or 'unigram'
  c.tokenizer_path = ''
  c.tokenizer_max_sentences = 200_000
  # Model: fields of xfmr_jax.config.ModelConfig (vocab_size comes from the
  # tokenizer).
  c.model = ml_collections.ConfigDict(dict(
      d_model=512, num_heads=8, num_encoder_layers=6, num_decoder_layers=6,
      d_ff=2048, dropout_rate=0.1, attention_dropout_rate=0.0, max_len=512,
      positional='sinusoidal', norm_position='post', norm_type='layernorm',
      activation='relu', share_embeddings=True, dtype='float32',
      scan_layers=False, remat=False,
      # Variants (see ModelConfig): positional 'rope'/'alibi',
      # activation 'swiglu'/'silu'/'gelu', num_kv_heads < num_heads (GQA,
      # 1 = MQA), use_bias, model_kind 'decoder_only', attention_impl,
      # sinusoid_layout 'halves', logits_bias 'learned'/'fixed' and
      # pad_embedding 'zero' (Marian's).
      num_kv_heads=0, use_bias=True, model_kind='encoder_decoder',
      attention_impl='auto', layer_norm_epsilon=1e-6,
      sinusoid_layout='interleaved', logits_bias='none',
      pad_embedding='learned',
      # Long inputs (see ModelConfig): self-attention 'local' (a window of
      # attention_window keys each side, attention_global_tokens) or
      # 'linear' (linear_feature_map 'elu' or 'favor'); norm_position 'peri'.
      attention_kind='full', attention_window=0, attention_global_tokens=0,
      linear_feature_map='elu', favor_features=0, favor_seed=0))
  # Start from another workdir's newest parameters, model and tokenizer (for
  # example one written by python -m experiments.import_marian) when this
  # workdir has no checkpoint yet: fine-tuning. '' = from scratch.
  c.init_from = ''
  # Optimisation (section 5.3-5.4).
  c.batch_size = 64            # rows per step (all processes together)
  c.num_train_steps = 100_000
  c.warmup_steps = 4000
  c.lr_scale = 1.0             # multiplies the paper's learning-rate formula
  # 'paper' (equation 3 times lr_scale) or 'linear': warmup to learning_rate
  # over warmup_steps, then linear decay over the run (fine-tuning).
  c.lr_schedule = 'paper'
  c.learning_rate = 0.0        # peak rate of lr_schedule='linear'

  c.adam_b1 = 0.9
  c.adam_b2 = 0.98
  c.adam_eps = 1e-9
  c.label_smoothing = 0.1
  c.grad_clip_norm = 0.0       # 0 = no clipping
  c.grad_accum_steps = 1
  # > 0: keep an exponential moving average of the parameters with this decay
  # (optim.params_average; the paper averages its last checkpoints instead),
  # and evaluate, pick the best checkpoint and translate with it. 0 = off.
  c.ema_decay = 0.0
  c.seed = 0
  # Progress, evaluation and checkpoints.
  c.log_every = 50
  c.eval_every = 1000
  c.eval_batches = 4           # validation batches for the periodic eval loss
  c.eval_batch_size = 128
  c.bleu_samples = 256         # validation sentences decoded at each eval
  c.test_samples = 0           # test sentences for the final metrics; 0 = all
  c.checkpoint_every = 1000
  c.keep_checkpoints = 3
  c.async_checkpoints = True
  c.num_print_samples = 3
  # Decoding for BLEU and exact match.
  c.beam_size = 1              # 1 = greedy
  c.beam_alpha = 0.6
  # Beam scoring: 'gnmt' (log p / ((5 + len) / 6) ** alpha, this library's) or
  # 'hf' (Hugging Face generate's: log p / len ** alpha, see xfmr_jax.hf_beam).
  c.beam_rules = 'gnmt'
  c.max_decode_extra = 50      # decode up to input length + this
  # Sharding (xfmr_jax/sharding.py). The devices form a mesh (data, fsdp,
  # model); parallelism picks its shape: 'dp' (-1, 1, 1), 'fsdp' (1, -1, 1),
  # 'tp' (1, 1, -1) or 'fsdp_tp' (1, -1, 2), -1 = all remaining devices.
  # mesh_shape, when set, overrides it, e.g. --config.mesh_shape='(2,4,1)'.
  # logical_axis_rules: pairs (logical axis, mesh axis or axes or None) that
  # replace sharding.RULES, e.g. '(("batch",("data","fsdp")),("embed",None))'.
  c.parallelism = 'dp'
  c.mesh_shape = ()
  c.logical_axis_rules = ()
  # Multi-host: jax.distributed.initialize. 'auto' = when a coordinator address
  # is given (here or JAX_COORDINATOR_ADDRESS) or JAX detects a TPU pod / SLURM
  # / Open MPI job; 'on'; 'off'. num_processes 0 and process_id -1 = from
  # JAX_NUM_PROCESSES / JAX_PROCESS_ID or the cluster.
  c.distributed = 'auto'
  c.coordinator_address = ''
  c.num_processes = 0
  c.process_id = -1
  return c
