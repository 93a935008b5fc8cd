"""Model configuration: one frozen dataclass and the paper's presets."""
from __future__ import annotations

import dataclasses

from xfmr_jax import activations

NORM_POSITIONS = ('post', 'pre', 'peri')
NORM_TYPES = ('layernorm', 'rmsnorm')
ACTIVATIONS = activations.NAMES
POSITIONALS = ('sinusoidal', 'learned', 'rope', 'alibi', 'none')
SINUSOID_LAYOUTS = ('interleaved', 'halves')
LOGITS_BIASES = ('none', 'learned', 'fixed')
PAD_EMBEDDINGS = ('learned', 'zero')
DTYPES = ('float32', 'bfloat16')
MODEL_KINDS = ('encoder_decoder', 'decoder_only', 'encoder_only')
# The implementations of xfmr_jax.attention.dot_product_attention (its
# IMPLEMENTATIONS): named here, where the configuration checks them, so that
# the configuration needs no import of the attention math.
ATTENTION_IMPLEMENTATIONS = ('reference', 'xla', 'cudnn', 'pallas')
ATTENTION_IMPLS = ('auto',) + ATTENTION_IMPLEMENTATIONS
# Self-attention over long inputs (cross-attention is always full).
ATTENTION_KINDS = ('full', 'local', 'linear')
LINEAR_FEATURE_MAPS = ('elu', 'favor')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyperparameters of the encoder-decoder Transformer.

  Defaults are the paper's base model (Table 3, row "base") with a shared
  37,000-token vocabulary. The other values of the switches are the variants
  that later work made common:

  * ``norm_position`` 'pre' (Pre-LN) or 'peri' (Peri-LN: the sublayer's input
    and its output normalised) and ``norm_type`` 'rmsnorm';
  * ``activation`` 'gelu' (tanh approximation), 'gelu_exact', 'silu' (swish)
    or 'swiglu' (a gated FFN with three matrices: to keep
    the parameter count of a ReLU FFN of width ``w``, set ``d_ff`` to
    :func:`swiglu_d_ff` ``(w)``, about ``2w/3``);
  * ``positional`` 'learned', 'rope' (queries and keys rotated by position in
    every self-attention) or 'alibi' (a per-head linear distance penalty on
    self-attention scores); cross-attention has no positions, as in the paper;
  * ``sinusoid_layout`` 'halves': the sines of all frequencies first, then
    their cosines (Marian's layout) instead of the paper's interleaved pairs;
  * ``logits_bias`` 'learned' or 'fixed': a ``[vocab]`` bias added to the
    output logits, trained or held fixed (Marian's ``final_logits_bias``);
  * ``pad_embedding`` 'zero': the embedding row of PAD (the decoder's start
    symbol) is zero and stays zero, as in Marian models, whose C++ and
    CTranslate2 decoders start from a zero vector rather than that row;
  * ``num_kv_heads`` below ``num_heads``: grouped-query attention (1: MQA);
  * ``use_bias`` False: linear layers without biases;
  * ``model_kind`` 'decoder_only' (a causal LM over ``source EOS target``, see
    :mod:`xfmr_jax.decoder_only`) or 'encoder_only' (a token tagger with
    ``num_labels`` outputs, see :mod:`xfmr_jax.encoder_only`);
  * ``attention_impl``: see :func:`xfmr_jax.attention.resolve_implementation`;
  * ``attention_kind`` of self-attention: 'local' (each query sees the
    ``attention_window`` positions before it, and after it when
    bidirectional, plus ``attention_global_tokens`` global tokens; see
    :mod:`xfmr_jax.local_attention`) or 'linear' (kernelised attention with
    the ``linear_feature_map`` 'elu' or Performer's 'favor' random features,
    ``favor_features`` of them drawn from ``favor_seed``; see
    :mod:`xfmr_jax.linear_attention`).
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
  norm_position: str = 'post'          # 'post' (paper), 'pre' or 'peri'
  norm_type: str = 'layernorm'
  activation: str = 'relu'
  share_embeddings: bool = True        # source, target and output projection
  layer_norm_epsilon: float = 1e-6
  dtype: str = 'float32'               # compute dtype; parameters stay float32
  scan_layers: bool = False            # nn.scan over the layer stack
  remat: bool = False                  # recompute layer activations in backprop
  num_kv_heads: int = 0                # key/value heads; 0 = num_heads
  use_bias: bool = True                # biases in the linear layers
  model_kind: str = 'encoder_decoder'
  num_labels: int = 0                  # encoder_only: size of the token head
  attention_impl: str = 'auto'
  sinusoid_layout: str = 'interleaved'  # or 'halves' (sin first, then cos)
  logits_bias: str = 'none'             # or 'learned' / 'fixed' [vocab] bias
  pad_embedding: str = 'learned'        # or 'zero': PAD's row held at zero
  # Long inputs: self-attention kind (see the class docstring).
  attention_kind: str = 'full'
  attention_window: int = 0            # local: keys on each side of a query
  attention_global_tokens: int = 0     # local: the first slots of a row
  linear_feature_map: str = 'elu'
  favor_features: int = 0              # favor: random features; 0 = 4 * head_dim
  favor_seed: int = 0                  # favor: seed of the random projection

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
               'dtype': DTYPES, 'model_kind': MODEL_KINDS,
               'attention_impl': ATTENTION_IMPLS,
               'sinusoid_layout': SINUSOID_LAYOUTS,
               'logits_bias': LOGITS_BIASES,
               'pad_embedding': PAD_EMBEDDINGS}
    for name, allowed in choices.items():
      if getattr(self, name) not in allowed:
        raise ValueError(f'ModelConfig.{name}={getattr(self, name)!r} is not '
                         f'one of {allowed}')
    if self.positional == 'sinusoidal' and self.d_model % 2:
      raise ValueError('sinusoidal positions need an even d_model')
    if self.sinusoid_layout != 'interleaved' and self.positional != 'sinusoidal':
      raise ValueError(f'ModelConfig.sinusoid_layout={self.sinusoid_layout!r} '
                       "applies to positional='sinusoidal' only, got "
                       f'positional={self.positional!r}')
    if self.positional == 'rope' and self.head_dim % 2:
      raise ValueError(f'rope rotates pairs of dimensions: head_dim '
                       f'{self.head_dim} must be even')
    kv = self.num_kv_heads
    if not isinstance(kv, int) or kv < 0 or (kv and self.num_heads % kv):
      raise ValueError(f'ModelConfig.num_kv_heads={kv!r} must be 0 (= num_heads)'
                       f' or a divisor of num_heads={self.num_heads}')
    if self.model_kind == 'encoder_only' and not (
        isinstance(self.num_labels, int) and self.num_labels > 1):
      raise ValueError('an encoder_only model needs num_labels >= 2 (the size '
                       f'of its token head), got {self.num_labels!r}')
    if self.attention_impl not in ('auto', 'reference') and (
        self.attention_dropout_rate > 0):
      raise ValueError(f'attention_impl={self.attention_impl!r} has no '
                       'dropout on attention weights; use attention_impl='
                       "'reference' (or 'auto') with attention_dropout_rate > 0")
    self._check_attention_kind()

  def _check_attention_kind(self):
    """Clear errors for long-input settings that do not fit together."""
    kind = self.attention_kind
    if kind not in ATTENTION_KINDS:
      raise ValueError(f'ModelConfig.attention_kind={kind!r} is not one of '
                       f'{ATTENTION_KINDS}')
    if self.linear_feature_map not in LINEAR_FEATURE_MAPS:
      raise ValueError(f'ModelConfig.linear_feature_map='
                       f'{self.linear_feature_map!r} is not one of '
                       f'{LINEAR_FEATURE_MAPS}')
    for name in ('attention_window', 'attention_global_tokens',
                 'favor_features'):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f'ModelConfig.{name} must be an integer >= 0, got '
                         f'{value!r}')
    if kind == 'local':
      if self.attention_window <= 0:
        raise ValueError("attention_kind='local' needs attention_window >= 1 "
                         f'(keys on each side of a query), got '
                         f'{self.attention_window!r}')
      if self.attention_impl == 'pallas':
        raise ValueError("attention_kind='local' has no Pallas kernel here; use "
                         "attention_impl 'auto', 'reference', 'xla' or 'cudnn'")
      if self.attention_global_tokens and self.attention_impl in ('xla',
                                                                  'cudnn'):
        raise ValueError('global tokens are computed blockwise only; use '
                         "attention_impl 'auto' or 'reference' with "
                         'attention_global_tokens > 0')
    else:
      for name in ('attention_window', 'attention_global_tokens'):
        if getattr(self, name):
          raise ValueError(f"ModelConfig.{name} is for attention_kind='local'"
                           f' (attention_kind is {kind!r})')
    if kind == 'linear':
      if self.positional == 'alibi':
        raise ValueError("attention_kind='linear' never forms the score matrix "
                         "that ALiBi biases; use positional 'rope', "
                         "'sinusoidal', 'learned' or 'none'")
      if self.attention_dropout_rate > 0:
        raise ValueError("attention_kind='linear' has no attention weights to "
                         'drop out; set attention_dropout_rate=0')
      if self.attention_impl not in ('auto', 'reference'):
        raise ValueError("attention_kind='linear' has one implementation; use "
                         f"attention_impl='auto' (got {self.attention_impl!r})")
    elif self.linear_feature_map != 'elu':
      raise ValueError("ModelConfig.linear_feature_map is for attention_kind="
                       f"'linear' (attention_kind is {kind!r})")
    if self.favor_features and not (kind == 'linear' and
                                    self.linear_feature_map == 'favor'):
      raise ValueError("ModelConfig.favor_features is for attention_kind="
                       "'linear' with linear_feature_map='favor'")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def final_norm(self) -> bool:
    """Pre-LN and Peri-LN leave each stack's output unnormalised: one more
    norm closes the stack."""
    return self.norm_position != 'post'

  @property
  def linear_features(self) -> int:
    """Features per query/key in linear attention: head_dim for 'elu',
    ``favor_features`` (0: 4 * head_dim) for 'favor'."""
    if self.linear_feature_map == 'elu':
      return self.head_dim
    return self.favor_features or 4 * self.head_dim

  @property
  def kv_heads(self) -> int:
    """Key/value heads: ``num_heads`` (MHA), fewer (GQA) or 1 (MQA)."""
    return self.num_kv_heads or self.num_heads

  def replace(self, **changes) -> 'ModelConfig':
    return dataclasses.replace(self, **changes)


