"""Train a translation Transformer: ``python -m experiments.train_wmt``.

With no flags it trains the toy translation task on the CPU in minutes. Other
configs: ``--config=experiments/configs/wmt14_ende_base.py`` (or ``_big``);
override any field with ``--config.<field>=<value>``, e.g.
``--config.num_train_steps=500 --config.model.d_model=128``. Running again with
the same ``--workdir`` resumes from its newest valid checkpoint.

Sharding: ``--config.parallelism=fsdp`` (or dp, tp, fsdp_tp) or
``--config.mesh_shape='(2,4,1)'`` (data, fsdp, model). On several hosts run the
same command on each, adding ``--config.coordinator_address=HOST0:1234
--config.num_processes=N --config.process_id=I`` (automatic on TPU pods).
"""
from __future__ import annotations

import logging
import os

from xfmr_jax import host_memory

# Before anything imports jax: the train step's scratch buffer is then reused
# from call to call instead of being mapped afresh (see host_memory).
host_memory.reuse_freed_memory()

from absl import app, flags  # noqa: E402  (after the malloc settings)
from ml_collections import config_flags  # noqa: E402

from experiments import entry  # noqa: E402

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), 'configs', 'toy.py')
with entry.flag_errors():  # overrides in argv are applied here already
  _CONFIG = config_flags.DEFINE_config_file(
      'config', _DEFAULT_CONFIG, 'Training config file (ml_collections).',
      lock_config=True)
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Checkpoints, tokenizer and metrics go here; default '
    './workdir/<config name>.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  # Library chatter (orbax, TFDS) only from warnings up; our own progress at
  # INFO. --verbosity=0 (or -v 0) brings the libraries back.
  entry.quiet_libraries()
  logging.getLogger('xfmr_jax').setLevel(logging.INFO)
  logging.getLogger('xfmr_jax').addHandler(logging.StreamHandler())
  logging.getLogger('xfmr_jax').propagate = False
  # after flag parsing: fast --help
  from xfmr_jax import sharding, training_loop
  config = _CONFIG.value
  # Before anything touches a device: one process per host joins the others.
  sharding.initialize_distributed(config.coordinator_address,
                                  config.num_processes, config.process_id,
                                  config.distributed)
  config_path = flags.FLAGS['config'].config_filename
  name = os.path.splitext(os.path.basename(config_path))[0]
  workdir = _WORKDIR.value or os.path.join('workdir', name)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    entry.fail(f'--workdir {workdir!r} is a file, not a directory')
  metrics = training_loop.train_and_evaluate(config, workdir)
  if 'stopped_by' not in metrics:
    print(f"final metrics written to {os.path.join(workdir, 'final_metrics.json')}")


if __name__ == '__main__':
  entry.run(main)
