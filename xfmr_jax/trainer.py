"""The training loop behind ``python -m experiments.train_wmt``.

``train_and_evaluate(config, workdir)`` builds the data and tokenizer, trains
with periodic evaluation and checkpoints, resumes from ``workdir`` when a
checkpoint is there, and returns (and writes) the final metrics.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import time

import jax
import ml_collections
import numpy as np
import sacrebleu
import tqdm

from xfmr_jax import checkpoint, data, optim, sharding, train
from xfmr_jax import model as model_lib
from xfmr_jax.config import ModelConfig
from xfmr_jax.data import pipeline
from xfmr_jax.tokenizer import Tokenizer
from xfmr_jax.translate import Translator

log = logging.getLogger('xfmr_jax')


class ConfigError(ValueError):
  """A training config that cannot work; raised before any training starts."""


class NonFiniteError(RuntimeError):
  """The loss or the gradients stopped being finite."""


# ------------------------------------------------------------ configuration --

_POSITIVE = ('vocab_size', 'max_length', 'eval_max_length', 'batch_size',
             'num_train_steps', 'warmup_steps', 'log_every', 'eval_every',
             'checkpoint_every', 'keep_checkpoints', 'eval_batch_size',
             'grad_accum_steps', 'beam_size', 'tokenizer_max_sentences')


def model_config(config, vocab_size: int) -> ModelConfig:
  try:
    return ModelConfig(vocab_size=vocab_size, **config.model.to_dict())
  except (TypeError, ValueError) as e:
    raise ConfigError(f'config.model: {e}') from None


def validate_config(config) -> None:
  """Reject a config that cannot train, with a message naming the field."""
  for name in _POSITIVE:
    value = config[name]
    if not isinstance(value, int) or value <= 0:
      raise ConfigError(f'config.{name} must be a positive integer, got '
                        f'{value!r}')
  if config.max_length > config.model.max_len:
    raise ConfigError(f'config.max_length={config.max_length} exceeds '
                      f'config.model.max_len={config.model.max_len}')
  if config.length_policy not in ('filter', 'truncate'):
    raise ConfigError("config.length_policy must be 'filter' or 'truncate'")
  if config.tokenizer_type not in ('bpe', 'unigram'):
    raise ConfigError("config.tokenizer_type must be 'bpe' or 'unigram'")
  if config.tokenizer_path and not os.path.exists(config.tokenizer_path):
    raise ConfigError(f'config.tokenizer_path {config.tokenizer_path!r} does '
                      'not exist')
  if not 0 <= config.label_smoothing < 1:
    raise ConfigError('config.label_smoothing must be in [0, 1)')
  if config.batch_size % jax.process_count():
    raise ConfigError(f'config.batch_size={config.batch_size} is not divisible '
                      f'by the {jax.process_count()} processes')
  if model_config(config, config.vocab_size).model_kind == 'encoder_only':
    raise ConfigError("config.model.model_kind='encoder_only' tags tokens; "
                      'this trainer translates (train a tagger with '
                      'python -m experiments.train_tagger)')
  validate_sharding(config)
  kind, colon, spec = config.dataset.partition(':')
  if colon and kind in ('tsv', 'files'):
    for path in spec.split(','):
      path = path.replace('{split}', config.train_split)
      if not os.path.exists(path):
        raise ConfigError(f'config.dataset: data file {path!r} does not exist')
  elif not (config.dataset.startswith('toy_translate') or
            config.dataset.startswith(('wmt14_translate/', 'wmt17_translate/'))):
    raise ConfigError(f'config.dataset={config.dataset!r} is unknown; use '
                      "'toy_translate', 'wmt14_translate/de-en', "
                      "'wmt17_translate/de-en', 'tsv:PATH' or 'files:SRC,TGT'")


def validate_sharding(config) -> tuple:
  """The ``(data, fsdp, model)`` mesh shape for this run, or a ConfigError."""
  try:
    shape = sharding.resolve_mesh_shape(sharding.mesh_shape_from_config(config),
                                        jax.device_count())
    sharding.rules_from_config(config)
  except (ValueError, TypeError) as e:
    raise ConfigError(f'config.mesh_shape / parallelism / logical_axis_rules: '
                      f'{e}') from None
  rows = shape[0] * shape[1]  # the batch is split over data x fsdp
  for name in ('batch_size', 'eval_batch_size'):
    if config[name] % rows:
      raise ConfigError(f'config.{name}={config[name]} is not divisible by '
                        f'data x fsdp = {rows} (mesh {shape})')
  if rows % jax.process_count():
    raise ConfigError(f'data x fsdp = {rows} (mesh {shape}) must be a multiple '
                      f'of the {jax.process_count()} processes, so that each '
                      'process feeds its own rows')
  return shape


def _source(config, split: str):
  return data.get_source(config.dataset, split, config.data_dir or None,
                         reverse=config.reverse)


def get_tokenizer(config, workdir: str, train_source) -> Tokenizer:
  """The workdir's tokenizer, else ``tokenizer_path``, else a new one."""
  if jax.process_count() > 1:  # every process must use process 0's tokenizer
    from jax.experimental import multihost_utils
    proto = (_get_tokenizer(config, workdir, train_source).model_proto
             if jax.process_index() == 0 else b'')
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(proto))))
    buf = np.zeros(size, np.uint8)
    if jax.process_index() == 0:
      buf[:] = np.frombuffer(proto, np.uint8)
    buf = multihost_utils.broadcast_one_to_all(buf)
    return Tokenizer(np.asarray(buf, np.uint8).tobytes())
  return _get_tokenizer(config, workdir, train_source)


