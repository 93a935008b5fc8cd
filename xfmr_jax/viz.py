"""Plotting helpers shared by the notebooks and the command-line scripts.

Each function draws on a matplotlib ``Axes`` (created if not given) and returns
it, so a notebook can compose figures and a script can save them.
"""
from __future__ import annotations

import matplotlib

matplotlib.use('Agg', force=False)  # headless unless a notebook chose a backend
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _axes(ax):
  return ax if ax is not None else plt.figure(figsize=(7, 4)).add_subplot()


def positional_heatmap(pe: np.ndarray, ax=None):
  """Heatmap of a ``[length, d_model]`` positional-encoding table."""
  ax = _axes(ax)
  image = ax.imshow(np.asarray(pe), aspect='auto', cmap='RdBu', vmin=-1, vmax=1)
  ax.figure.colorbar(image, ax=ax)
  ax.set(xlabel='dimension', ylabel='position',
         title='Sinusoidal positional encoding')
  return ax


def position_similarity(pe: np.ndarray, reference_positions=(0, 25, 50),
                        ax=None):
  """``PE(p) . PE(q)`` against q for a few reference positions p."""
  ax = _axes(ax)
  pe = np.asarray(pe, np.float64)
  for p in reference_positions:
    ax.plot(pe @ pe[p], label=f'p = {p}')
    ax.axvline(p, color='grey', lw=0.5, ls=':')
  ax.set(xlabel='position q', ylabel='PE(p) . PE(q)',
         title='Dot product peaks at q = p and depends on |p - q|')
  ax.legend()
  return ax


def save(ax, path: str) -> str:
  """Write the figure holding ``ax`` to ``path`` and close it."""
  ax.figure.tight_layout()
  ax.figure.savefig(path, dpi=110)
  plt.close(ax.figure)
  return path
