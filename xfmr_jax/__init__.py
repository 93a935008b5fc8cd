"""xfmr_jax: the encoder-decoder Transformer of "Attention Is All You Need"."""
from xfmr_jax.config import ModelConfig
from xfmr_jax.model import Transformer, build

__all__ = ['ModelConfig', 'Transformer', 'build']
__version__ = '0.1.0'
