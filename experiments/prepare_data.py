"""Download and build WMT as array_record, without TensorFlow:

    python -m experiments.prepare_data --dataset=wmt14_translate/de-en \\
        --data_dir=DATA_DIR

then train with ``--config.data_dir=DATA_DIR`` (copy DATA_DIR anywhere; reading
needs neither internet nor TensorFlow). Also ``wmt17_translate/de-en`` and
``wmt_t2t_translate/de-en``. Interrupted, it resumes where it stopped: run it
again. Archives downloaded by hand go in ``--manual_dir`` (default
DATA_DIR/downloads/manual). See docs/data.md.
"""
from __future__ import annotations

import logging

from absl import app, flags
from absl import logging as absl_logging

from experiments import entry

_DATASET = flags.DEFINE_string('dataset', 'wmt14_translate/de-en',
                               'TFDS name of the WMT dataset to build.')
_DATA_DIR = flags.DEFINE_string('data_dir', None,
                                'TFDS data_dir to build into (required).')
_MANUAL_DIR = flags.DEFINE_string(
    'manual_dir', None, 'Archives already downloaded, under the file names '
    'TFDS registers (default DATA_DIR/downloads/manual).')
_DOWNLOAD_DIR = flags.DEFINE_string(
    'download_dir', None, 'Where archives are downloaded and extracted '
    '(default DATA_DIR/downloads).')

# TFDS's own INFO lines that say what each step does with each file; the rest
# of its INFO output is left out.
_TFDS_PROGRESS = ('Downloading ', 'Skipping download', 'Reusing extraction',
                  'Generating examples from', 'Done writing')


class _ProgressOnly(logging.Filter):
  def filter(self, record):
    return (record.levelno >= logging.WARNING
            or record.getMessage().startswith(_TFDS_PROGRESS))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not _DATA_DIR.value:
    entry.fail('--data_dir is required: the TFDS data_dir to build into')
  logging.getLogger('xfmr_jax').setLevel(logging.INFO)
  logging.getLogger('xfmr_jax').addHandler(logging.StreamHandler())
  logging.getLogger('xfmr_jax').propagate = False
  if not entry.verbose():
    absl_logging.set_verbosity(absl_logging.INFO)
    absl_logging.get_absl_handler().addFilter(_ProgressOnly())
  from xfmr_jax.data import wmt_prepare  # after flag parsing: fast --help
  counts = wmt_prepare.prepare(_DATASET.value, _DATA_DIR.value,
                               manual_dir=_MANUAL_DIR.value,
                               download_dir=_DOWNLOAD_DIR.value)
  print(f'{_DATASET.value} ready in {_DATA_DIR.value}: '
        + ', '.join(f'{split} {n} pairs' for split, n in counts.items()))


if __name__ == '__main__':
  entry.run(main)
