"""Draw the sinusoidal positional encoding and its dot-product curve.

    python -m experiments.positional_encoding --out_dir=figures

writes ``positional_encoding_heatmap.png`` (the table, position x dimension) and
``positional_encoding_dot_product.png`` (PE(p) . PE(q) against q, which peaks at
q = p and falls off with the distance: relative position is readable from a dot
product).
"""
from __future__ import annotations

import os

from absl import app, flags
import numpy as np

from xfmr_jax import positional, viz

_OUT_DIR = flags.DEFINE_string('out_dir', 'figures', 'Where to write the PNGs.')
_LENGTH = flags.DEFINE_integer('length', 100, 'Number of positions.')
_D_MODEL = flags.DEFINE_integer('d_model', 128, 'Encoding width (even).')


def write_figures(out_dir: str, length: int = 100, d_model: int = 128):
  """Write both figures into ``out_dir`` and return their paths."""
  os.makedirs(out_dir, exist_ok=True)
  pe = np.asarray(positional.sinusoidal_encoding(np.arange(length), d_model))
  heatmap = viz.save(viz.positional_heatmap(pe), os.path.join(
      out_dir, 'positional_encoding_heatmap.png'))
  refs = (0, length // 4, length // 2)
  curve = viz.save(viz.position_similarity(pe, refs), os.path.join(
      out_dir, 'positional_encoding_dot_product.png'))
  return heatmap, curve


def main(argv):
  del argv
  for path in write_figures(_OUT_DIR.value, _LENGTH.value, _D_MODEL.value):
    print(f'wrote {path}')


if __name__ == '__main__':
  app.run(main)
