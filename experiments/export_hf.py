"""Export a workdir's model to a Hugging Face Marian directory.

    python -m experiments.export_hf --workdir=workdir/toy_marian --out=toy-marian-hf

``OUT`` holds what a downloaded opus-mt model holds (``config.json``,
``generation_config.json``, ``model.safetensors``, ``source.spm``,
``target.spm``, ``vocab.json``): ``transformers.MarianMTModel`` and
``MarianTokenizer`` load it with ``from_pretrained(OUT)``, and
``ct2-transformers-converter --model OUT --output_dir OUT-ct2`` converts it
for CTranslate2. A model Marian cannot represent (RoPE, Pre-LN, GQA, ...) is a
one-line error naming the field; ``experiments/configs/toy_marian.py`` trains
a toy model that exports. See docs/serving.md.
"""
from __future__ import annotations

from absl import flags

from experiments import entry

_WORKDIR = flags.DEFINE_string('workdir', None, 'Training workdir to export.',
                               required=True)
_OUT = flags.DEFINE_string('out', None, 'Folder to create (must not exist or '
                           'be empty).', required=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the '
                             'newest).')


def main(argv):
  if len(argv) > 1:
    entry.fail(f'unexpected arguments: {argv[1:]}')
  entry.quiet_libraries()
  from xfmr_jax import marian_export
  info = marian_export.write_hf_dir(_WORKDIR.value, _OUT.value, _STEP.value)
  print(f'exported {info["parameters"] / 1e6:.2f}M parameters (vocab '
        f'{info["vocab_size"]}) to {_OUT.value}')
  if info['pad_row_norm'] > 0:
    print(f'note: the PAD embedding row is not zero (norm '
          f'{info["pad_row_norm"]:.3g}): transformers decodes exactly as this '
          'library does, CTranslate2 (which starts from a zero vector) '
          'may not; train with model.pad_embedding=zero for both')


if __name__ == '__main__':
  entry.run(main)
