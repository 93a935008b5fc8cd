"""The training loop behind ``python -m experiments.train_wmt``.

``train_and_evaluate(config, workdir)`` builds the data and tokenizer, trains
with periodic evaluation and checkpoints, resumes from ``workdir`` when a
checkpoint is there, and returns (and writes) the final metrics.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from typing import Any, Callable, NoReturn

import jax
import ml_collections
import optax
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

# Fault injection for tests (tests/fault_runner.py sets it): None in a real
# run; else called with the name of each point the run passes, so that a test
# can stop or kill the process exactly there. The points: 'step:N' after step
# N, 'save:N' while checkpoint N is written, 'eval' before a periodic
# evaluation, 'final_save' after the last step, 'final_eval' between the
# final evaluation's batches.
fault_hook: Callable[[str], None] | None = None


def _at(point: str) -> None:
  if fault_hook is not None:
    fault_hook(point)


class NonFiniteError(RuntimeError):
  """The loss or the gradients stopped being finite."""


def _raise_non_finite(bad_step: int, checkpoint_dir: str) -> NoReturn:
  raise NonFiniteError(f'non-finite loss or gradients at step {bad_step}; '
                       'stopping with no checkpoint written after it. The '
                       f'last good checkpoint stays in {checkpoint_dir}')


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


def _token_count(batch: dict) -> int:
  """The non-padding tokens of a batch, both sides."""
  return int((batch['inputs'] > 0).sum() + (batch['targets'] > 0).sum())


class _Progress:
  """The progress bar and the throughput count completed steps. A step is
  waited for once the next one is dispatched (one step stays queued on the
  device meanwhile), or at once where the loop needs its results."""

  def __init__(self, bar: tqdm.tqdm, speed: Throughput):
    self.bar, self.speed = bar, speed
    self._in_flight = None  # (metrics, tokens) of the step dispatched last

  def dispatched(self, metrics: dict, n_tokens: int) -> None:
    self.settle()
    self._in_flight = (metrics, n_tokens)

  def settle(self) -> None:
    """Wait for the step in flight, if any, and count it."""
    if self._in_flight is not None:
      metrics, n_tokens = self._in_flight
      jax.block_until_ready(metrics)
      self.speed.step(n_tokens)
      self.bar.update(1)
      self._in_flight = None


@dataclasses.dataclass
class _Run:
  """What a training run holds from its set-up (:func:`_set_up`) to its end;
  ``state`` is replaced after each step."""
  config: ml_collections.ConfigDict
  config_json: dict
  workdir: Workdir
  tokenizer: Any
  model: Any
  schedule: optax.Schedule
  mesh: jax.sharding.Mesh
  rules: Any
  state: train_state.TrainState
  train_fn: Callable
  eval_fn: Callable
  train_iter: Any          # the data pipeline's iterator (get/set_state)
  eval_batches: list
  eval_source: Any
  test_source: Any
  ckpt: checkpoint.Checkpointer
  writer: MetricsWriter
  n_params: int
  stop: dict               # {'signal': None or the signal number}
  speed: Throughput = dataclasses.field(default_factory=Throughput)

  def stopping(self) -> bool:
    return self.stop['signal'] is not None

  def should_stop_final_eval(self) -> bool:
    """``should_stop`` of the final evaluation (asked between batches)."""
    _at('final_eval')
    return self.stopping()

  def save(self, step: int, metrics: dict | None = None) -> None:
    """Start writing checkpoint ``step`` (with its eval ``metrics``), unless
    a step since the last one was not finite."""
    bad = int(jax.device_get(self.state.bad_step))
    if bad >= 0:
      _raise_non_finite(bad, self.ckpt.directory)
    self.ckpt.save(step, self.state,
                   checkpoint.gather_data_state(self.train_iter.get_state()),
                   self.config_json, metrics)
    _at(f'save:{step}')  # while the (async) write is under way

  def log_train(self, step: int, pending: list, bar: tqdm.tqdm) -> None:
    """Write the train row of the steps' summed metrics ``pending``; a
    non-finite loss ends the run."""
    lr = float(optim.last_learning_rate(self.state.opt_state, self.schedule))
    row = _train_row(jax.device_get(pending), lr, self.speed.interval_rate())
    if not math.isfinite(row['loss']):
      _raise_non_finite(int(jax.device_get(self.state.bad_step)),
                        self.ckpt.directory)
    self.writer.write(step, 'train', row)
    bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f'{lr:.2e}',
                    tok_s=f"{row['tokens_per_sec']:.0f}")

  def evaluate(self, step: int, bar: tqdm.tqdm) -> dict:
    """The periodic evaluation at ``step``, logged; its time is left out of
    the throughput."""
    # A stop request waits for this (short) evaluation, so that the step's
    # checkpoint carries its score as in an uninterrupted run.
    _at('eval')
    t0 = time.time()
    with sharding.use(self.mesh, self.rules):
      metrics, samples = evaluation.evaluate(
          self.config, self.model, optim.eval_params(self.state),
          self.tokenizer, self.eval_fn, self.eval_batches, self.eval_source,
          self.config.bleu_samples, self.mesh, progress='eval')
    self.writer.write(step, 'eval', metrics)
    bar.write(f"step {step}: eval loss {metrics['loss']:.4f} nll "
              f"{metrics['nll']:.4f} BLEU {metrics['bleu']:.2f} exact match "
              f"{metrics['exact_match']:.3f}")
    if self.config.num_print_samples:
      bar.write(evaluation.format_samples(samples,
                                          self.config.num_print_samples))
    self.speed.pause(time.time() - t0)
    return metrics

  def stopped(self, step: int) -> dict:
    """The result of a run that a signal stopped at checkpoint ``step``."""
    name = signal.Signals(self.stop['signal']).name
    log.info('%s received: checkpoint %d is saved; run again to resume',
             name, step)
    self.writer.close()
    return {'step': step, 'stopped_by': name}


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
  run = _set_up(config, workdir, stop)
  try:
    step = _train(run)
  finally:
    run.train_iter.close()  # stops its worker processes, if any
    run.ckpt.close()  # waits for the last save
  if run.stopping():
    return run.stopped(step)
  try:
    with sharding.use(run.mesh, run.rules):
      final = _final_eval(run, step)
  except evaluation.Stopped:
    return run.stopped(step)
  tokens_per_sec, steps_per_sec = run.speed.overall_rate()
  final.update(step=step, wall_seconds=time.time() - wall_start,
               train_tokens_per_sec=tokens_per_sec,
               train_steps_per_sec=steps_per_sec,
               parameters=int(run.n_params))
  run.writer.close()
  run.workdir.write_final_metrics(final)
  return final


def _resolve(config, workdir: str):
  """``(config, config_json, workdir)``: the config to train (``init_from``
  applied, validated), its JSON, and the workdir, made if new; a
  ConfigError if it holds a run of another model."""
  config = apply_init_from(config)
  validate_config(config)
  wd = Workdir(os.path.abspath(workdir))
  config_json = json.loads(config.to_json_best_effort())
  if wd.has_config():
    check_resumable(wd.read_config(), config_json, wd.path)
  os.makedirs(wd.path, exist_ok=True)
  return config, config_json, wd


def _set_up(config, workdir: str, stop: dict) -> _Run:
  """Everything a run needs before its first step, its state restored from
  the newest checkpoint (or ``init_from``) where there is one."""
  config, config_json, wd = _resolve(config, workdir)
  # Every split is opened before the first step, so a missing one is an
  # error now rather than after training.
  train_source = data_source(config, config.train_split)
  eval_source = data_source(config, config.eval_split)
  test_source = data_source(config, config.test_split)
  tokenizer = get_tokenizer(config, wd.path, train_source)
  model = build_model(config, tokenizer.vocab_size)
  tx = optim.from_config(config)
  mesh = sharding.make_mesh(sharding.mesh_shape_from_config(config))
  rules = sharding.rules_from_config(config)
  # Created already laid out over the mesh (one jit with out_shardings).
  state, state_shardings = train_state.create_train_state(
      model, tx, config.seed, mesh, rules)
  train_fn, eval_fn = train_steps.jit_steps(
      model, tx, config.label_smoothing, mesh=mesh,
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
  state, step0 = _starting_state(config, state, tx, state_shardings, ckpt,
                                 train_iter)
  wd.write_config(config_json)
  return _Run(config, config_json, wd, tokenizer, model,
              optim.schedule_from_config(config), mesh, rules, state,
              train_fn, eval_fn, train_iter, eval_batches, eval_source,
              test_source, ckpt, MetricsWriter(wd.path, resume_step=step0),
              n_params, stop)


def _starting_state(config, state, tx, shardings, ckpt, train_iter):
  """``(state, step)`` to train from: the newest valid checkpoint's (the
  data iterator moved to its position), else ``config.init_from``'s
  parameters, else the fresh ``state`` at step 0."""
  restored = ckpt.restore(checkpoint.abstract_like(state))
  if restored is not None:
    step0, state, data_state, _ = restored
    data_state = checkpoint.process_data_state(data_state)
    if data_state:  # an imported model's checkpoint has no data position
      train_iter.set_state(data_state)
    log.info('resumed from checkpoint %d in %s', step0, ckpt.directory)
    return state, step0
  if config.get('init_from'):
    params = init_params(config, state.params)
    # A fresh optimizer state for them: its moving average starts there too.
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
    state = state.replace(params=params, opt_state=opt_state)
    log.info('starting from the parameters of %s', config.init_from)
  return state, 0


def _train(run: _Run) -> int:
  """Train from the state's step until ``num_train_steps`` or a stop request,
  with the periodic logs, evaluations and checkpoints; returns the last step
  (checkpointed)."""
  config = run.config
  step = int(jax.device_get(run.state.step))
  bar = tqdm.tqdm(total=config.num_train_steps, initial=step,
                  disable=jax.process_index() != 0, dynamic_ncols=True,
                  desc='train')
  progress = _Progress(bar, run.speed)
  pending = []   # metrics of the steps since the last log
  try:
    while step < config.num_train_steps and not run.stopping():
      batch = next(run.train_iter)
      run.state, metrics = run.train_fn(
          run.state, sharding.global_batch(batch, run.mesh))
      step += 1
      progress.dispatched(metrics, _token_count(batch))
      pending.append(metrics)
      at_end = step == config.num_train_steps
      log_now = step % config.log_every == 0 or at_end
      eval_now = step % config.eval_every == 0 and not at_end
      if log_now or eval_now:
        progress.settle()
      if log_now:
        run.log_train(step, pending, bar)
        pending = []
      eval_metrics = run.evaluate(step, bar) if eval_now else None
      _at(f'step:{step}')
      if (step % config.checkpoint_every == 0 or eval_now or at_end
          or run.stopping()):
        run.save(step, eval_metrics)
    _at('final_save')
    progress.settle()
  finally:
    bar.close()
  return step


def _final_eval(run: _Run, step: int) -> dict:
  """The test-split evaluation at the end of a run: logged, printed, and
  the final metrics without the run's timings."""
  config = run.config
  batches = data.make_eval_batches(
      run.test_source, run.tokenizer, batch_size=config.eval_batch_size,
      max_length=config.eval_max_length, limit=config.test_samples or None)
  metrics, samples = evaluation.evaluate(
      config, run.model, optim.eval_params(run.state), run.tokenizer,
      run.eval_fn, batches, run.test_source, config.test_samples, run.mesh,
      progress='test', should_stop=run.should_stop_final_eval)
  run.writer.write(step, 'test', metrics)
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