def swiglu_d_ff(d_ff: int, multiple: int = 8) -> int:
  """SwiGLU hidden width with the parameters of a 2-matrix FFN of width d_ff.

  A gated FFN has three ``d_model x d_ff`` matrices instead of two, so its
  width is scaled by 2/3 (Shazeer, 2020), rounded up to ``multiple``.
  """
  return -(-(2 * d_ff) // (3 * multiple)) * multiple


def base(**changes) -> ModelConfig:
  """The paper's base model: d_model 512, 8 heads, 6+6 layers, d_ff 2048."""
  return ModelConfig(**changes)


def big(**changes) -> ModelConfig:
  """The paper's big model: d_model 1024, 16 heads, d_ff 4096, dropout 0.3."""
  return ModelConfig(**{**dict(d_model=1024, num_heads=16, d_ff=4096,
                               dropout_rate=0.3), **changes})


def toy(**changes) -> ModelConfig:
  """The model of the toy translation recipe (``experiments/configs/toy.py``,
  the default of ``python -m experiments.train_wmt``): d_model 192, 4 heads,
  2+2 layers, d_ff 768, no dropout."""
  return ModelConfig(**{**dict(vocab_size=1000, d_model=192, num_heads=4,
                               num_encoder_layers=2, num_decoder_layers=2,
                               d_ff=768, max_len=256, dropout_rate=0.0),
                        **changes})


PRESETS = {'base': base, 'big': big, 'toy': toy}
