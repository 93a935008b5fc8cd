"""The tokenizer of a Marian (opus-mt) translator, on this library's ids.

A Marian model has two SentencePiece models, ``source.spm`` and ``target.spm``,
whose pieces index one shared vocabulary ``vocab.json`` (piece -> Marian id).
Marian's own special ids are EOS 0, unknown 1 (usually) and pad = the last id;
this library's are PAD 0, EOS 1, UNK 2 (:mod:`xfmr_jax.token_ids`). The
tokenizer maps one onto the other with a fixed permutation (see
:func:`id_permutation`), and :mod:`xfmr_jax.marian` permutes the embedding rows
and the logits bias the same way, so the imported model computes exactly what
the original computes while masks, losses, packing and decoding keep their one
convention (pad 0 is also the decoder's start symbol, which is what Marian's
``decoder_start_token_id = pad`` means).

    tok = MarianTokenizer.from_files('opus-mt-en-de')   # the HF directory
    tok.save(workdir)                                    # workdir/marian_tokenizer/
    ids = tok.encode('Hello world')                      # source.spm, no EOS
    tok.encode_target('Hallo Welt')                      # target.spm
    tok.decode(ids + [EOS])                              # target.spm

It reproduces ``transformers.MarianTokenizer``: a leading language code such as
``>>de<<`` is one token, pieces missing from ``vocab.json`` become unknown, and
decoding drops the special tokens (as ``skip_special_tokens=True`` does). Moses
punctuation normalisation, which the Hugging Face tokenizer applies only when
``sacremoses`` is installed, is not applied.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Sequence

import numpy as np
import sentencepiece as spm

from xfmr_jax.token_ids import EOS, PAD, UNK
from xfmr_jax.tokenizer import TokenizerError

DIRNAME = 'marian_tokenizer'
FILES = ('source.spm', 'target.spm', 'vocab.json')
PAD_PIECE, EOS_PIECE, UNK_PIECE = '<pad>', '</s>', '<unk>'


def id_permutation(marian_pad: int, marian_eos: int, marian_unk: int,
                   vocab_size: int) -> np.ndarray:
  """``ours_to_marian`` ``[vocab_size]`` int64: the Marian id of each of our ids.

  Our ids 0, 1, 2 are Marian's pad, EOS and unknown; ids 3.. are all other
  Marian ids in increasing order. So ``embedding_ours = embedding_marian[p]``
  and ``marian_id = p[our_id]``; ``np.argsort(p)`` maps back.
  """
  special = [marian_pad, marian_eos, marian_unk]
  if len(set(special)) != 3 or not all(0 <= i < vocab_size for i in special):
    raise TokenizerError(f'Marian pad/eos/unk ids {special} must be distinct '
                         f'ids below the vocabulary size {vocab_size}')
  rest = np.setdiff1d(np.arange(vocab_size), special)
  return np.concatenate([np.asarray(special), rest]).astype(np.int64)


def _load_spm(path: str) -> spm.SentencePieceProcessor:
  with open(path, 'rb') as f:
    proto = f.read()
  try:
    return spm.SentencePieceProcessor(model_proto=proto)
  except RuntimeError as e:
    raise TokenizerError(f'{path}: not a SentencePiece model ({e})') from None


class MarianTokenizer:
  """Source and target SentencePiece models over one shared vocabulary, with
  this library's reserved ids (see the module docstring)."""

  def __init__(self, directory: str):
    self.directory = os.path.abspath(directory)
    for name in FILES:
      if not os.path.exists(os.path.join(directory, name)):
        raise TokenizerError(f'{os.path.join(directory, name)} is missing: a '
                             f'Marian tokenizer needs {", ".join(FILES)}')
    vocab_path = os.path.join(directory, 'vocab.json')
    try:
      with open(vocab_path, encoding='utf-8') as f:
        vocab = json.load(f)
    except (OSError, ValueError) as e:
      raise TokenizerError(f'{vocab_path} cannot be read as JSON: {e}') from None
    if not isinstance(vocab, dict) or not all(
        isinstance(v, int) for v in vocab.values()):
      raise TokenizerError(f'{vocab_path} must map pieces to integer ids')
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
      raise TokenizerError(f'{vocab_path}: ids must be 0 .. {len(ids) - 1}, '
                           'each once')
    for piece in (PAD_PIECE, EOS_PIECE, UNK_PIECE):
      if piece not in vocab:
        raise TokenizerError(f'{vocab_path} has no {piece!r} entry')
    self._source = _load_spm(os.path.join(directory, 'source.spm'))
    self._target = _load_spm(os.path.join(directory, 'target.spm'))
    self.marian_ids = {name: vocab[piece] for name, piece in (
        ('pad', PAD_PIECE), ('eos', EOS_PIECE), ('unk', UNK_PIECE))}
    self.ours_to_marian = id_permutation(
        self.marian_ids['pad'], self.marian_ids['eos'], self.marian_ids['unk'],
        len(ids))
    marian_to_ours = np.argsort(self.ours_to_marian)
    self._piece_to_id = {p: int(marian_to_ours[i]) for p, i in vocab.items()}
    self._id_to_piece = {i: p for p, i in self._piece_to_id.items()}

  @classmethod
  def load(cls, path: str) -> 'MarianTokenizer':
    """From a workdir (its ``marian_tokenizer/``) or the folder itself."""
    inside = os.path.join(path, DIRNAME)
    return cls(inside if os.path.isdir(inside) else path)

  from_files = load

  def save(self, workdir: str) -> str:
    """Copies the three files to ``workdir/marian_tokenizer/``; returns it."""
    out = os.path.join(workdir, DIRNAME)
    if os.path.abspath(out) == self.directory:
      return out
    tmp = out + '.tmp'
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in FILES:
      shutil.copyfile(os.path.join(self.directory, name),
                      os.path.join(tmp, name))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    self.directory = os.path.abspath(out)
    return out

  @property
  def vocab_size(self) -> int:
    return len(self._piece_to_id)

  def _encode(self, sp, text: str) -> list[int]:
    code = []
    if text.startswith('>>') and (end := text.find('<<')) != -1:
      code, text = [text[:end + 2]], text[end + 2:]
    pieces = code + sp.encode(text, out_type=str)
    return [self._piece_to_id.get(p, UNK) for p in pieces]

  def encode(self, text: str) -> list[int]:
    """Source-side ids of ``text`` (``source.spm``), without EOS."""
    return self._encode(self._source, text)

  def encode_target(self, text: str) -> list[int]:
    """Target-side ids of ``text`` (``target.spm``), without EOS."""
    return self._encode(self._target, text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode_target(t) for t in texts]

  def decode(self, ids) -> str:
    """Target text of ``ids`` up to the first EOS, special tokens dropped;
    accepts numpy."""
    ids = np.asarray(ids).reshape(-1).tolist()
    if EOS in ids:
      ids = ids[:ids.index(EOS)]
    pieces = [self._id_to_piece[i] for i in ids if i not in (PAD, UNK)]
    return self._target.decode_pieces(pieces).replace('\u2581', ' ').strip()

  def id_to_piece(self, i: int) -> str:
    return self._id_to_piece[int(i)]
