"""Shared fixtures. Tests run on the CPU backend with float32 arithmetic."""
import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
  return np.random.default_rng(0)


@pytest.fixture
def key():
  return jax.random.key(0)


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
  """The 'small' toy_translate dataset (5k training pairs), built once."""
  from xfmr_jax import data
  d = tmp_path_factory.mktemp('tfds')
  data.build_toy_dataset(str(d), config='small')
  return d


@pytest.fixture(scope='session')
def trained_workdir(data_dir, tmp_path_factory):
  """A toy model trained briefly (300 steps): it gets short sentences right.
  Shared by the translate and serving tests."""
  from tests.test_train import tiny_config
  from xfmr_jax import training_loop
  wd = tmp_path_factory.mktemp('trained')
  cfg = tiny_config(data_dir, num_train_steps=300, vocab_size=600,
                    lr_scale=0.5, warmup_steps=100, batch_size=32,
                    max_length=64, checkpoint_every=300, log_every=50,
                    test_samples=64)
  cfg.model.update(d_model=128, num_heads=4, num_encoder_layers=2,
                   num_decoder_layers=2, d_ff=256, max_len=128)
  training_loop.train_and_evaluate(cfg, str(wd))
  return wd


@pytest.fixture(scope='session')
def exported_artifact(trained_workdir, tmp_path_factory):
  """``trained_workdir`` exported with beam sizes 4 and 1, batch size 8."""
  from xfmr_jax import export
  out = tmp_path_factory.mktemp('export') / 'artifact'
  export.export_workdir(str(trained_workdir), str(out), beam_sizes=(4, 1),
                        batch_size=8, progress=lambda line: None)
  return out
