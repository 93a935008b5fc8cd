"""SentencePiece tokenizer: reserved ids, round trips, save/load."""
import os
import random

import numpy as np
import pytest

from xfmr_jax.data import toy_language
from xfmr_jax.tokenizer import EOS, PAD, UNK, Tokenizer

GENERAL = ['Der schnelle braune Fuchs springt über den faulen Hund.',
           'The quick brown fox jumps over the lazy dog.',
           'Größe, Übermaß und Spaß: 3,5 % mehr „Qualität“!']


def _toy_texts(n=2000, seed=0):
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    src, tgt, _ = toy_language.LANGUAGE.pair(toy_language.LANGUAGE.sample(rng))
    out += [src, tgt]
  return out


@pytest.fixture(scope='module')
def toy_texts():
  return _toy_texts()


@pytest.fixture(scope='module', params=['bpe', 'unigram'])
def tok(request, toy_texts, tmp_path_factory):
  workdir = tmp_path_factory.mktemp(request.param)
  return Tokenizer.train(toy_texts + GENERAL * 20, str(workdir),
                         vocab_size=600, model_type=request.param), workdir


def test_reserved_ids(tok):
  tok, _ = tok
  assert (PAD, EOS, UNK) == (0, 1, 2)
  assert [tok.id_to_piece(i) for i in range(3)] == ['<pad>', '</s>', '<unk>']
  assert 100 < tok.vocab_size <= 600
  ids = tok.encode('bla bla')
  assert ids and PAD not in ids and EOS not in ids  # encode adds no EOS


def test_round_trip(tok):
  tok, _ = tok
  texts = _toy_texts(200, seed=1) + GENERAL
  for text in texts:
    assert tok.decode(tok.encode(text)) == text


def test_decode_stops_at_eos_and_drops_pad(tok):
  tok, _ = tok
  ids = tok.encode(GENERAL[1])
  assert tok.decode([PAD] + ids + [EOS] + tok.encode('more')) == GENERAL[1]
  assert tok.decode(np.array(ids + [EOS, PAD, PAD], np.int32)) == GENERAL[1]
  assert tok.decode([EOS] + ids) == ''


def test_saved_in_workdir_and_loaded(tok):
  tok, workdir = tok
  path = os.path.join(workdir, 'tokenizer.model')
  assert os.path.exists(path)
  for loaded in (Tokenizer.load(path), Tokenizer.load(str(workdir))):
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.encode(GENERAL[2]) == tok.encode(GENERAL[2])


def test_toy_words_are_few_pieces(toy_texts):
  tok = Tokenizer.train(toy_texts, None, vocab_size=1000)
  words = sum(len(t.split()) for t in toy_texts[:400])
  pieces = sum(len(tok.encode(t)) for t in toy_texts[:400])
  assert pieces / words < 1.6


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match='model_type'):
    Tokenizer.train(['a b'], None, model_type='word')
  with pytest.raises(ValueError, match='no training text'):
    Tokenizer.train([], None)
  with pytest.raises(FileNotFoundError, match='no tokenizer model'):
    Tokenizer.load(str(tmp_path / 'missing.model'))
