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
# ``pytest_unconfigure``). A size limit turns on JAX's file lock, which the
# concurrent writers need. Set JAX_COMPILATION_CACHE_DIR to use a folder of
# your own instead (kept between runs).
_OWN_CACHE = None
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _OWN_CACHE = tempfile.mkdtemp(prefix='xfmr_jax_tests_xla_cache_')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _OWN_CACHE
  os.environ.setdefault('JAX_COMPILATION_CACHE_MAX_SIZE', str(16 << 30))

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


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
  """The 'small' toy_translate dataset (5k training pairs), built once."""
  from xfmr_jax import data
  d = tmp_path_factory.mktemp('tfds')
  data.build_toy_dataset(str(d), config='small')
  return d


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
def trained_workdir(data_dir, tmp_path_factory):
  """A toy model trained briefly (300 steps): it gets short sentences right.
  Shared by the translate, serving and service tests (read only: a test that
  changes a workdir copies it first)."""
  from tests.test_train import tiny_config
  from xfmr_jax import training_loop

  def train(wd):
    cfg = tiny_config(data_dir, num_train_steps=300, vocab_size=600,
                      lr_scale=0.5, warmup_steps=100, batch_size=32,
                      max_length=64, checkpoint_every=300, log_every=50,
                      test_samples=64)
    cfg.model.update(d_model=128, num_heads=4, num_encoder_layers=2,
                     num_decoder_layers=2, d_ff=256, max_len=128)
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


# Further cases of what the default run already checks, left to
# ``python -m pytest -m slow`` so the default run stays short (each entry is
# a test id, or a test function's name for all its cases). The default run
# keeps one case of each end-to-end path: one variant per model kind, one
# interruption, one resume, one notebook.
SLOW = {
    'tests/test_variants.py': [
        'test_variant_trains_and_decodes_with_the_cache[encoder_decoder-alibi-bundle3]',
        'test_variant_trains_and_decodes_with_the_cache[encoder_decoder-rope-bundle2]',
        'test_variant_trains_and_decodes_with_the_cache[encoder_decoder-learned-bundle1]',
        'test_variant_trains_and_decodes_with_the_cache[decoder_only-sinusoidal-bundle1]',
        'test_variant_trains_and_decodes_with_the_cache[decoder_only-alibi-bundle0]',
        'test_decoder_only_learns_toy_translation',
        'test_decoder_only_packed_row_equals_separate_rows',
        'test_encoder_only_learns_the_tagging_task',
        'test_models_agree_across_attention_implementations[decoder_only]',
    ],
    'tests/test_interruptions.py': [
        'test_sigterm_anywhere_then_resume_equals_uninterrupted[eval]',
        'test_sigterm_anywhere_then_resume_equals_uninterrupted[final_eval]',
        'test_sigterm_anywhere_then_resume_equals_uninterrupted[final_save]',
        'test_damaged_newest_checkpoint_is_moved_aside_and_the_run_finishes[metadata]',
        'test_damaged_newest_checkpoint_is_moved_aside_and_the_run_finishes[zero_filled]',
        'test_best_checkpoint_and_its_score_survive_a_restart',
    ],
    'tests/test_resume.py': [
        'test_sigkill_during_a_save_or_an_evaluation_then_resume',
    ],
    'tests/test_benchmark.py': [
        'test_gpu_check_falls_back_on_cpu',
        'test_model_variants_are_the_main_model_with_their_changes',
    ],
    'tests/test_notebooks.py': [
        'test_notebook_runs[sharding.ipynb]',
        'test_notebook_runs[anatomy.ipynb]',
    ],
    'tests/test_model.py': [
        'test_scanned_and_remat_stacks_match_unrolled[changes1]',
        'test_scanned_and_remat_stacks_match_unrolled[changes2]',
    ],
    'tests/test_bad_inputs.py': [
        'test_unwritable_checkpoint_folder_keeps_the_last_checkpoint',
        'test_resuming_with_another_model_names_the_fields',
    ],
    'tests/test_length_generalization.py': [
        'test_study_trains_scores_both_splits_and_resumes',
    ],
    'tests/test_long_attention.py': [
        'test_padding_changes_nothing[linear_elu]',
        'test_packed_segments_do_not_leak[local]',
        'test_favor_error_falls_as_features_grow',
        'test_cached_decoding_equals_the_full_model[linear_favor_rope_gqa_peri-decoder_only]',
        'test_cached_decoding_equals_the_full_model[local_global_alibi_gqa-decoder_only]',
    ],
    'tests/test_decode.py': [
        'test_beam_hypotheses_read_their_own_history[post-changes2]',
    ],
    'tests/test_train.py': ['test_resume_continues_from_checkpoint'],
    'tests/test_service.py': [
        'test_sigterm_finishes_requests_in_flight_and_exits_0',
    ],
    'tests/test_serving.py': ['test_warm_up_compiles_every_batch_size_once'],
    'tests/test_losses.py': [
        'test_return_hidden_projects_to_the_logits[changes0]',
    ],
    'tests/test_fused_kernels.py': [
        'test_a_model_on_the_pallas_kernel_equals_the_reference',
    ],
    'tests/test_params_average.py': ['test_workdir_translates_with_the_average'],
    'tests/test_sharding.py': [
        'test_sharding[test_layout_trains_like_one_device[fsdp_tp]]',
        'test_sharding[test_layout_trains_like_one_device[dp_fsdp]]',
        'test_sharding[test_variant_trains_and_decodes_like_one_device[local_global_alibi_gqa]]',
        'test_sharding[test_variant_trains_and_decodes_like_one_device[decoder_only_linear_favor_rope_peri]]',
    ],
}


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
  """Marks the ``SLOW`` cases slow (before ``-m`` deselects them)."""
  for item in items:
    path = item.nodeid.split('::')[0]
    names = SLOW.get(path, ())
    if item.name in names or item.originalname in names:
      item.add_marker(pytest.mark.slow)
