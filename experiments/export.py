"""Export a trained translator for serving without the model code.

    python -m experiments.export --workdir=DIR --out=ARTIFACT
    python -m experiments.export --workdir=DIR --out=ARTIFACT \\
        --beam_sizes=1,4 --platforms=cpu,cuda,tpu

Writes one ``jax.export`` module per beam size and source bucket, the
parameters, the tokenizer and a manifest (see ``xfmr_jax/export.py``); load it
with ``xfmr_jax.serving.load(ARTIFACT)`` or serve it with
``python -m experiments.serve --artifact=ARTIFACT``.
"""
from __future__ import annotations

import os
import time

from absl import flags

from experiments import entry

_WORKDIR = flags.DEFINE_string('workdir', None, 'Training workdir to export.',
                               required=True)
_OUT = flags.DEFINE_string('out', None, 'Folder to write the artifact to.',
                           required=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step; default newest.')
_BEAMS = flags.DEFINE_list('beam_sizes', ['4', '1'],
                           'Decoders to export (1 = greedy); the first is the '
                           'default of the loaded translator.')
_ALPHA = flags.DEFINE_float('alpha', None, 'Beam search length penalty; '
                            "default: the workdir config's beam_alpha.")
_EXTRA = flags.DEFINE_integer('max_decode_extra', 50,
                              'Decode up to input length + this many tokens.')
_BATCH = flags.DEFINE_integer('batch_size', 64,
                              'Most sentences per decoder call.')
_PLATFORMS = flags.DEFINE_list('platforms', None,
                               'Lowering targets among cpu, cuda, rocm, tpu '
                               '(default: cpu plus this machine\'s backend).')


def main(argv):
  if len(argv) > 1:
    entry.fail(f'unexpected arguments: {argv[1:]}')
  if not os.path.isdir(_WORKDIR.value):
    entry.fail(f'--workdir {_WORKDIR.value!r} is not a directory')
  try:
    beams = [int(b) for b in _BEAMS.value]
  except ValueError:
    entry.fail(f'--beam_sizes must be integers, got {_BEAMS.value}')
  entry.quiet_libraries()
  from xfmr_jax import export
  start = time.time()
  try:
    chosen = {} if _ALPHA.value is None else {'alpha': _ALPHA.value}
    manifest = export.export_workdir(
        _WORKDIR.value, _OUT.value, _STEP.value, beam_sizes=beams, **chosen,
        max_decode_extra=_EXTRA.value, batch_size=_BATCH.value,
        platforms=_PLATFORMS.value)
  except ValueError as e:
    entry.fail(str(e))
  print(f'wrote {_OUT.value}: {len(manifest["modules"])} modules for '
        f'{",".join(manifest["platforms"])}, beam sizes '
        f'{manifest["beam_sizes"]}, buckets {manifest["buckets"]} '
        f'({time.time() - start:.1f} s)')


if __name__ == '__main__':
  entry.run(main)
