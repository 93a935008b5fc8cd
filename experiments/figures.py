"""Write the notebooks' pictures as PNG files from the command line.

    python -m experiments.figures --out_dir=figures [--workdir=workdir/toy]

Always writes (no training needed): ``architecture.png`` (figure 1 with the
library's function names), ``attention_scaling.png`` (the sqrt(d_k) argument),
``masks.png``, ``positional_encoding_heatmap.png``,
``positional_encoding_dot_product.png``, ``permutation_equivariance.png`` and
``attention_complexity.png`` (time and memory against sequence length,
measured on this machine). With ``--workdir`` of a trained run it also writes
``training_curve.png``, ``cross_attention.png`` (decoder cross-attention of one
toy sentence over the reference word alignment) and ``encoder_self_attention.png``.
``--only=name,name`` limits the set (names without ``.png``).
"""
from __future__ import annotations

import os

from absl import app, flags
import numpy as np

from xfmr_jax import viz

_OUT_DIR = flags.DEFINE_string('out_dir', 'figures', 'Where to write the PNGs.')
_WORKDIR = flags.DEFINE_string('workdir', None,
                               'A training workdir for the trained-model figures.')
_ONLY = flags.DEFINE_list('only', None, 'Write only these figures.')
_SENTENCE = flags.DEFINE_string(
    'sentence', None, 'Toy source sentence for the attention figures '
    f'(default: {viz.EXAMPLE_SENTENCE!r}).')


def untrained_figures(out_dir: str, only=None) -> list[str]:
  """Figures computed from the library's functions alone."""
  from xfmr_jax import positional
  want = lambda name: only is None or name in only
  paths = []
  path = lambda name: os.path.join(out_dir, name + '.png')
  if want('architecture'):
    paths.append(viz.save(viz.architecture_diagram(), path('architecture')))
  if want('attention_scaling'):
    axes, _ = viz.score_histograms()
    paths.append(viz.save(axes, path('attention_scaling')))
  if want('masks'):
    paths.append(viz.save(viz.mask_gallery(), path('masks')))
  pe = np.asarray(positional.sinusoidal_encoding(np.arange(100), 128))
  if want('positional_encoding_heatmap'):
    paths.append(viz.save(viz.positional_heatmap(pe),
                          path('positional_encoding_heatmap')))
  if want('positional_encoding_dot_product'):
    paths.append(viz.save(viz.position_similarity(pe, (0, 25, 50)),
                          path('positional_encoding_dot_product')))
  if want('permutation_equivariance'):
    paths.append(viz.save(viz.equivariance_plot(viz.permutation_errors()),
                          path('permutation_equivariance')))
  if want('attention_complexity'):
    paths.append(viz.save(viz.complexity_plot(viz.attention_cost()),
                          path('attention_complexity')))
  return paths


def trained_figures(out_dir: str, workdir: str, sentence: str | None = None,
                    only=None) -> list[str]:
  """Figures of a trained model in ``workdir``."""
  from xfmr_jax.workdir import Workdir
  want = lambda name: only is None or name in only
  path = lambda name: os.path.join(out_dir, name + '.png')
  paths = []
  if want('training_curve'):
    paths.append(viz.save(viz.training_curve(viz.read_metrics(workdir)),
                          path('training_curve')))
  if not (want('cross_attention') or want('encoder_self_attention')):
    return paths
  trained = Workdir(workdir).load()
  ex = viz.translation_attention(trained.model, trained.params,
                                 trained.tokenizer,
                                 sentence or viz.EXAMPLE_SENTENCE)
  cross = ex['maps']['decoder_cross'][:, 0]           # [layers, heads, t, s]
  if want('cross_attention'):
    import matplotlib.pyplot as plt
    layers = cross.shape[0]
    _, axes = plt.subplots(1, layers, figsize=(6 * layers, 5), squeeze=False)
    for layer, ax in enumerate(axes[0]):
      viz.attention_map(cross[layer].mean(0), ex['output_pieces'],
                        ex['source_pieces'], ax=ax, alignment=ex['alignment'],
                        title=f'decoder layer {layer}: cross-attention '
                        '(mean of heads)')
    paths.append(viz.save(axes, path('cross_attention')))
  if want('encoder_self_attention'):
    enc = ex['maps']['encoder_self'][-1, 0]             # [heads, s, s]
    paths.append(viz.save(viz.attention_heads(
        enc, ex['source_pieces'], ex['source_pieces'],
        title='encoder self-attention, last layer'),
        path('encoder_self_attention')))
  return paths


def main(argv):
  del argv
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  only = set(_ONLY.value) if _ONLY.value else None
  paths = untrained_figures(_OUT_DIR.value, only)
  if _WORKDIR.value:
    paths += trained_figures(_OUT_DIR.value, _WORKDIR.value, _SENTENCE.value,
                             only)
  for p in paths:
    print(f'wrote {p}')


if __name__ == '__main__':
  app.run(main)
