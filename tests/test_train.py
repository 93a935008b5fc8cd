"""Optimisation pieces and the training loop (in-process, small and fast)."""
import functools
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.configs import toy
from xfmr_jax import checkpoint, losses, optim, run_config
from xfmr_jax import train_state, train_steps, training_loop


def tiny_config(data_dir, **changes):
  """The toy config shrunk to run a few dozen steps in seconds."""
  c = toy.get_config()
  c.dataset = 'toy_translate/small'
  c.data_dir = str(data_dir)
  c.vocab_size = 300
  c.model.update(d_model=32, num_heads=2, num_encoder_layers=1,
                 num_decoder_layers=1, d_ff=64, max_len=128)
  c.max_length = 48
  c.eval_max_length = 96
  c.batch_size = 8
  c.num_train_steps = 30
  c.warmup_steps = 10
  c.log_every = 5
  c.eval_every = 1000
  c.checkpoint_every = 10
  c.eval_batches = 1
  c.eval_batch_size = 16
  c.bleu_samples = 16
  c.test_samples = 16
  c.max_decode_extra = 10
  c.num_print_samples = 0
  c.tokenizer_max_sentences = 4000
  c.lr_scale = 0.3
  for k, v in changes.items():
    c[k] = v
  return c


def test_schedule_is_equation_3():
  d_model, warmup = 512, 4000
  schedule = optim.paper_schedule(d_model, warmup)
  for step in (1, 10, 1000, 4000, 4001, 20000, 100000):
    expected = d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    np.testing.assert_allclose(schedule(step - 1), expected, rtol=1e-5)
  peak = np.argmax([schedule(s) for s in range(0, 8000, 10)]) * 10 + 1
  assert abs(peak - warmup) <= 10


