"""Shared fixtures. Tests run on the CPU backend with float32 arithmetic."""
import os
import shutil
import tempfile

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# One persistent XLA compilation cache for the whole run: many tests compile
# the same programs (the tiny trainer in each subprocess run, the same model
# in several files), and XLA's compile is most of the suite's time. pytest-xdist
# workers and the tests' subprocesses inherit the folder through the
# environment; the process that made it removes it at the end (see
# ``pytest_unconfigure``). No size limit: with one, JAX locks the folder and
# reads every entry's access time on each write, which grows with the run.
# Without the lock two writers of one key write the same bytes, and a reader
# that catches an entry half written gets JAX's warning and compiles. Set
# JAX_COMPILATION_CACHE_DIR to use a folder of your own instead (kept between
# runs).
_OWN_CACHE = None
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _OWN_CACHE = tempfile.mkdtemp(prefix='xfmr_jax_tests_xla_cache_')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _OWN_CACHE

import filelock  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
  return np.random.default_rng(0)


@pytest.fixture
def key():
  return jax.random.key(0)


def built_once(tmp_path_factory, name, build):
  """The folder ``name``, filled by ``build(folder)`` once per test run.

  pytest-xdist runs the files in several processes, each with its own session
  fixtures, so a session fixture alone would train the shared model once in
  every process that needs it. The processes share the parent of their
  temporary folders: the first to get the lock builds there, the others wait
  for it and reuse the folder. A build that raises leaves no folder behind,
  and the next process to ask tries again (and reports its own error).
  """
  root = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    root = root.parent
  folder, done = root / name, root / f'{name}.done'
  with filelock.FileLock(root / f'{name}.lock'):
    if not done.exists():
      shutil.rmtree(folder, ignore_errors=True)
      folder.mkdir()
      try:
        build(folder)
      except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
      done.touch()
  return folder


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
  """The 'small' toy_translate dataset (5k training pairs), built once per
  run (read only)."""
  from xfmr_jax import data
  return built_once(tmp_path_factory, 'tfds',
                    lambda d: data.build_toy_dataset(str(d), config='small'))


# The tiny config's changes for ``trained_workdir``: d_model 64 learns the
# task in 380 steps about as well as d_model 128 did in 300, in under half the
# time.
TRAINED = dict(num_train_steps=380, vocab_size=600, lr_scale=0.5,
               warmup_steps=100, batch_size=32, max_length=64,
               checkpoint_every=380, log_every=50, test_samples=16)
TRAINED_MODEL = dict(d_model=64, num_heads=4, num_encoder_layers=2,
                     num_decoder_layers=2, d_ff=128, max_len=128)


@pytest.fixture(scope='session')
def trained_workdir(data_dir, tmp_path_factory):
  """A toy model trained briefly (380 steps at d_model 64): it gets short
  sentences right (the 12 shortest test sentences, 9 of the first 20).
  Shared by the translate, serving and service tests (read only: a test that
  changes a workdir copies it first)."""
  from tests.test_train import tiny_config
  from xfmr_jax import training_loop

  def train(wd):
    cfg = tiny_config(data_dir, **TRAINED)
    cfg.model.update(TRAINED_MODEL)
    training_loop.train_and_evaluate(cfg, str(wd))
  return built_once(tmp_path_factory, 'trained', train)


@pytest.fixture(scope='session')
def exported_artifact(trained_workdir, tmp_path_factory):
  """``trained_workdir`` exported with beam sizes 4 and 1, batch size 8."""
  from xfmr_jax import export

  def export_it(folder):
    export.export_workdir(str(trained_workdir), str(folder / 'artifact'),
                          beam_sizes=(4, 1), batch_size=8,
                          progress=lambda line: None)
  return built_once(tmp_path_factory, 'export', export_it) / 'artifact'


# The files that take longest, in that order: they start first, so that no
# process is left running one of them alone at the end while the others wait.
# (pytest-xdist hands out whole files in collection order; the rest keep
# theirs.)
LONGEST_FIRST = ('test_sharding.py', 'test_decode.py', 'test_variants.py',
                 'test_bad_inputs.py', 'test_marian.py', 'test_marian_export.py',
                 'test_benchmark.py', 'test_model.py', 'test_train.py', 'test_serving.py',
                 'test_long_attention.py', 'test_service.py',
                 'test_service_options.py')


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
