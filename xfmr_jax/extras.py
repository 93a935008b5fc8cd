"""Optional dependencies, installed with the package's extras.

The core install trains, evaluates and translates. Serving over HTTP needs
the ``serve`` extra (starlette, uvicorn, prometheus_client) and the plots need ``viz``
(matplotlib); the modules that use them import them through
:func:`require`, so a missing extra is one line that names the install.
"""
from __future__ import annotations

import importlib
import types

# Which extra brings each optional top-level module.
EXTRA_OF = {'starlette': 'serve', 'uvicorn': 'serve',
            'prometheus_client': 'serve', 'matplotlib': 'viz'}


class MissingExtra(ImportError):
  """An optional dependency is not installed."""


def require(module: str, purpose: str) -> types.ModuleType:
  """``module`` imported, or a :class:`MissingExtra` saying which
  ``pip install`` brings it (``purpose`` says what needs it)."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    top = module.partition('.')[0]
    if e.name is not None and e.name.partition('.')[0] != top:
      raise  # the module is there but one of its own imports failed
    extra = EXTRA_OF[top]
    raise MissingExtra(
        f'{purpose} needs {top}, which is not installed: run '
        f'pip install "xfmr_jax[{extra}]" (in a checkout: '
        f'pip install -c constraints.txt -e ".[{extra}]")') from None