def test_smoothed_loss_matches_numpy(rng):
  vocab, eps = 7, 0.1
  logits = rng.standard_normal((2, 5, vocab)).astype(np.float32)
  targets = rng.integers(1, vocab, (2, 5))
  weights = (rng.random((2, 5)) > 0.3).astype(np.float32)
  loss, nll = losses.smoothed_cross_entropy(logits, targets, weights, eps)
  lp = logits.astype(np.float64)
  lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
  q = np.full((2, 5, vocab), eps / (vocab - 1))
  np.put_along_axis(q, targets[..., None], 1 - eps, axis=-1)
  ce = -(q * lp).sum(-1)
  entropy = -(q * np.log(q)).sum(-1)
  np.testing.assert_allclose(loss, (ce - entropy) * weights, rtol=1e-5,
                             atol=1e-6)
  plain = -np.take_along_axis(lp, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(nll, plain * weights, rtol=1e-5, atol=1e-6)
  # Predicting the smoothed distribution itself costs exactly 0.
  loss0, _ = losses.smoothed_cross_entropy(np.log(q).astype(np.float32),
                                           targets, np.ones((2, 5)), eps)
  np.testing.assert_allclose(loss0, 0.0, atol=1e-5)


def test_eval_metrics_ignore_padding(data_dir, rng):
  cfg = tiny_config(data_dir)
  model, tx = run_config.build_model(cfg, 50), optim.from_config(cfg)
  state = jax.jit(lambda: train_state.init_state(model, tx, 0))()
  _, eval_fn = train_steps.jit_steps(model, tx, 0.1)
  batch = {'inputs': rng.integers(3, 50, (2, 6)).astype(np.int32),
           'targets': rng.integers(3, 50, (2, 5)).astype(np.int32)}
  padded = {k: np.pad(v, ((0, 0), (0, 4))) for k, v in batch.items()}
  a, b = eval_fn(state.params, batch), eval_fn(state.params, padded)
  assert float(a['tokens']) == 10 == float(b['tokens'])
  for k in ('loss', 'nll', 'correct'):
    np.testing.assert_allclose(a[k], b[k], rtol=1e-5)


def test_training_reduces_loss_and_writes_metrics(data_dir, tmp_path):
  cfg = tiny_config(data_dir, num_train_steps=60)
  final = training_loop.train_and_evaluate(cfg, str(tmp_path))
  rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  train_rows = [r for r in rows if r['split'] == 'train']
  assert train_rows[-1]['loss'] < 0.75 * train_rows[0]['loss']
  on_disk = json.load(open(tmp_path / 'final_metrics.json'))
  for key in ('step', 'eval_loss', 'bleu', 'exact_match',
              'train_tokens_per_sec', 'wall_seconds'):
    assert key in on_disk, key
  assert on_disk['step'] == 60 == final['step']
  assert on_disk['train_tokens_per_sec'] > 0
  assert os.path.exists(tmp_path / 'tokenizer.model')
  assert list((tmp_path / 'tensorboard').iterdir())


@pytest.mark.slow
def test_resume_continues_from_checkpoint(data_dir, tmp_path):
  cfg = tiny_config(data_dir, num_train_steps=20)
  training_loop.train_and_evaluate(cfg, str(tmp_path))
  cfg = tiny_config(data_dir, num_train_steps=30)
  final = training_loop.train_and_evaluate(cfg, str(tmp_path))
  assert final['step'] == 30
  steps = [json.loads(l)['step'] for l in open(tmp_path / 'metrics.jsonl')
           if '"train"' in l]
  assert steps == [5, 10, 15, 20, 25, 30]  # resumed at 20, not from 0


def test_damaged_newest_checkpoint_falls_back(data_dir, tmp_path, caplog):
  cfg = tiny_config(data_dir, num_train_steps=20)
  training_loop.train_and_evaluate(cfg, str(tmp_path))
  ckpt_dir = tmp_path / 'checkpoints'
  assert sorted(int(p.name) for p in ckpt_dir.iterdir()
                if p.name.isdigit()) == [10, 20]
  for f in (ckpt_dir / '20' / 'state').rglob('*'):
    if f.is_file():
      f.write_bytes(b'garbage')
  model, tx = run_config.build_model(cfg, 300), optim.from_config(cfg)
  abstract = jax.eval_shape(lambda: train_state.init_state(model, tx, 0))
  ckpt = checkpoint.Checkpointer(str(ckpt_dir), async_save=False)
  with caplog.at_level(logging.WARNING):
    step, state, data_state, config = ckpt.restore(abstract)
  ckpt.close()
  assert step == 10 and int(state.step) == 10
  assert 'checkpoint 20' in caplog.text and 'damaged' in caplog.text
  assert config['num_train_steps'] == 20 and 'parent' in data_state


def test_nan_guard_stops_and_keeps_good_checkpoints(data_dir, tmp_path,
                                                    monkeypatch):
  # The trainer's jitted step, with its loss poisoned at step 13.
  monkeypatch.setattr(train_steps, 'jit_steps', functools.partial(
      train_steps.jit_steps, nan_at_step=13))
  cfg = tiny_config(data_dir)
  with pytest.raises(training_loop.NonFiniteError, match='step 13'):
    training_loop.train_and_evaluate(cfg, str(tmp_path))
  ckpt_dir = tmp_path / 'checkpoints'
  steps = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
  assert steps == [10]
  model, tx = run_config.build_model(cfg, 300), optim.from_config(cfg)
  abstract = jax.eval_shape(lambda: train_state.init_state(model, tx, 0))
  ckpt = checkpoint.Checkpointer(str(ckpt_dir), async_save=False)
  _, state, _, _ = ckpt.restore(abstract)
  ckpt.close()
  assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(state.params))


def test_nan_step_leaves_state_unchanged(data_dir, rng):
  cfg = tiny_config(data_dir)
  model, tx = run_config.build_model(cfg, 50), optim.from_config(cfg)
  state = jax.jit(lambda: train_state.init_state(model, tx, 0))()
  train_fn, _ = train_steps.jit_steps(model, tx, 0.1, nan_at_step=0)
  batch = {'inputs': rng.integers(3, 50, (2, 6)).astype(np.int32),
           'targets': rng.integers(3, 50, (2, 5)).astype(np.int32)}
  before = jax.device_get(state.params)
  state, metrics = train_fn(state, batch)
  assert int(state.bad_step) == 0 and not np.isfinite(float(metrics['grad_norm']))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('field, value, message', [
    ('batch_size', 0, 'batch_size'),
    ('num_train_steps', -5, 'num_train_steps'),
    ('dataset', 'imagenet', 'unknown'),
    ('dataset', 'tsv:/no/such/file.tsv', 'does not exist'),
    ('length_policy', 'drop', 'length_policy'),
    ('data_workers', -1, 'data_workers'),
])
def test_bad_configs_are_rejected(data_dir, field, value, message):
  cfg = tiny_config(data_dir)
  cfg[field] = value
  with pytest.raises(run_config.ConfigError, match=message):
    run_config.validate_config(cfg)


