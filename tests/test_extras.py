"""The core install trains and translates without the optional extras, and a
missing extra is one clear error naming the install."""
import subprocess
import sys
import textwrap

import pytest

from xfmr_jax import extras


def _run_without(blocked, code):
  """Run ``code`` in a fresh interpreter where the modules ``blocked`` cannot
  be imported (as if they were not installed)."""
  prelude = textwrap.dedent(f"""
      import sys
      class _Absent:
        def find_spec(self, name, path=None, target=None):
          if name.partition('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)
      sys.meta_path.insert(0, _Absent())
  """)
  return subprocess.run([sys.executable, '-c', prelude + textwrap.dedent(code)],
                        capture_output=True, text=True, timeout=300)


def test_training_and_translation_import_without_the_extras():
  out = _run_without(('matplotlib', 'starlette', 'uvicorn'), """
      import experiments.train_wmt  # its flags; the others define theirs too
      from xfmr_jax import training_loop, translate, export, serving, data
      print('ok')
  """)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == 'ok'


@pytest.mark.parametrize('module, missing, extra', [
    ('xfmr_jax.viz', 'matplotlib', 'viz'),
    ('xfmr_jax.service', 'starlette', 'serve'),
])
def test_a_missing_extra_names_the_install(module, missing, extra):
  out = _run_without((missing,), f"""
      try:
        import {module}
      except ImportError as e:
        print(type(e).__name__, e)
  """)
  assert out.returncode == 0, out.stderr
  line = out.stdout.strip()
  assert line.startswith('MissingExtra '), line
  assert f'needs {missing}' in line and f'xfmr_jax[{extra}]' in line
  assert '\n' not in line


def test_require_reraises_a_broken_dependency_of_an_installed_module(
    tmp_path, monkeypatch):
  """An extra that is installed but fails inside is not reported as missing."""
  monkeypatch.syspath_prepend(str(tmp_path))
  (tmp_path / 'brokenmod.py').write_text('import not_a_real_module_xyz\n')
  monkeypatch.setitem(extras.EXTRA_OF, 'brokenmod', 'serve')
  with pytest.raises(ModuleNotFoundError, match='not_a_real_module_xyz'):
    extras.require('brokenmod', 'a test')
  with pytest.raises(extras.MissingExtra, match=r'xfmr_jax\[serve\]'):
    monkeypatch.setitem(extras.EXTRA_OF, 'absent_mod_xyz', 'serve')
    extras.require('absent_mod_xyz', 'a test')
