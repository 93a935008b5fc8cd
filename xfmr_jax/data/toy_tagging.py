"""Toy token labelling: tag each source word of `toy_translate` with its role.

A task for an encoder-only (BERT-style) model with a per-token head. The text
is the SOURCE side of the toy translation pairs; each word's tag is its
syntactic role in the tree that `toy_language.LANGUAGE.parse` recovers (no new
grammar: the tags are read off the parser's tree and the renderer's word
order). Tag ids are ``TAGS.index(tag) + 1``; id 0 means "ignore" (padding and
EOS). The rule, per word of ``CLAUSE [CONJ CLAUSE]``:

  subj  every word of a clause's subject NP: pronoun, or DET ADJ* NOUN[s]
  verb  a main clause's auxiliary and verb
  obj   every word of a main clause's object NP: DET ADJ* NOUN[s]
  pp    the preposition and every word of its NP
  rel   every word of a relative clause, in whichever NP: 'that', its
        auxiliary and verb, its object NP (the head noun before 'that' keeps
        the tag of its own NP)
  conj  the conjunction between the two clauses

e.g. (glossed) ``the big dog that saw a cat will chase the man with the stick``
-> subj subj subj rel rel rel rel verb verb obj obj pp pp pp.

Why this needs context: the same det/adj/noun is 'subj', 'obj', 'pp' or 'rel'
depending on where it stands, and a verb is 'verb' or 'rel'; where a relative
clause ends depends on whether its verb is transitive. Only the pronouns
(always subjects here), prepositions, conjunctions and 'that' are fixed by the
word alone.

    ids, tags = encode_tagged(text, tokenizer)      # int32 [n], int32 [n]
    for batch in make_tagging_batches(src, tokenizer, batch_size=64,
                                      max_length=64, repeat=True, seed=0):
      batch['inputs'], batch['targets']              # int32 [64, 64] each
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from xfmr_jax.data.pipeline import read_pairs
from xfmr_jax.data.toy_language import LANGUAGE, Sentence
from xfmr_jax.tokenizer import EOS, Tokenizer

log = logging.getLogger(__name__)

TAGS = ('subj', 'verb', 'obj', 'pp', 'rel', 'conj')
TAG_ID = {t: i + 1 for i, t in enumerate(TAGS)}  # 0: padding / ignored
NUM_CLASSES = len(TAGS) + 1  # size of a head's output, id 0 included
READ_CHUNK = 256  # pairs per batched read of the source


def _node_tags(sentence: Sentence) -> dict:
  """``{id(NP or Clause): tag}`` for every node of the tree.

  `render_source` keys each word by ``(id(node), part)``, so a word's tag is
  its node's tag, except the relativizer and preposition (see `_word_tag`).
  """
  tags = {}

  def mark_np(np_, tag):
    tags[id(np_)] = tag
    if np_.rc is not None:
      mark_clause(np_.rc, relative=True)

  def mark_clause(c, relative=False):
    tags[id(c)] = 'rel' if relative else 'verb'  # its aux and verb
    if c.subj is not None:  # None in a relative clause
      mark_np(c.subj, 'subj')
    if c.obj is not None:
      mark_np(c.obj, 'rel' if relative else 'obj')
    if c.pp is not None:  # never in a relative clause
      mark_np(c.pp[1], 'pp')

  for c in sentence.clauses:
    mark_clause(c)
  return tags


def _word_tag(key, node_tags: dict) -> str:
  if key == ('conj',):
    return 'conj'
  if key[1] == 'rc':      # 'that' is keyed by its head NP, but opens the RC
    return 'rel'
  if key[1] == 'prep':    # the preposition is keyed by its clause
    return 'pp'
  return node_tags[key[0]]


def tag_words(text: str) -> list[tuple[str, str]]:
  """``[(word, tag)]`` for each whitespace-separated word of a source sentence.

  Raises ValueError (saying which word) if ``text`` is not a sentence of the
  toy source language, e.g. target-language text or a reversed dataset.
  """
  try:
    tree = LANGUAGE.parse(text)
  except ValueError as e:
    raise ValueError(f'cannot tag: not a toy source sentence: {e}') from None
  node_tags = _node_tags(tree)  # keyed by id(): ``tree`` must stay alive
  rendered = LANGUAGE.render_source(tree)
  words = text.split()
  # The parser inverts the renderer, so the words line up one to one.
  assert [w for w, _ in rendered] == words, (rendered, words)
  return [(w, _word_tag(key, node_tags)) for w, key in rendered]


def encode_tagged(text: str, tokenizer: Tokenizer) -> tuple[np.ndarray,
                                                              np.ndarray]:
  """SentencePiece ids of a source sentence and the tag id of every piece.

  Returns ``(ids, tags)``, int32 ``[n]`` each, where n = pieces + 1: the ids
  end in EOS, as in the translation pipeline, and EOS gets tag id 0 (ignored:
  it has no word, and a free label would only inflate accuracy). Words are
  encoded one by one so that no piece spans two words; SentencePiece splits at
  whitespace anyway, so for single-spaced text the ids equal
  ``tokenizer.encode(text)``.
  """
  pairs = tag_words(text)
  pieces = tokenizer.encode_batch([w for w, _ in pairs])
  ids = [i for p in pieces for i in p] + [EOS]
  tags = [TAG_ID[t] for p, (_, t) in zip(pieces, pairs) for _ in p] + [0]
  return np.asarray(ids, np.int32), np.asarray(tags, np.int32)


def make_tagging_batches(source, tokenizer: Tokenizer, *, batch_size: int,
                         max_length: int,
                         indices: Optional[Sequence[int]] = None,
                         repeat: bool = False,
                         seed: int = 0) -> Iterator[dict]:
  """Yields ``{'inputs', 'targets'}``, int32 ``[batch_size, max_length]``.

  One sentence per row, 0-padded on the right; ``targets`` are the tag ids of
  ``inputs`` (0 on EOS and padding, so a loss masks ``targets > 0``).

  Args:
    source: random-access ``(source_text, target_text)`` pairs (`get_source`);
      only the source text is used.
    tokenizer: the shared vocabulary.
    batch_size, max_length: rows per batch and tokens per row (EOS included).
      Longer sentences are skipped, not truncated (a cut sentence is not in
      the language); their count is logged as a warning after the first pass.
    indices: the pairs to use (default all), in this order when not repeating.
    repeat: cycle forever, reshuffling every epoch from ``seed`` (same seed,
      same batches); rows run on across epoch boundaries. Otherwise one pass
      in order, the last batch filled up with all-zero rows.
    seed: shuffling seed (used only with ``repeat``).
  """
  indices = list(range(len(source)) if indices is None else indices)
  if not indices:
    raise ValueError('no sentences to tag')
  rng = np.random.default_rng(seed)
  cache = {}  # index -> (ids, tags): with repeat, later epochs parse nothing

  def examples(order, warn):
    skipped = 0
    for start in range(0, len(order), READ_CHUNK):
      chunk = [int(i) for i in order[start:start + READ_CHUNK]]
      if not repeat:
        cache.clear()  # one pass: keep memory flat
      new = [i for i in dict.fromkeys(chunk) if i not in cache]
      for i, (text, _) in zip(new, read_pairs(source, new) if new else []):
        cache[i] = encode_tagged(text, tokenizer)
      for i in chunk:
        if len(cache[i][0]) > max_length:
          skipped += 1
        else:
          yield cache[i]
    if repeat and skipped == len(order):  # else an endless empty loop
      raise ValueError(f'all {skipped} sentences are longer than '
                       f'max_length={max_length} tokens')
    if skipped and warn:
      log.warning('tagging: skipped %d of %d sentences longer than '
                  'max_length=%d tokens', skipped, len(order), max_length)

  def stream():
    if not repeat:
      yield from examples(indices, warn=True)
      return
    epoch = 0
    while True:  # the same sentences are skipped every epoch: warn once
      yield from examples(rng.permutation(indices), warn=epoch == 0)
      epoch += 1

  inputs = np.zeros((batch_size, max_length), np.int32)
  targets = np.zeros_like(inputs)
  row = 0
  for ids, tags in stream():
    inputs[row, :len(ids)], targets[row, :len(tags)] = ids, tags
    row += 1
    if row == batch_size:
      yield {'inputs': inputs, 'targets': targets}
      inputs, targets = np.zeros_like(inputs), np.zeros_like(targets)
      row = 0
  if row:  # only without repeat: the last, part-filled batch
    yield {'inputs': inputs, 'targets': targets}


def majority_baseline(batches: Iterable[dict]) -> float:
  """Accuracy of always predicting the most frequent tag, over targets > 0.

  ``batches`` must be finite (e.g. ``make_tagging_batches(..., repeat=False)``).
  This is the "chance" level a tagger has to beat.
  """
  counts = np.zeros(NUM_CLASSES, np.int64)
  for batch in batches:
    counts += np.bincount(np.asarray(batch['targets']).ravel(),
                          minlength=NUM_CLASSES)[:NUM_CLASSES]
  if not counts[1:].sum():
    raise ValueError('no tagged tokens in the batches')
  return float(counts[1:].max() / counts[1:].sum())
