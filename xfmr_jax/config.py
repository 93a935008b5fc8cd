"""Model configuration: one frozen dataclass and the paper's presets."""
from __future__ import annotations

import dataclasses

NORM_POSITIONS = ('post', 'pre')
NORM_TYPES = ('layernorm', 'rmsnorm')
ACTIVATIONS = ('relu', 'gelu')
POSITIONALS = ('sinusoidal', 'learned', 'none')
DTYPES = ('float32', 'bfloat16')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyperparameters of the encoder-decoder Transformer.

  Defaults are the paper's base model (Table 3, row "base") with a shared
  37,000-token vocabulary.
  """
  vocab_size: int = 37_000
  d_model: int = 512
  num_heads: int = 8
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  d_ff: int = 2048
  dropout_rate: float = 0.1            # P_drop: sublayer outputs, embeddings
  attention_dropout_rate: float = 0.0  # on attention weights (paper: none)
  max_len: int = 512                   # longest position the model embeds
  positional: str = 'sinusoidal'
  norm_position: str = 'post'          # 'post' (paper) or 'pre'
  norm_type: str = 'layernorm'
  activation: str = 'relu'
  share_embeddings: bool = True        # source, target and output projection
  layer_norm_epsilon: float = 1e-6
  dtype: str = 'float32'               # compute dtype; parameters stay float32
  scan_layers: bool = False            # nn.scan over the layer stack
  remat: bool = False                  # recompute layer activations in backprop

  def __post_init__(self):
    positive = ('vocab_size', 'd_model', 'num_heads', 'num_encoder_layers',
                'num_decoder_layers', 'd_ff', 'max_len')
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f'ModelConfig.{name} must be a positive integer, '
                         f'got {value!r}')
    if self.d_model % self.num_heads:
      raise ValueError(f'ModelConfig.d_model={self.d_model} is not divisible by '
                       f'num_heads={self.num_heads}')
    for name in ('dropout_rate', 'attention_dropout_rate'):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f'ModelConfig.{name} must be in [0, 1), got '
                         f'{getattr(self, name)!r}')
    choices = {'positional': POSITIONALS, 'norm_position': NORM_POSITIONS,
               'norm_type': NORM_TYPES, 'activation': ACTIVATIONS,
               'dtype': DTYPES}
    for name, allowed in choices.items():
      if getattr(self, name) not in allowed:
        raise ValueError(f'ModelConfig.{name}={getattr(self, name)!r} is not '
                         f'one of {allowed}')
    if self.positional == 'sinusoidal' and self.d_model % 2:
      raise ValueError('sinusoidal positions need an even d_model')

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  def replace(self, **changes) -> 'ModelConfig':
    return dataclasses.replace(self, **changes)


def base(**changes) -> ModelConfig:
  """The paper's base model: d_model 512, 8 heads, 6+6 layers, d_ff 2048."""
  return ModelConfig(**changes)


def big(**changes) -> ModelConfig:
  """The paper's big model: d_model 1024, 16 heads, d_ff 4096, dropout 0.3."""
  return ModelConfig(**{**dict(d_model=1024, num_heads=16, d_ff=4096,
                               dropout_rate=0.3), **changes})


def toy(**changes) -> ModelConfig:
  """A small model that learns the toy translation task on a CPU in minutes."""
  return ModelConfig(**{**dict(vocab_size=1024, d_model=128, num_heads=4,
                               num_encoder_layers=2, num_decoder_layers=2,
                               d_ff=512, max_len=256), **changes})


PRESETS = {'base': base, 'big': big, 'toy': toy}
