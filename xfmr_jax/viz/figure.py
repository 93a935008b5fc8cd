"""Figure plumbing shared by the plots: a headless backend for scripts, a
fresh ``Axes`` when none is given, and :func:`save`."""
from __future__ import annotations

import os
import sys

from xfmr_jax.extras import require

matplotlib = require('matplotlib', 'xfmr_jax.viz (the figures)')
if 'ipykernel' not in sys.modules and 'MPLBACKEND' not in os.environ:
  matplotlib.use('Agg', force=False)  # headless scripts; notebooks keep inline
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def axes_or_new(ax, figsize=(7, 4)):
  return ax if ax is not None else plt.figure(figsize=figsize).add_subplot()


def figure_of(obj):
  if isinstance(obj, np.ndarray):
    obj = obj.flat[0]
  return obj if isinstance(obj, matplotlib.figure.Figure) else obj.figure


def save(ax, path: str) -> str:
  """Write the figure holding ``ax`` (an Axes, array of Axes or Figure) to
  ``path`` and close it."""
  fig = figure_of(ax)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
