"""The Colab notebooks: committed without outputs, and they run top to bottom;
the command line writes the same pictures.

Each notebook is executed headless with nbclient in its reduced mode
(``XFMR_QUICK=1``: a tiny model, few steps, short sequences) on this
interpreter's kernel, on the CPU with 8 simulated devices (so the sharding
notebook has a mesh to build). A cell error fails the test; so does a notebook
that draws fewer pictures than it should.
"""
import json
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip('nbformat')
nbclient = pytest.importorskip('nbclient')

COLAB = pathlib.Path(__file__).resolve().parents[1] / 'colab'
NOTEBOOKS = sorted(COLAB.glob('*.ipynb'))
# notebook -> the fewest image/png outputs its quick run must produce.
MIN_FIGURES = {'quickstart.ipynb': 4, 'anatomy.ipynb': 6, 'sharding.ipynb': 1}


def test_every_notebook_is_listed():
  assert sorted(p.name for p in NOTEBOOKS) == sorted(MIN_FIGURES)


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
  nb = json.loads(path.read_text())
  nbformat.validate(nbformat.reads(path.read_text(), as_version=4))
  for cell in nb['cells']:
    if cell['cell_type'] == 'code':
      assert cell['outputs'] == [] and cell['execution_count'] is None, (
          f'{path.name}: strip the outputs before committing')
  assert '"output_type"' not in path.read_text()


@pytest.fixture(scope='module')
def kernel_name():
  from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
  try:
    spec = KernelSpecManager().get_kernel_spec('python3')
  except NoSuchKernel:
    pytest.skip('no python3 kernel: pip install ipykernel')
  # jupyter_client runs a spec whose argv[0] is 'python' with sys.executable;
  # the notebook's first cell prints the interpreter, checked below.
  assert spec.argv[0] in ('python', 'python3', sys.executable), spec.argv
  return 'python3'


def _images(nb) -> int:
  return sum('image/png' in out.get('data', {})
             for cell in nb.cells if cell.cell_type == 'code'
             for out in cell.outputs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize('path', [
    p if p.name == 'quickstart.ipynb' else pytest.param(
        p, marks=pytest.mark.slow) for p in NOTEBOOKS], ids=lambda p: p.name)
def test_notebook_runs(path, kernel_name, monkeypatch, tmp_path):
  # The kernel inherits this environment.
  monkeypatch.setenv('XFMR_QUICK', '1')
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  monkeypatch.setenv('MPLBACKEND', 'module://matplotlib_inline.backend_inline')
  monkeypatch.setenv('TFDS_DATA_DIR', str(tmp_path / 'tfds'))
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
      nb, kernel_name=kernel_name, timeout=240,
      resources={'metadata': {'path': str(COLAB)}})
  client.execute()  # raises CellExecutionError on the first failing cell
  setup = next(c for c in nb.cells if c.cell_type == 'code')
  first = ''.join(o.get('text', '') for o in setup.outputs)
  assert f'python      {sys.executable}' in first, first
  assert 'quick mode  True' in first, first
  images = _images(nb)
  assert images >= MIN_FIGURES[path.name], (
      f'{path.name} drew {images} figures, expected >= {MIN_FIGURES[path.name]}')


def test_figures_script_writes_pngs(tmp_path):
  """The notebooks' pictures also come from the command line."""
  import subprocess
  import matplotlib.image as mpimg
  import numpy as np
  names = ('architecture', 'masks', 'attention_scaling')
  result = subprocess.run(
      [sys.executable, '-m', 'experiments.figures', f'--out_dir={tmp_path}',
       f'--only={",".join(names)}'],
      capture_output=True, text=True, timeout=180, cwd=COLAB.parent)
  assert result.returncode == 0, result.stderr
  for name in names:
    image = mpimg.imread(tmp_path / f'{name}.png')
    assert image.shape[0] > 200 and image.shape[1] > 200
    assert np.std(image[..., :3]) > 0.01  # not a blank canvas
    assert f'{name}.png' in result.stdout
