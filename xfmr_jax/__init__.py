"""xfmr_jax: the encoder-decoder Transformer of "Attention Is All You Need".

The names below are imported on first use, so that importing a submodule that
needs no model code (``xfmr_jax.serving``, which runs an exported translator
with jax, numpy and sentencepiece alone) does not load flax.
"""
import importlib

__all__ = ['ModelConfig', 'Transformer', 'build']
__version__ = '0.1.0'

_LAZY = {'ModelConfig': 'xfmr_jax.config', 'Transformer': 'xfmr_jax.model',
         'build': 'xfmr_jax.model'}


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
  return sorted(list(globals()) + __all__)
