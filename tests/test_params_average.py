"""The moving average of the parameters (optim.params_average): the average
it keeps, against a float64 NumPy recursion over the parameters of each
step, and how training, evaluation and resuming use it."""
import jax
import numpy as np
import pytest

from tests.test_train import tiny_config
from xfmr_jax import checkpoint, config, model as model_lib, optim
from xfmr_jax import run_config
from xfmr_jax import train_state, train_steps, training_loop
from xfmr_jax.workdir import Workdir


def _tiny_model():
  return model_lib.Transformer(config.ModelConfig(
      vocab_size=40, d_model=16, num_heads=2, num_encoder_layers=1,
      num_decoder_layers=1, d_ff=32, dropout_rate=0.0))


def _batch(rng):
  return {'inputs': rng.integers(3, 40, (4, 6)).astype(np.int32),
          'targets': rng.integers(3, 40, (4, 6)).astype(np.int32)}


def test_average_follows_the_float64_recursion(rng):
  model, decay = _tiny_model(), 0.6
  tx = optim.make_optimizer(d_model=16, warmup_steps=3, ema_decay=decay)
  state = jax.jit(lambda: train_state.init_state(model, tx, 0))()
  step, _ = train_steps.jit_steps(model, tx, 0.1)
  as64 = lambda tree: [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
  want = as64(state.params)
  for n in range(8):
    state, _ = step(state, _batch(rng))
    d = min(decay, (1 + n) / (10 + n))  # 0.1, 0.18, ... then the decay
    want = [d * a + (1 - d) * p for a, p in zip(want, as64(state.params))]
  got = as64(optim.averaged_params(state.opt_state))
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  # The average is not the last parameters (the test would be empty if so).
  last = as64(state.params)
  assert max(np.abs(g - p).max() for g, p in zip(got, last)) > 1e-3
  assert optim.eval_params(state) is optim.averaged_params(state.opt_state)


def test_no_average_without_a_decay_and_bad_decays_are_rejected():
  model = _tiny_model()
  tx = optim.make_optimizer(d_model=16, warmup_steps=3)
  state = jax.jit(lambda: train_state.init_state(model, tx, 0))()
  assert optim.averaged_params(state.opt_state) is None
  assert optim.eval_params(state) is state.params
  for bad in (1.0, -0.5):
    with pytest.raises(ValueError, match='decay'):
      optim.params_average(bad)


def test_a_skipped_step_leaves_the_average_unchanged(rng):
  model = _tiny_model()
  tx = optim.make_optimizer(d_model=16, warmup_steps=3, ema_decay=0.9)
  state = jax.jit(lambda: train_state.init_state(model, tx, 0))()
  step, _ = train_steps.jit_steps(model, tx, 0.1, nan_at_step=1)
  state, _ = step(state, _batch(rng))
  before = jax.device_get(optim.averaged_params(state.opt_state))
  state, _ = step(state, _batch(rng))  # non-finite: skipped
  after = jax.device_get(optim.averaged_params(state.opt_state))
  assert int(state.bad_step) == 1
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_workdir_translates_with_the_average(data_dir, tmp_path):
  c = tiny_config(data_dir, num_train_steps=20)
  assert c.ema_decay > 0  # the toy recipe averages
  training_loop.train_and_evaluate(c, str(tmp_path))
  trained = Workdir(tmp_path).load()
  params = trained.params
  model, tx = trained.model, optim.from_config(c)
  abstract = jax.eval_shape(lambda: train_state.init_state(model, tx, c.seed))
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'checkpoints'),
                                 async_save=False)
  try:
    _, state, _, _ = ckpt.restore(abstract)
  finally:
    ckpt.close()
  average = optim.averaged_params(state.opt_state)
  for a, p in zip(jax.tree.leaves(average), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(p))
  assert any(not np.array_equal(a, r) for a, r in zip(
      jax.tree.leaves(average), jax.tree.leaves(state.params)))


def test_resuming_with_the_average_switched_is_refused(tmp_path):
  saved = {'model': {}, 'ema_decay': 0.99}
  with pytest.raises(run_config.ConfigError, match='ema_decay'):
    run_config.check_resumable(saved, {'model': {}, 'ema_decay': 0.0},
                               str(tmp_path))
  run_config.check_resumable(saved, {'model': {}, 'ema_decay': 0.9},
                             str(tmp_path))  # another decay is fine
