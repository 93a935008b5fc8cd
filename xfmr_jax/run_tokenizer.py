"""The tokenizer of a training run: the workdir's own when it has one (a
resumed run), else ``config.init_from``'s, else ``config.tokenizer_path``,
else one trained on the train split; a new one is saved in the workdir.

:mod:`xfmr_jax.tokenizer` is the SentencePiece wrapper itself; this module
decides which tokenizer a config gets, and on several hosts makes every
process use the same one.
"""
from __future__ import annotations

import logging

import jax
import numpy as np

from xfmr_jax.data import pipeline
from xfmr_jax.tokenizer import Tokenizer
from xfmr_jax.workdir import AnyTokenizer, Workdir, load_tokenizer

log = logging.getLogger('xfmr_jax')


def get_tokenizer(config, workdir: str, train_source) -> AnyTokenizer:
  """The tokenizer of a run of ``config`` in ``workdir`` (see the module
  docstring); ``train_source`` is the train split's ``(source, target)``
  pairs, read only to train a new one."""
  wd = Workdir(workdir)
  # Files every process reads are the same everywhere (the workdir is on a
  # shared filesystem); a tokenizer trained now must be process 0's on all.
  if (jax.process_count() == 1 or wd.has_marian_tokenizer()
      or config.get('init_from')):
    return _find_or_train(config, wd, train_source)
  return _from_process_0(lambda: _find_or_train(config, wd, train_source))


def train_tokenizer(config, train_source) -> Tokenizer:
  """A ``config.tokenizer_type`` tokenizer of ``config.vocab_size`` pieces,
  trained on up to ``config.tokenizer_max_sentences`` sentences (both sides
  of pairs spread evenly over ``train_source``)."""
  n = min(len(train_source), config.tokenizer_max_sentences // 2)
  indices = np.linspace(0, len(train_source) - 1, n).astype(int).tolist()
  pairs = pipeline.read_pairs(train_source, indices)
  texts = [t for pair in pairs for t in pair]
  log.info('training a %s tokenizer (vocab %d) on %d sentences',
           config.tokenizer_type, config.vocab_size, len(texts))
  return Tokenizer.train(texts, vocab_size=config.vocab_size,
                         model_type=config.tokenizer_type)


def _find_or_train(config, wd: Workdir, train_source) -> AnyTokenizer:
  if wd.has_tokenizer():
    return wd.load_tokenizer()
  if config.get('init_from'):
    tokenizer = load_tokenizer(config.init_from)
  elif config.tokenizer_path:
    tokenizer = load_tokenizer(config.tokenizer_path)
  else:
    tokenizer = train_tokenizer(config, train_source)
  if jax.process_index() == 0:
    tokenizer.save(wd.path)
  return tokenizer


def _from_process_0(make) -> Tokenizer:
  """``make()``'s SentencePiece tokenizer on process 0, sent to every process
  (``make`` runs on process 0 only)."""
  from jax.experimental import multihost_utils
  proto = make().model_proto if jax.process_index() == 0 else b''
  size = int(multihost_utils.broadcast_one_to_all(np.int64(len(proto))))
  buf = np.zeros(size, np.uint8)
  if jax.process_index() == 0:
    buf[:] = np.frombuffer(proto, np.uint8)
  buf = multihost_utils.broadcast_one_to_all(buf)
  return Tokenizer(np.asarray(buf, np.uint8).tobytes())
