"""Fine-tuning: a run with ``config.init_from`` set starts from the newest
parameters of another workdir (a trained run or an imported Marian model),
with that workdir's model, vocabulary and tokenizer.

    config = apply_init_from(config)          # before validation
    params = init_params(config, state.params)  # instead of the fresh ones
"""
from __future__ import annotations

import os

import jax
import ml_collections

from xfmr_jax.run_config import CHANGEABLE_MODEL_FIELDS, ConfigError
from xfmr_jax.workdir import CONFIG_FILE, Workdir


def apply_init_from(config):
  """``config`` itself, or with ``init_from`` set, an unlocked copy whose
  model and vocabulary are those of the workdir ``init_from``, keeping this
  config's ``model.{dropout_rate, attention_dropout_rate, dtype, remat,
  attention_impl}`` (how to train, not what the parameters are)."""
  if not config.get('init_from'):
    return config
  source = Workdir(config.init_from)
  if not os.path.isdir(source.path):
    raise ConfigError(f'config.init_from {source.path!r} is not a directory')
  if not source.has_config():
    raise ConfigError(f'config.init_from {source.path!r} is not a workdir: '
                      f'it has no {CONFIG_FILE}')
  saved = source.read_config()
  resolved = ml_collections.ConfigDict(config.to_dict())
  model = dict(saved['model'])
  for name in CHANGEABLE_MODEL_FIELDS:
    if name in config.model:
      model[name] = config.model[name]
  resolved.model = ml_collections.ConfigDict(model)
  for name in ('vocab_size', 'tokenizer_type'):
    if name in saved:
      resolved[name] = saved[name]
  return resolved


def init_params(config, like):
  """The newest parameters of ``config.init_from``, laid out like the params
  tree ``like`` (this run's fresh ones, placed over its mesh); a ConfigError
  naming the first parameter whose path or shape differs."""
  params = Workdir(config.init_from).load().params
  want = jax.tree_util.tree_flatten_with_path(like)[0]
  have = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  for path, leaf in want:
    name = jax.tree_util.keystr(path)
    if path not in have or have[path].shape != leaf.shape:
      found = have[path].shape if path in have else 'nothing'
      raise ConfigError(f'config.init_from {config.init_from!r}: parameter '
                        f'{name} should be {leaf.shape}, found {found}')
  if len(have) != len(want):
    raise ConfigError(f'config.init_from {config.init_from!r} has parameters '
                      'this model does not')
  return jax.tree.map(lambda p, x: jax.device_put(p, x.sharding), params, like)
