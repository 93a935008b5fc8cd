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
