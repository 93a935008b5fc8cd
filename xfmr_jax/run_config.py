"""Training configs (``ml_collections``, see ``experiments/configs``): checks
that run before any training starts, and what a config resolves to.

Every check raises :class:`ConfigError` with a message naming the field.
"""
from __future__ import annotations

import dataclasses
import os

import flax.linen as nn
import jax

from xfmr_jax import data, sharding
from xfmr_jax import model as model_lib
from xfmr_jax.config import ModelConfig


class ConfigError(ValueError):
  """A training config that cannot work; raised before any training starts."""


_POSITIVE = ('vocab_size', 'max_length', 'eval_max_length', 'batch_size',
             'num_train_steps', 'warmup_steps', 'log_every', 'eval_every',
             'checkpoint_every', 'keep_checkpoints', 'eval_batch_size',
             'eval_batches', 'grad_accum_steps', 'beam_size',
             'tokenizer_max_sentences')
_NON_NEGATIVE = ('max_decode_extra', 'bleu_samples', 'test_samples',
                 'num_print_samples', 'data_workers')
# float field -> (lowest, highest, whether the lowest is allowed)
_RANGES = {'lr_scale': (0.0, float('inf'), False),
           'beam_alpha': (0.0, float('inf'), True),
           'adam_b1': (0.0, 1.0, True), 'adam_b2': (0.0, 1.0, True),
           'adam_eps': (0.0, float('inf'), False),
           'grad_clip_norm': (0.0, float('inf'), True),
           'ema_decay': (0.0, 1.0, True)}
_DATASET_FAMILIES = ('toy_translate',
                     *(name.split('/')[0] for name in data.sources.WMT))
# Fields that a resumed run must share with the run that wrote the workdir
# (besides config.model's, of which only these may change).
_SHAPE_FIELDS = ('vocab_size', 'tokenizer_type', 'tokenizer_path')
CHANGEABLE_MODEL_FIELDS = ('dropout_rate', 'attention_dropout_rate', 'dtype',
                           'remat', 'attention_impl')


def model_config(config, vocab_size: int) -> ModelConfig:
  """The :class:`ModelConfig` of ``config.model`` with the tokenizer's vocabulary."""
  try:
    return ModelConfig(vocab_size=vocab_size, **config.model.to_dict())
  except (TypeError, ValueError) as e:
    raise ConfigError(f'config.model: {e}') from None


def build_model(config, vocab_size: int) -> nn.Module:
  """The model of a training config and the tokenizer's vocabulary (its
  optimizer is :func:`xfmr_jax.optim.from_config`); training and loading a
  workdir both build it here, so that they agree on the parameter tree."""
  return model_lib.build(model_config(config, vocab_size))


def data_source(config, split: str):
  """The ``(source, target)`` pairs of ``split`` of ``config.dataset``; a
  DataError if the split is missing or holds no pair."""
  source = data.get_source(config.dataset, split, config.data_dir or None,
                           reverse=config.reverse)
  if len(source) == 0:
    raise data.DataError(f'the {split!r} split of {config.dataset} has no '
                         'sentence pairs')
  return source


