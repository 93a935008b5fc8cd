"""The run directory (``workdir``) of a training run, and what it takes to
use one: ``python -m experiments.train_wmt`` writes it, ``Translator`` and
the tools that load a trained model read it.

    workdir/
      tokenizer.model     the SentencePiece model the checkpoints belong to,
                          or marian_tokenizer/ (an imported Marian model's,
                          see :mod:`xfmr_jax.marian_tokenizer`)
      config.json         the resolved training config
      checkpoints/<step>/ orbax checkpoints (:mod:`xfmr_jax.checkpoint`)
      metrics.jsonl, tensorboard/, final_metrics.json

The model and optimiser of a run are built from its config by
:func:`build_model_and_optimizer`, here and nowhere else, so that training
and loading agree on them.
"""
from __future__ import annotations

import json
import logging
import os

import jax
import ml_collections
import numpy as np
import optax

from xfmr_jax import checkpoint, marian_tokenizer, optim
from xfmr_jax import train_state
from xfmr_jax.data import pipeline
from xfmr_jax.run_config import (CHANGEABLE_MODEL_FIELDS, ConfigError,
                                 build_model)
from xfmr_jax.tokenizer import MODEL_FILENAME as TOKENIZER_FILE
from xfmr_jax.tokenizer import Tokenizer

log = logging.getLogger('xfmr_jax')

CONFIG_FILE = 'config.json'
CHECKPOINT_DIR = 'checkpoints'
FINAL_METRICS_FILE = 'final_metrics.json'


def schedule(config) -> optax.Schedule:
  """:func:`xfmr_jax.optim.schedule_from_config`."""
  return optim.schedule_from_config(config)


def build_model_and_optimizer(config, vocab_size: int):
  """``(model, tx)`` of a training config and the tokenizer's vocabulary:
  :func:`xfmr_jax.run_config.build_model` and :func:`xfmr_jax.optim.from_config`."""
  return build_model(config, vocab_size), optim.from_config(config)


def read_config(workdir: str) -> dict:
  """The ``config.json`` of a workdir (a CheckpointError if unreadable)."""
  path = os.path.join(workdir, CONFIG_FILE)
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise checkpoint.CheckpointError(f'{path} cannot be read as JSON: '
                                     f'{e}') from None


def write_config(workdir: str, config_json: dict) -> None:
  """``config.json``: readable by tools that load the model without a
  checkpoint (process 0 writes it)."""
  if jax.process_index() == 0:
    with open(os.path.join(workdir, CONFIG_FILE), 'w') as f:
      json.dump(config_json, f, indent=2)


def tokenizer_path(workdir: str) -> str:
  """Where a workdir keeps its tokenizer: ``marian_tokenizer/`` if there is
  one, else ``tokenizer.model`` (which need not exist yet)."""
  marian = os.path.join(workdir, marian_tokenizer.DIRNAME)
  return marian if os.path.isdir(marian) else os.path.join(workdir,
                                                           TOKENIZER_FILE)


def load_tokenizer(path: str):
  """A tokenizer from a workdir, a ``.model`` file or a Marian tokenizer
  folder: a :class:`Tokenizer` or a
  :class:`~xfmr_jax.marian_tokenizer.MarianTokenizer` (same interface)."""
  if os.path.isdir(path):
    path = tokenizer_path(path)
    if not os.path.exists(path) and os.path.exists(
        os.path.join(os.path.dirname(path), 'vocab.json')):
      path = os.path.dirname(path)  # a folder of Marian's three files
  if os.path.isdir(path):
    return marian_tokenizer.MarianTokenizer.load(path)
  return Tokenizer.load(path)


