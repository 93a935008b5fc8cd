"""The positional-encoding figures script writes real PNG images."""
import pathlib
import subprocess
import sys

import matplotlib.image as mpimg
import numpy as np


def test_positional_encoding_script_writes_pngs(tmp_path):
  result = subprocess.run(
      [sys.executable, '-m', 'experiments.positional_encoding',
       f'--out_dir={tmp_path}', '--length=40', '--d_model=32'],
      capture_output=True, text=True, timeout=120,
      cwd=pathlib.Path(__file__).resolve().parents[1])
  assert result.returncode == 0, result.stderr
  for name in ('positional_encoding_heatmap.png',
               'positional_encoding_dot_product.png'):
    image = mpimg.imread(tmp_path / name)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert np.std(image[..., :3]) > 0.01  # not a blank canvas
    assert name in result.stdout