def validate_config(config) -> None:
  """Reject a config that cannot train, with a message naming the field."""
  for name in _POSITIVE:
    value = config[name]
    if not isinstance(value, int) or value <= 0:
      raise ConfigError(f'config.{name} must be a positive integer, got '
                        f'{value!r}')
  for name in _NON_NEGATIVE:
    value = config[name]
    if not isinstance(value, int) or value < 0:
      raise ConfigError(f'config.{name} must be a non-negative integer, got '
                        f'{value!r}')
  for name, (low, high, closed) in _RANGES.items():
    value = config[name]
    ok = isinstance(value, (int, float)) and (
        (low <= value if closed else low < value) and value < high)
    if not ok:
      bound = '>=' if closed else '>'
      raise ConfigError(f'config.{name} must be {bound} {low}'
                        + (f' and < {high}' if high != float('inf') else '')
                        + f', got {value!r}')
  if config.max_length > config.model.max_len:
    raise ConfigError(f'config.max_length={config.max_length} exceeds '
                      f'config.model.max_len={config.model.max_len}')
  if config.length_policy not in ('filter', 'truncate'):
    raise ConfigError("config.length_policy must be 'filter' or 'truncate'")
  if config.tokenizer_type not in ('bpe', 'unigram'):
    raise ConfigError("config.tokenizer_type must be 'bpe' or 'unigram'")
  if config.tokenizer_path and not os.path.exists(config.tokenizer_path):
    raise ConfigError(f'config.tokenizer_path {config.tokenizer_path!r} does '
                      'not exist')
  schedule = config.get('lr_schedule', 'paper')
  if schedule not in ('paper', 'linear'):
    raise ConfigError("config.lr_schedule must be 'paper' or 'linear', got "
                      f'{schedule!r}')
  if schedule == 'linear' and not (
      isinstance(config.learning_rate, (int, float))
      and config.learning_rate > 0):
    raise ConfigError("config.lr_schedule='linear' needs config.learning_rate "
                      f'> 0, got {config.learning_rate!r}')
  if config.get('beam_rules', 'gnmt') not in ('gnmt', 'hf'):
    raise ConfigError("config.beam_rules must be 'gnmt' or 'hf', got "
                      f'{config.beam_rules!r}')
  if not 0 <= config.label_smoothing < 1:
    raise ConfigError('config.label_smoothing must be in [0, 1)')
  if config.batch_size % jax.process_count():
    raise ConfigError(f'config.batch_size={config.batch_size} is not divisible '
                      f'by the {jax.process_count()} processes')
  if model_config(config, config.vocab_size).model_kind == 'encoder_only':
    raise ConfigError("config.model.model_kind='encoder_only' tags tokens; "
                      'this trainer translates (train a tagger with '
                      'python -m experiments.train_tagger)')
  validate_sharding(config)
  kind, colon, spec = config.dataset.partition(':')
  if colon and kind in ('tsv', 'files'):
    for path in spec.split(','):
      path = path.replace('{split}', config.train_split)
      if not os.path.exists(path):
        raise ConfigError(f'config.dataset: data file {path!r} does not exist')
  elif config.dataset.split('/')[0] not in _DATASET_FAMILIES:
    raise ConfigError(f'config.dataset={config.dataset!r} is unknown; use '
                      "'toy_translate', "
                      + ''.join(f'{name!r}, ' for name in data.sources.WMT)
                      + "'tsv:PATH' or 'files:SRC,TGT'")


def model_differences(saved: dict, config_json: dict) -> str:
  """The fields, besides the changeable ones, in which two configs describe
  different parameters, as ``model.d_model (32 there, 48 here), ...`` (empty
  when they describe the same)."""
  # A field that the saved config predates had its default value then.
  defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
  model = {**defaults, **saved.get('model', {})}
  new_model = {**defaults, **config_json['model']}
  differ = [f'model.{k}' for k in sorted(set(model) | set(new_model))
            if k not in CHANGEABLE_MODEL_FIELDS
            and model.get(k) != new_model.get(k)]
  differ += [k for k in _SHAPE_FIELDS
             if k in saved and saved[k] != config_json.get(k)]
  # The moving average lives in the optimizer state: on in one run and off
  # in the other, the checkpoints have another structure (its decay may change).
  if (saved.get('ema_decay', 0.0) > 0) != (config_json.get('ema_decay', 0.0) > 0):
    differ.append('ema_decay')
  return ', '.join(f"{k} ({_get(saved, k)!r} there, {_get(config_json, k)!r}"
                   ' here)' for k in differ)


def check_resumable(saved: dict, config_json: dict, workdir: str) -> None:
  """Refuse to resume a workdir whose model (or vocabulary) differs from
  ``config``: its checkpoints and tokenizer belong to the saved config."""
  shown = model_differences(saved, config_json)
  if shown:
    raise ConfigError(f'{workdir} holds a run of another model: {shown}. '
                      'Use another --workdir to start fresh, or the same '
                      'values to resume it.')


def _get(tree: dict, dotted: str):
  for part in dotted.split('.'):
    tree = tree.get(part) if isinstance(tree, dict) else None
  return tree


def validate_sharding(config) -> tuple:
  """The ``(data, fsdp, model)`` mesh shape for this run, or a ConfigError."""
  try:
    shape = sharding.resolve_mesh_shape(sharding.mesh_shape_from_config(config),
                                        jax.device_count())
    sharding.rules_from_config(config)
  except (ValueError, TypeError) as e:
    raise ConfigError(f'config.mesh_shape / parallelism / logical_axis_rules: '
                      f'{e}') from None
  rows = shape[0] * shape[1]  # the batch is split over data x fsdp
  for name in ('batch_size', 'eval_batch_size'):
    if config[name] % rows:
      raise ConfigError(f'config.{name}={config[name]} is not divisible by '
                        f'data x fsdp = {rows} (mesh {shape})')
  if rows % jax.process_count():
    raise ConfigError(f'data x fsdp = {rows} (mesh {shape}) must be a multiple '
                      f'of the {jax.process_count()} processes, so that each '
                      'process feeds its own rows')
  return shape