def apply_init_from(config):
  """``config`` itself, or with ``init_from`` set, an unlocked copy whose
  model and vocabulary are those of the workdir ``init_from`` (for example an
  imported Marian model), keeping this config's
  ``model.{dropout_rate, attention_dropout_rate, dtype, remat,
  attention_impl}``. The run then starts from that workdir's newest
  parameters (:func:`init_params`) and tokenizer."""
  if not config.get('init_from'):
    return config
  source = config.init_from
  if not os.path.isdir(source):
    raise ConfigError(f'config.init_from {source!r} is not a directory')
  if not os.path.exists(os.path.join(source, CONFIG_FILE)):
    raise ConfigError(f'config.init_from {source!r} is not a workdir: it has '
                      f'no {CONFIG_FILE}')
  saved = read_config(source)
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
  tree ``like`` (this run's fresh ones); a ConfigError naming the first
  parameter whose path or shape differs."""
  _, params, _, _ = load_for_inference(config.init_from)
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


def get_tokenizer(config, workdir: str, train_source) -> Tokenizer:
  """The workdir's tokenizer, else ``init_from``'s, else ``tokenizer_path``,
  else a new one (saved in the workdir)."""
  marian = os.path.isdir(os.path.join(workdir, marian_tokenizer.DIRNAME))
  if jax.process_count() > 1 and (marian or config.get('init_from')):
    # Files every process reads (the workdir is on a shared filesystem).
    return _get_tokenizer(config, workdir, train_source)
  if jax.process_count() > 1:  # every process must use process 0's tokenizer
    from jax.experimental import multihost_utils
    proto = (_get_tokenizer(config, workdir, train_source).model_proto
             if jax.process_index() == 0 else b'')
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(proto))))
    buf = np.zeros(size, np.uint8)
    if jax.process_index() == 0:
      buf[:] = np.frombuffer(proto, np.uint8)
    buf = multihost_utils.broadcast_one_to_all(buf)
    return Tokenizer(np.asarray(buf, np.uint8).tobytes())
  return _get_tokenizer(config, workdir, train_source)


def _get_tokenizer(config, workdir: str, train_source) -> Tokenizer:
  saved = tokenizer_path(workdir)
  if os.path.exists(saved):
    return load_tokenizer(saved)
  if config.get('init_from'):
    tokenizer = load_tokenizer(config.init_from)
  elif config.tokenizer_path:
    tokenizer = load_tokenizer(config.tokenizer_path)
  else:
    n = min(len(train_source), config.tokenizer_max_sentences // 2)
    indices = np.linspace(0, len(train_source) - 1, n).astype(int).tolist()
    pairs = pipeline.read_pairs(train_source, indices)
    texts = [t for pair in pairs for t in pair]
    log.info('training a %s tokenizer (vocab %d) on %d sentences',
             config.tokenizer_type, config.vocab_size, len(texts))
    tokenizer = Tokenizer.train(texts, vocab_size=config.vocab_size,
                                model_type=config.tokenizer_type)
  if jax.process_index() == 0:
    tokenizer.save(workdir)
  return tokenizer


def load_for_inference(workdir: str, step: int | None = None):
  """``(model, params, tokenizer, config)`` from a training workdir."""
  workdir = os.path.abspath(workdir)
  tok_path = tokenizer_path(workdir)
  ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
  for path in (tok_path, ckpt_dir, os.path.join(workdir, CONFIG_FILE)):
    if not os.path.exists(path):
      raise checkpoint.CheckpointError(
          f'{workdir} is not a training workdir: {path} is missing')
  tokenizer = load_tokenizer(tok_path)
  config = ml_collections.ConfigDict(read_config(workdir))
  model, tx = build_model_and_optimizer(config, tokenizer.vocab_size)
  abstract = jax.eval_shape(
      lambda: train_state.init_state(model, tx, config.seed))
  ckpt = checkpoint.Checkpointer(ckpt_dir, async_save=False)
  try:
    restored = ckpt.restore(abstract, step)
  finally:
    ckpt.close()
  if restored is None:
    raise checkpoint.CheckpointError(f'no checkpoint in {ckpt_dir}')
  return model, optim.eval_params(restored[1]), tokenizer, config