@pytest.mark.parametrize('model_changes, message', [
    (dict(d_model=30, num_heads=4), 'not divisible'),
    (dict(d_ff=0), 'd_ff'),
])
def test_bad_model_configs_are_rejected(data_dir, model_changes, message):
  cfg = tiny_config(data_dir)
  cfg.model.update(**model_changes)
  with pytest.raises(run_config.ConfigError, match=message):
    run_config.validate_config(cfg)


def test_gradient_accumulation_equals_one_big_batch(rng):
  """MultiSteps over k micro-batches = one step on their concatenation."""
  from xfmr_jax import config, model as model_lib
  m = model_lib.Transformer(config.ModelConfig(
      vocab_size=40, d_model=16, num_heads=2, num_encoder_layers=1,
      num_decoder_layers=1, d_ff=32, dropout_rate=0.0))
  big = {'inputs': rng.integers(3, 40, (4, 6)).astype(np.int32),
         'targets': rng.integers(3, 40, (4, 6)).astype(np.int32)}
  halves = [{k: v[i * 2:(i + 1) * 2] for k, v in big.items()} for i in (0, 1)]
  results = []
  for accum, batches in ((1, [big]), (2, halves)):
    # A large eps makes Adam's first update ~ lr * g instead of lr * sign(g),
    # so float noise in near-zero gradients cannot flip it.
    tx = optim.make_optimizer(d_model=16, warmup_steps=5, eps=1.0,
                              grad_accum_steps=accum)
    state = jax.jit(lambda: train_state.init_state(m, tx, 0))()
    step, _ = train_steps.jit_steps(m, tx, 0.0)
    for b in batches:
      state, _ = step(state, b)
    results.append(jax.device_get(state.params))
  # Equal token counts per half, so the mean of the halves' mean gradients is
  # the mean gradient of the whole batch.
  for a, b in zip(*map(jax.tree.leaves, results)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_bfloat16_compute_keeps_float32_parameters(data_dir, rng):
  cfg = tiny_config(data_dir)
  cfg.model.dtype = 'bfloat16'
  model, tx = run_config.build_model(cfg, 50), optim.from_config(cfg)
  state = jax.jit(lambda: train_state.init_state(model, tx, 0))()
  train_fn, _ = train_steps.jit_steps(model, tx, 0.1)
  batch = {'inputs': rng.integers(3, 50, (4, 6)).astype(np.int32),
           'targets': rng.integers(3, 50, (4, 5)).astype(np.int32)}
  losses_ = []
  for _ in range(5):
    state, metrics = train_fn(state, batch)
    losses_.append(float(metrics['loss']) / float(metrics['tokens']))
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(state.params))
  assert np.all(np.isfinite(losses_)) and losses_[-1] < losses_[0]


def test_best_checkpoint_by_bleu_is_kept_beside_the_latest(data_dir, tmp_path):
  cfg = tiny_config(data_dir, num_train_steps=30, eval_every=10,
                    checkpoint_every=10, keep_checkpoints=1)
  training_loop.train_and_evaluate(cfg, str(tmp_path))
  evals = {r['step']: r['bleu'] for r in map(json.loads,
                                               open(tmp_path / 'metrics.jsonl'))
           if r['split'] == 'eval'}
  assert sorted(evals) == [10, 20]
  best = max(evals.values())
  kept = sorted(int(p.name) for p in (tmp_path / 'checkpoints').iterdir()
                if p.name.isdigit())
  assert kept[-1] == 30 and len(kept) == 2
  assert evals[kept[0]] == best


def test_logged_learning_rate_is_the_rate_of_the_last_update(data_dir,
                                                             tmp_path):
  # With accumulation the schedule advances once per 3 micro-steps.
  cfg = tiny_config(data_dir, num_train_steps=20, grad_accum_steps=3)
  training_loop.train_and_evaluate(cfg, str(tmp_path))
  rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  logged = {r['step']: r['learning_rate'] for r in rows
            if r['split'] == 'train'}
  assert sorted(logged) == [5, 10, 15, 20]
  schedule = optim.paper_schedule(cfg.model.d_model, cfg.warmup_steps,
                                  cfg.lr_scale)
  for step, lr in logged.items():
    updates = step // 3
    np.testing.assert_allclose(lr, schedule(updates - 1), rtol=1e-6)
    assert abs(lr - float(schedule(step - 1))) > 1e-6  # not the micro-step's
