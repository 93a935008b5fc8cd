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
import sys
import time

import jax
import ml_collections
import tqdm

from xfmr_jax import checkpoint, data, evaluation, optim, sharding
from xfmr_jax import model as model_lib
from xfmr_jax import train_state, train_steps
from xfmr_jax.finetune import apply_init_from, init_params
from xfmr_jax.metrics_log import MetricsWriter, Throughput
from xfmr_jax.run_config import (build_model, check_resumable, data_source,
                                 validate_config)
from xfmr_jax.run_tokenizer import get_tokenizer
from xfmr_jax.workdir import Workdir

log = logging.getLogger('xfmr_jax')


class NonFiniteError(RuntimeError):
  """The loss or the gradients stopped being finite."""


@contextlib.contextmanager
def _stop_requests():
  """Turn the first SIGTERM/SIGINT into a flag that the run checks after each
  step and between the final evaluation's batches; a second one aborts at
  once."""
  stop = {'signal': None}

  def handler(signum, frame):
    del frame
    if stop['signal'] is not None:
      raise KeyboardInterrupt(f'second {signal.Signals(signum).name}: '
                              'aborting without a checkpoint')
    stop['signal'] = signum
    print(f'{signal.Signals(signum).name} received: stopping at the next '
          'step or evaluation batch with a checkpoint (again to abort now)',
          file=sys.stderr, flush=True)
  previous = {s: signal.signal(s, handler)
              for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield stop
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


def _train_row(sums: list, learning_rate: float, tokens_per_sec: float) -> dict:
  """Per-token means of the summed step metrics since the last log."""
  tok = max(sum(float(m['tokens']) for m in sums), 1.0)
  mean = lambda k: sum(float(m[k]) for m in sums) / tok
  return {'loss': mean('loss'), 'nll': mean('nll'),
          'accuracy': mean('correct'),
          'grad_norm': float(sums[-1]['grad_norm']),
          'learning_rate': learning_rate, 'tokens_per_sec': tokens_per_sec}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Train (or resume) in ``workdir`` and return the final metrics.

  SIGTERM or SIGINT at any moment ends the run with one consistent
  checkpoint and returns ``{'step', 'stopped_by'}``; calling again resumes
  it, and the resumed run ends as an uninterrupted one would.
  """
  with _stop_requests() as stop:
    return _train_and_evaluate(config, workdir, stop)


def _train_and_evaluate(config, workdir: str, stop: dict) -> dict:
  wall_start = time.time()
  config = apply_init_from(config)
  validate_config(config)
  workdir = os.path.abspath(workdir)
  config_json = json.loads(config.to_json_best_effort())
  wd = Workdir(workdir)
  if wd.has_config():
    check_resumable(wd.read_config(), config_json, workdir)
  os.makedirs(workdir, exist_ok=True)
  is_main = jax.process_index() == 0

  # Every split is opened before the first step, so a missing one is an
  # error now rather than after training.
  train_source = data_source(config, config.train_split)
  eval_source = data_source(config, config.eval_split)
  test_source = data_source(config, config.test_split)
  tokenizer = get_tokenizer(config, workdir, train_source)
  model = build_model(config, tokenizer.vocab_size)
  tx = optim.from_config(config)
  schedule = optim.schedule_from_config(config)
  mesh = sharding.make_mesh(sharding.mesh_shape_from_config(config))
  rules = sharding.rules_from_config(config)
  # Created already laid out over the mesh (one jit with out_shardings).
  state, state_shardings = train_state.create_train_state(
      model, tx, config.seed, mesh, rules)
  train_fn, eval_fn = train_steps.jit_steps(
      model, tx, config.label_smoothing, config.debug_nan_at_step, mesh=mesh,
      state_shardings=state_shardings, rules=rules)
  n_params = model_lib.param_count(state.params)
  log.info('model: %.2fM parameters, vocab %d; mesh %s over %d devices',
           n_params / 1e6, tokenizer.vocab_size, dict(mesh.shape),
           jax.device_count())

  per_process = config.batch_size // jax.process_count()
  train_iter = data.make_train_iterator(
      train_source, tokenizer, batch_size=per_process,
      max_length=config.max_length, seed=config.seed,
      length_policy=config.length_policy, pack=config.pack,
      num_workers=config.data_workers)
  eval_batches = data.make_eval_batches(
      eval_source, tokenizer, batch_size=config.eval_batch_size,
      max_length=config.eval_max_length,
      limit=config.eval_batches * config.eval_batch_size)

  ckpt = wd.checkpointer(keep=config.keep_checkpoints,
                        async_save=config.async_checkpoints)
  restored = ckpt.restore(checkpoint.abstract_like(state))
  step0 = 0
  if restored is not None:
    step0, state, data_state, _ = restored
    data_state = checkpoint.process_data_state(data_state)
    if data_state:  # an imported model's checkpoint has no data position
      train_iter.set_state(data_state)
    log.info('resumed from checkpoint %d in %s', step0, ckpt.directory)
  elif config.get('init_from'):
    params = init_params(config, state.params)
    # A fresh optimizer state for them: its moving average starts there too.
    opt_state = jax.jit(tx.init, out_shardings=state_shardings.opt_state)(params)
    state = state.replace(params=params, opt_state=opt_state)
    log.info('starting from the parameters of %s', config.init_from)
  wd.write_config(config_json)
  writer = MetricsWriter(workdir, resume_step=step0)
  stopping = lambda: stop['signal'] is not None

  def stop_point(name):
    """Fault injection for tests: at ``name``, SIGTERM to this process
    (``debug_stop_at=name``) or SIGKILL (``debug_stop_at='kill:' + name``)."""
    wanted = config.get('debug_stop_at') or ''
    if wanted == name:
      os.kill(os.getpid(), signal.SIGTERM)
    elif wanted == 'kill:' + name:
      os.kill(os.getpid(), signal.SIGKILL)

  def checked(name):
    """``should_stop`` for an evaluation: the stop point, then the flag."""
    def should_stop():
      stop_point(name)
      return stopping()
    return should_stop

  def save(step, metrics=None):
    bad = int(jax.device_get(state.bad_step))
    if bad >= 0:
      raise NonFiniteError(f'non-finite loss or gradients at step {bad}; '
                           'no checkpoint written after it, the last good one '
                           f'is kept in {ckpt.directory}')
    ckpt.save(step, state, checkpoint.gather_data_state(train_iter.get_state()),
              config_json, metrics)
    stop_point(f'save:{step}')  # while the (async) write is under way

  def periodic_eval(step):
    # A stop request waits for this (short) evaluation, so that the step's
    # checkpoint carries its score as in an uninterrupted run.
    stop_point('eval')
    with sharding.use(mesh, rules):
      metrics, samples = evaluation.evaluate(
          config, model, optim.eval_params(state), tokenizer, eval_fn,
          eval_batches, eval_source, config.bleu_samples, mesh,
          progress='eval')
    writer.write(step, 'eval', metrics)
    bar.write(f"step {step}: eval loss {metrics['loss']:.4f} nll "
              f"{metrics['nll']:.4f} BLEU {metrics['bleu']:.2f} exact match "
              f"{metrics['exact_match']:.3f}")
    if config.num_print_samples:
      bar.write(evaluation.format_samples(samples, config.num_print_samples))
    return metrics

  step = int(jax.device_get(state.step))
  speed = Throughput()
  pending = []   # metrics of the steps since the last log
  in_flight = None  # (metrics, tokens) of the step dispatched last
  bar = tqdm.tqdm(total=config.num_train_steps, initial=step,
                  disable=not is_main, dynamic_ncols=True, desc='train')
  try:
    while step < config.num_train_steps and not stopping():
      batch = next(train_iter)
      state, metrics = train_fn(state, sharding.global_batch(batch, mesh))
      step += 1
      n_tokens = int((batch['inputs'] > 0).sum() +
                     (batch['targets'] > 0).sum())
      # The bar and the throughput count completed steps: wait for the
      # previous step while this one runs, so one step stays queued.
      if in_flight is not None:
        jax.block_until_ready(in_flight[0])
        speed.step(in_flight[1])
        bar.update(1)
      in_flight = (metrics, n_tokens)
      pending.append(metrics)
      at_end = step == config.num_train_steps
      eval_now = step % config.eval_every == 0 and not at_end
      if step % config.log_every == 0 or at_end or eval_now:
        jax.block_until_ready(metrics)
        speed.step(n_tokens)
        bar.update(1)
        in_flight = None
      if step % config.log_every == 0 or at_end:
        lr = float(optim.last_learning_rate(state.opt_state, schedule))
        row = _train_row(jax.device_get(pending), lr, speed.interval_rate())
        pending = []
        if not math.isfinite(row['loss']):
          bad = int(jax.device_get(state.bad_step))
          raise NonFiniteError(
              f'non-finite loss or gradients at step {bad}; stopping. The '
              f'last good checkpoint stays in {ckpt.directory}')
        writer.write(step, 'train', row)
        bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f'{lr:.2e}',
                        tok_s=f"{row['tokens_per_sec']:.0f}")
      eval_metrics = None
      if eval_now:
        t0 = time.time()
        eval_metrics = periodic_eval(step)
        speed.pause(time.time() - t0)
      stop_point(f'step:{step}')
      if step % config.checkpoint_every == 0 or eval_metrics is not None \
          or at_end or stopping():
        save(step, eval_metrics)
    stop_point('final_save')
    if in_flight is not None:
      jax.block_until_ready(in_flight[0])
      speed.step(in_flight[1])
      bar.update(1)
  finally:
    bar.close()
    train_iter.close()  # stops its worker processes, if any
    ckpt.close()  # waits for the last save

  def stopped():
    name = signal.Signals(stop['signal']).name
    log.info('%s received: checkpoint %d is saved; run again to resume',
             name, step)
    writer.close()
    return {'step': step, 'stopped_by': name}

  if stopping():
    return stopped()
  try:
    with sharding.use(mesh, rules):
      final = _final_eval(config, model, state, tokenizer, eval_fn, writer,
                          step, test_source, mesh, checked('final_eval'))
  except evaluation.Stopped:
    return stopped()
  tokens_per_sec, steps_per_sec = speed.overall_rate()
  final.update(step=step, wall_seconds=time.time() - wall_start,
               train_tokens_per_sec=tokens_per_sec,
               train_steps_per_sec=steps_per_sec, parameters=int(n_params))
  writer.close()
  wd.write_final_metrics(final)
  return final


def _final_eval(config, model, state, tokenizer, eval_fn, writer, step,
                test_source, mesh=None, should_stop=None) -> dict:
  batches = data.make_eval_batches(
      test_source, tokenizer, batch_size=config.eval_batch_size,
      max_length=config.eval_max_length, limit=config.test_samples or None)
  metrics, samples = evaluation.evaluate(
      config, model, optim.eval_params(state), tokenizer, eval_fn, batches,
      test_source, config.test_samples, mesh, progress='test',
      should_stop=should_stop)
  writer.write(step, 'test', metrics)
  if jax.process_index() == 0:
    print(f"test ({config.test_split}, {len(samples)} sentences): BLEU "
          f"{metrics['bleu']:.2f}, exact match {metrics['exact_match']:.4f}, "
          f"loss {metrics['loss']:.4f}, perplexity "
          f"{metrics['perplexity']:.3f}\n"
          f"sacreBLEU signature: {metrics['bleu_signature']}")
    if config.num_print_samples:
      print(evaluation.format_samples(samples, config.num_print_samples))
  return {'eval_loss': metrics['loss'], 'eval_nll': metrics['nll'],
          'eval_perplexity': metrics['perplexity'],
          'eval_accuracy': metrics['accuracy'], 'bleu': metrics['bleu'],
          'bleu_signature': metrics['bleu_signature'],
          'test_split': config.test_split, 'test_sentences': len(samples),
          'exact_match': metrics['exact_match']}
