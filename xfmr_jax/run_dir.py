"""The run directory (``workdir``) of a training run, and what it takes to
use one: ``python -m experiments.train_wmt`` writes it, ``Translator`` and
the tools that load a trained model read it.

    workdir/
      tokenizer.model     the SentencePiece model the checkpoints belong to
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

from xfmr_jax import checkpoint, model as model_lib, optim, train_state
from xfmr_jax.data import pipeline
from xfmr_jax.run_config import model_config
from xfmr_jax.tokenizer import MODEL_FILENAME as TOKENIZER_FILE
from xfmr_jax.tokenizer import Tokenizer

log = logging.getLogger('xfmr_jax')

CONFIG_FILE = 'config.json'
CHECKPOINT_DIR = 'checkpoints'
FINAL_METRICS_FILE = 'final_metrics.json'


def schedule(config) -> optax.Schedule:
  """The learning rate of each optimizer update (equation 3, scaled): the
  schedule inside :func:`build_model_and_optimizer`'s optimizer."""
  return optim.paper_schedule(config.model.d_model, config.warmup_steps,
                              config.lr_scale)


def build_model_and_optimizer(config, vocab_size: int):
  """``(model, tx)`` of a training config and the tokenizer's vocabulary."""
  model = model_lib.build(model_config(config, vocab_size))
  tx = optim.make_optimizer(
      d_model=config.model.d_model, warmup_steps=config.warmup_steps,
      lr_scale=config.lr_scale, b1=config.adam_b1, b2=config.adam_b2,
      eps=config.adam_eps, grad_clip_norm=config.grad_clip_norm,
      grad_accum_steps=config.grad_accum_steps)
  return model, tx


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


def get_tokenizer(config, workdir: str, train_source) -> Tokenizer:
  """The workdir's tokenizer, else ``tokenizer_path``, else a new one."""
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
  saved = os.path.join(workdir, TOKENIZER_FILE)
  if os.path.exists(saved):
    return Tokenizer.load(saved)
  if config.tokenizer_path:
    tokenizer = Tokenizer.load(config.tokenizer_path)
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
  tok_path = os.path.join(workdir, TOKENIZER_FILE)
  ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
  for path in (tok_path, ckpt_dir, os.path.join(workdir, CONFIG_FILE)):
    if not os.path.exists(path):
      raise checkpoint.CheckpointError(
          f'{workdir} is not a training workdir: {path} is missing')
  tokenizer = Tokenizer.load(tok_path)
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
  return model, restored[1].params, tokenizer, config
