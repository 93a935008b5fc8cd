"""One shared SentencePiece vocabulary for source and target (section 5.1).

Reserved ids: PAD=0, EOS=1, UNK=2; there is no BOS (the decoder's start symbol
is PAD, as in `blocks.shift_right`). The model file is saved in the training
workdir, so a checkpoint travels with its tokenizer:

    tok = Tokenizer.train(texts, workdir, vocab_size=2000)  # or
    tok = Tokenizer.load(f'{workdir}/tokenizer.model')
    ids = tok.encode('hello world')            # list[int], no EOS
    tok.decode(ids + [EOS, 5, 6])              # 'hello world': stops at EOS
"""
from __future__ import annotations

import io
import itertools
import logging
import os
import time
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from xfmr_jax.token_ids import EOS, PAD, UNK

log = logging.getLogger(__name__)

MODEL_FILENAME = 'tokenizer.model'


class TokenizerError(ValueError):
  """A file that is not a tokenizer model this library can use."""


class Tokenizer:
  """Wraps a `SentencePieceProcessor` with the project's reserved ids."""

  def __init__(self, model_proto: bytes):
    self.model_proto = model_proto
    try:
      self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    except RuntimeError as e:
      raise TokenizerError(f'not a SentencePiece model ({e})') from None
    if (self._sp.pad_id(), self._sp.eos_id(), self._sp.unk_id(),
        self._sp.bos_id()) != (PAD, EOS, UNK, -1):
      raise TokenizerError('tokenizer model must have pad=0, eos=1, unk=2 '
                           'and no bos; train it with Tokenizer.train')

  @classmethod
  def train(cls, texts: Iterable[str], workdir: str | None = None, *,
            vocab_size: int = 8000, model_type: str = 'bpe',
            max_sentences: int = 200_000, character_coverage: float = 1.0,
            normalization_rule_name: str = 'identity',
            num_threads: int | None = None) -> 'Tokenizer':
    """Trains on at most ``max_sentences`` texts (source and target mixed).

    Args:
      texts: training sentences; only the first ``max_sentences`` are read, so
        pass them in shuffled order for a representative sample.
      workdir: if given, the model is written to ``workdir/tokenizer.model``.
      vocab_size: upper bound; a small corpus may give fewer pieces (the soft
        limit avoids SentencePiece's "vocab size too high" failure).
      model_type: 'bpe' (the paper's choice; on the toy task it keeps words
        whole and trains in under a second) or 'unigram'.
      character_coverage: 1.0 keeps every character; ~0.9995 suits WMT.
      normalization_rule_name: 'identity' (exact round trip) or 'nmt_nfkc'.
    """
    if model_type not in ('unigram', 'bpe'):
      raise ValueError(f"model_type must be 'unigram' or 'bpe', got "
                       f'{model_type!r}')
    sample = [t for t in itertools.islice(texts, max_sentences) if t]
    if not sample:
      raise ValueError('no training text for the tokenizer')
    start = time.time()
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sample), model_writer=model,
        vocab_size=vocab_size, hard_vocab_limit=False, model_type=model_type,
        character_coverage=character_coverage,
        normalization_rule_name=normalization_rule_name,
        pad_id=PAD, eos_id=EOS, unk_id=UNK, bos_id=-1,
        num_threads=num_threads or os.cpu_count() or 1,
        minloglevel=2)  # silence SentencePiece's stderr log
    tok = cls(model.getvalue())
    log.info('trained %s tokenizer: %d pieces from %d texts in %.1f s',
                 model_type, tok.vocab_size, len(sample), time.time() - start)
    if workdir is not None:
      tok.save(workdir)
    return tok

  @classmethod
  def load(cls, path: str) -> 'Tokenizer':
    """Loads a ``.model`` file, or ``tokenizer.model`` inside a directory."""
    if os.path.isdir(path):
      path = os.path.join(path, MODEL_FILENAME)
    if not os.path.exists(path):
      raise FileNotFoundError(f'no tokenizer model at {path}')
    with open(path, 'rb') as f:
      proto = f.read()
    try:
      return cls(proto)
    except TokenizerError as e:
      raise TokenizerError(f'{path}: {e}') from None

  def save(self, workdir: str) -> str:
    """Writes ``workdir/tokenizer.model`` atomically; returns its path."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, MODEL_FILENAME)
    with open(path + '.tmp', 'wb') as f:
      f.write(self.model_proto)
    os.replace(path + '.tmp', path)
    return path

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text`` without EOS."""
    return self._sp.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._sp.encode(list(texts))

  # One model serves both sides. (A tokenizer with a model per side, such as
  # :class:`xfmr_jax.marian_tokenizer.MarianTokenizer`, differs here only.)
  encode_target = encode
  encode_target_batch = encode_batch

  def decode(self, ids) -> str:
    """Text of ``ids`` up to the first EOS, ignoring PAD; accepts numpy."""
    ids = np.asarray(ids).reshape(-1).tolist()
    if EOS in ids:
      ids = ids[:ids.index(EOS)]
    return self._sp.decode([i for i in ids if i != PAD])

  def id_to_piece(self, i: int) -> str:
    return self._sp.id_to_piece(i)