def _get_tokenizer(config, workdir: str, train_source) -> Tokenizer:
  saved = os.path.join(workdir, 'tokenizer.model')
  if os.path.exists(saved):
    return Tokenizer.load(saved)
  if config.tokenizer_path:
    tokenizer = Tokenizer.load(config.tokenizer_path)
  else:
    n = min(len(train_source), config.tokenizer_max_sentences // 2)
    indices = np.linspace(0, len(train_source) - 1, n).astype(int).tolist()
    pairs = pipeline.read_pairs(train_source, indices)
    texts = [t for pair in pairs for t in pair]
    log.info('training a %s tokenizer (vocab %d) on %d sentences',
             config.tokenizer_type, config.vocab_size, len(texts))
    tokenizer = Tokenizer.train(texts, vocab_size=config.vocab_size,
                                model_type=config.tokenizer_type)
  if jax.process_index() == 0:
    tokenizer.save(workdir)
  return tokenizer


# --------------------------------------------------------------- evaluation --

def evaluate_loss(eval_fn, params, batches, mesh=None) -> dict:
  """Per-token smoothed loss, NLL, perplexity and accuracy over ``batches``.

  With ``mesh``, each (whole, same on every process) batch is split over the
  mesh's data axes.
  """
  totals = None
  for batch in batches:
    arrays = {k: v for k, v in batch.items() if k in train.MODEL_KEYS}
    if mesh is not None:
      arrays = sharding.global_batch(arrays, mesh, replicated_input=True)
    metrics = jax.device_get(eval_fn(params, arrays))
    totals = metrics if totals is None else {
        k: totals[k] + metrics[k] for k in totals}
  tokens = max(float(totals['tokens']), 1.0)
  nll = float(totals['nll']) / tokens
  return {'loss': float(totals['loss']) / tokens, 'nll': nll,
          'perplexity': math.exp(min(nll, 50.0)),
          'accuracy': float(totals['correct']) / tokens}


def evaluate_translation(translator: Translator, source, limit: int) -> dict:
  """sacreBLEU and exact match of ``translator`` on the first ``limit`` pairs."""
  n = len(source) if limit <= 0 else min(limit, len(source))
  pairs = pipeline.read_pairs(source, list(range(n)))
  hyps = translator([p[0] for p in pairs])
  refs = [p[1] for p in pairs]
  bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
  exact = float(np.mean([h == r for h, r in zip(hyps, refs)]))
  samples = [dict(source=p[0], reference=p[1], output=h)
             for p, h in zip(pairs, hyps)]
  return {'bleu': bleu, 'exact_match': exact, 'samples': samples}


# ------------------------------------------------------------------ logging --

class MetricsWriter:
  """JSON lines (``metrics.jsonl``) and TensorBoard events, on process 0 only."""

  def __init__(self, workdir: str):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))
      self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a')

  def write(self, step: int, prefix: str, metrics: dict) -> None:
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in metrics.items()
               if isinstance(v, (int, float, np.floating, np.integer))}
    self._jsonl.write(json.dumps({'step': step, 'split': prefix, **scalars})
                      + '\n')
    self._jsonl.flush()
    for k, v in scalars.items():
      self._tb.add_scalar(f'{prefix}/{k}', v, step)
    self._tb.flush()

  def close(self):
    if self.enabled:
      self._tb.close()
      self._jsonl.close()


@contextlib.contextmanager
def _stop_requests():
  """Turn SIGTERM/SIGINT into a flag the loop checks after each step."""
  stop = {'signal': None}
  handler = lambda signum, frame: stop.update(signal=signum)
  previous = {s: signal.signal(s, handler)
              for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield stop
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


# --------------------------------------------------------------------- main --

def build(config, vocab_size: int):
  """Model and optimiser for ``config``."""
  model = model_lib.build(model_config(config, vocab_size))
  tx = optim.make_optimizer(
      d_model=config.model.d_model, warmup_steps=config.warmup_steps,
      lr_scale=config.lr_scale, b1=config.adam_b1, b2=config.adam_b2,
      eps=config.adam_eps, grad_clip_norm=config.grad_clip_norm,
      grad_accum_steps=config.grad_accum_steps)
  return model, tx


def _translator(config, model, params, tokenizer) -> Translator:
  return Translator(model, params, tokenizer, beam_size=config.beam_size,
                    alpha=config.beam_alpha,
                    max_decode_extra=config.max_decode_extra,
                    batch_size=config.eval_batch_size)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Train (or resume) in ``workdir`` and return the final metrics."""
  wall_start = time.time()
  validate_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  is_main = jax.process_index() == 0

  train_source = _source(config, config.train_split)
  eval_source = _source(config, config.eval_split)
  tokenizer = get_tokenizer(config, workdir, train_source)
  model, tx = build(config, tokenizer.vocab_size)
  mesh = sharding.make_mesh(sharding.mesh_shape_from_config(config))
  rules = sharding.rules_from_config(config)
  # Created already laid out over the mesh (one jit with out_shardings).
  state, state_shardings = sharding.create_train_state(model, tx, config.seed,
                                                       mesh, rules)
  train_fn, eval_fn = train.jit_steps(
      model, tx, config.label_smoothing, config.debug_nan_at_step, mesh=mesh,
      state_shardings=state_shardings, rules=rules)
  n_params = sum(p.size for p in jax.tree.leaves(state.params))
  log.info('model: %.2fM parameters, vocab %d; mesh %s over %d devices',
           n_params / 1e6, tokenizer.vocab_size, dict(mesh.shape),
           jax.device_count())

  per_process = config.batch_size // jax.process_count()
  train_iter = data.make_train_iterator(
      train_source, tokenizer, batch_size=per_process,
      max_length=config.max_length, seed=config.seed,
      length_policy=config.length_policy, pack=config.pack)
  eval_batches = data.make_eval_batches(
      eval_source, tokenizer, batch_size=config.eval_batch_size,
      max_length=config.eval_max_length,
      limit=config.eval_batches * config.eval_batch_size)

  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                 keep=config.keep_checkpoints,
                                 async_save=config.async_checkpoints)
  restored = ckpt.restore(checkpoint.abstract_like(state))
  if restored is not None:
    step0, state, data_state, _ = restored
    data_state = checkpoint.process_data_state(data_state)
    if data_state is not None:
      train_iter.set_state(data_state)
    log.info('resumed from checkpoint %d in %s', step0, ckpt.directory)
  config_json = json.loads(config.to_json_best_effort())
  if is_main:  # readable by tools that load the model without a checkpoint
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      json.dump(config_json, f, indent=2)
  writer = MetricsWriter(workdir)

  def save(step, metrics=None):
    bad = int(jax.device_get(state.bad_step))
    if bad >= 0:
      raise NonFiniteError(f'non-finite loss or gradients at step {bad}; '
                           'no checkpoint written after it, the last good one '
                           f'is kept in {ckpt.directory}')
    ckpt.save(step, state, checkpoint.gather_data_state(train_iter.get_state()),
              config_json, metrics)

  step = int(jax.device_get(state.step))
  # Throughput counts the steps after the first one of this process (which
  # includes compilation) and leaves out evaluation time.
  pending, interval_tokens, tokens_done = [], 0, 0
  train_start, eval_seconds, last_log = None, 0.0, time.time()
  bar = tqdm.tqdm(total=config.num_train_steps, initial=step, disable=not is_main,
                  dynamic_ncols=True, desc='train')
  stopped_by = None
  try:
    with _stop_requests() as stop:
      while step < config.num_train_steps:
        batch = next(train_iter)
        state, metrics = train_fn(state, sharding.global_batch(batch, mesh))
        step += 1
        pending.append(metrics)
        n_tokens = int((batch['inputs'] > 0).sum() + (batch['targets'] > 0).sum())
        interval_tokens += n_tokens
        if train_start is None:
          jax.block_until_ready(state)
          train_start = last_log = time.time()
          interval_tokens = 0
        else:
          tokens_done += n_tokens
        if step % config.log_every == 0 or step == config.num_train_steps:
          row = _train_row(config, jax.device_get(pending), step,
                           interval_tokens / max(time.time() - last_log, 1e-9))
          pending, interval_tokens, last_log = [], 0, time.time()
          if not math.isfinite(row['loss']):
            bad = int(jax.device_get(state.bad_step))
            raise NonFiniteError(
                f'non-finite loss or gradients at step {bad}; stopping. The '
                f'last good checkpoint stays in {ckpt.directory}')
          writer.write(step, 'train', row)
          bar.set_postfix(loss=f"{row['loss']:.3f}",
                          lr=f"{row['learning_rate']:.2e}",
                          tok_s=f"{row['tokens_per_sec']:.0f}")
        bar.update(1)
        eval_metrics = None
        if step % config.eval_every == 0 and step < config.num_train_steps:
          t0 = time.time()
          with sharding.use(mesh, rules):
            eval_metrics = _periodic_eval(config, model, state, tokenizer,
                                          eval_fn, eval_batches, eval_source,
                                          writer, step, bar, mesh)
          eval_seconds += time.time() - t0
          last_log += time.time() - t0
        if (step % config.checkpoint_every == 0 or eval_metrics is not None
            or step == config.num_train_steps):
          save(step, eval_metrics)
        if stop['signal'] is not None:
          stopped_by = signal.Signals(stop['signal']).name
          save(step)
          break
    jax.block_until_ready(state)
    train_seconds = time.time() - (train_start or time.time()) - eval_seconds
  finally:
    bar.close()
    ckpt.close()
  if stopped_by:
    log.info('%s received: saved checkpoint %d and stopped', stopped_by, step)
    writer.close()
    return {'step': step, 'stopped_by': stopped_by}

  with sharding.use(mesh, rules):
    final = _final_eval(config, model, state, tokenizer, eval_fn, writer, step,
                        mesh)
  final.update(step=step, wall_seconds=time.time() - wall_start,
               train_tokens_per_sec=tokens_done / max(train_seconds, 1e-9),
               parameters=int(n_params))
  writer.close()
  if is_main:
    with open(os.path.join(workdir, 'final_metrics.json'), 'w') as f:
      json.dump(final, f, indent=2)
  return final


def _train_row(config, sums: list, step: int, tokens_per_sec: float) -> dict:
  """Per-token means of the summed step metrics since the last log."""
  tok = max(sum(float(m['tokens']) for m in sums), 1.0)
  mean = lambda k: sum(float(m[k]) for m in sums) / tok
  lr = optim.paper_schedule(config.model.d_model, config.warmup_steps,
                            config.lr_scale)(step - 1)
  return {'loss': mean('loss'), 'nll': mean('nll'),
          'accuracy': mean('correct'),
          'grad_norm': float(sums[-1]['grad_norm']),
          'learning_rate': float(lr), 'tokens_per_sec': tokens_per_sec}


def _periodic_eval(config, model, state, tokenizer, eval_fn, eval_batches,
                   eval_source, writer, step, bar, mesh=None) -> dict:
  metrics = evaluate_loss(eval_fn, state.params, eval_batches, mesh)
  translation = evaluate_translation(
      _translator(config, model, state.params, tokenizer), eval_source,
      config.bleu_samples)
  samples = translation.pop('samples')
  metrics.update(translation)
  writer.write(step, 'eval', metrics)
  bar.write(f"step {step}: eval loss {metrics['loss']:.4f} nll "
            f"{metrics['nll']:.4f} BLEU {metrics['bleu']:.2f} exact match "
            f"{metrics['exact_match']:.3f}")
  for s in samples[:config.num_print_samples]:
    bar.write(f"  source:    {s['source']}\n  reference: {s['reference']}\n"
              f"  output:    {s['output']}")
  return metrics


def _final_eval(config, model, state, tokenizer, eval_fn, writer, step,
                mesh=None) -> dict:
  test_source = _source(config, config.test_split)
  batches = data.make_eval_batches(
      test_source, tokenizer, batch_size=config.eval_batch_size,
      max_length=config.eval_max_length, limit=config.test_samples or None)
  metrics = evaluate_loss(eval_fn, state.params, batches, mesh)
  translation = evaluate_translation(
      _translator(config, model, state.params, tokenizer), test_source,
      config.test_samples)
  samples = translation.pop('samples')
  writer.write(step, 'test', {**metrics, **translation})
  if jax.process_index() == 0:
    print(f"test ({config.test_split}, {len(samples)} sentences): BLEU "
          f"{translation['bleu']:.2f}, exact match "
          f"{translation['exact_match']:.4f}, loss {metrics['loss']:.4f}, "
          f"perplexity {metrics['perplexity']:.3f}")
    for s in samples[:config.num_print_samples]:
      print(f"  source:    {s['source']}\n  reference: {s['reference']}\n"
            f"  output:    {s['output']}")
  return {'eval_loss': metrics['loss'], 'eval_nll': metrics['nll'],
          'eval_perplexity': metrics['perplexity'],
          'eval_accuracy': metrics['accuracy'], **translation}


def load_for_inference(workdir: str, step: int | None = None):
  """``(model, params, tokenizer, config)`` from a training workdir."""
  workdir = os.path.abspath(workdir)
  tok_path = os.path.join(workdir, 'tokenizer.model')
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  for path in (tok_path, ckpt_dir, os.path.join(workdir, 'config.json')):
    if not os.path.exists(path):
      raise checkpoint.CheckpointError(
          f'{workdir} is not a training workdir: {path} is missing')
  tokenizer = Tokenizer.load(tok_path)
  with open(os.path.join(workdir, 'config.json')) as f:
    config = ml_collections.ConfigDict(json.load(f))
  model, tx = build(config, tokenizer.vocab_size)
  abstract = jax.eval_shape(lambda: train.init_state(model, tx, config.seed))
  ckpt = checkpoint.Checkpointer(ckpt_dir, async_save=False)
  try:
    restored = ckpt.restore(abstract, step)
  finally:
    ckpt.close()
  if restored is None:
    raise checkpoint.CheckpointError(f'no checkpoint in {ckpt_dir}')
  return model, restored[1].params, tokenizer, config
