"""A synthetic language pair whose translation needs attention, not copying.

The source language is English-like (SVO, prepositions, adjectives before the
noun, relative clauses after it). The target language is Japanese/Turkish-like
(SOV, case particles, postpositions, adjectives after the noun, relative clauses
before it). Each language has its own made-up lexicon of a few hundred
lowercase ASCII words. The rules, all deterministic:

  source clause   SUBJ [AUX] VERB [OBJ] [PREP NP]
  target clause   SUBJ ne [NP POSTP] [OBJ du] VERB+TENSE+AGREEMENT
  source NP       DET ADJ1 ADJ2 NOUN[s] [that [AUX] VERB [NP]]    or PRONOUN
  target NP       [[NP du] VERB+TENSE+AGREEMENT ki] NOUN[ye] ADJ2 ADJ1 DET
  sentence        CLAUSE [CONJ CLAUSE]            (same order in both)

AUX is empty (present), a past or a future auxiliary; in the target the tense
is a verb suffix. The target verb agrees in person and number with its subject
(the head noun, for a relative clause), which in the source can be many words
away. A source plural noun ends in ``s``; a target plural noun ends in ``ye``.

`ToyLanguage.sample` draws a parse tree, `render_source`/`render_target` spell
it out (with a word alignment), and `reference_translation` parses a source
sentence and translates it, so tests and demos can check any output.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Optional

# Lexicon sizes (entries per category; the same in both languages).
SIZES = dict(noun=120, verb_t=40, verb_i=20, adj=40, det=5, prep=8, conj=3)
NUM_PERSONS = 6  # pronouns: 1sg 2sg 3sg 1pl 2pl 3pl
PRESENT, PAST, FUTURE = 0, 1, 2

# Target inflections and particles.
PLURAL_SUFFIX = 'ye'
TENSE_SUFFIX = ('', 'ta', 'zo')
AGREEMENT_SUFFIX = ('mu', 'ku', 'a', 'min', 'kin', 'nar')  # by person/number
SUBJECT, OBJECT, LINKER = 'ne', 'du', 'ki'
RELATIVIZER = 'that'
SOURCE_PLURAL = 's'

_SOURCE_ONSETS = ('b', 'd', 'f', 'g', 'l', 'p', 'v', 'w',
                  'br', 'gl', 'pl', 'dr')
_SOURCE_VOWELS = ('a', 'e', 'i', 'o')
_SOURCE_CODAS = ('l', 'p', 'g', 'd')
_TARGET_ONSETS = ('k', 'h', 'm', 'n', 'r', 't', 'y', 'z', 'ch', 'sh')
_TARGET_VOWELS = ('a', 'i', 'u', 'o')


@dataclasses.dataclass
class NP:
  """A noun phrase: a pronoun (``pron``: person index) or DET ADJ* NOUN [RC]."""
  pron: Optional[int] = None
  det: int = 0
  adjs: tuple = ()
  noun: int = 0
  plural: bool = False
  rc: Optional['Clause'] = None  # a subject relative clause (its subj is None)

  @property
  def person(self) -> int:
    """Agreement index 0..5 (1sg 2sg 3sg 1pl 2pl 3pl)."""
    return self.pron if self.pron is not None else 2 + 3 * self.plural


@dataclasses.dataclass
class Clause:
  subj: Optional[NP]  # None in a relative clause: the head noun is the subject
  tense: int
  verb: int           # into lexicon 'verb'; the first verb_t are transitive
  obj: Optional[NP] = None
  pp: Optional[tuple] = None  # (preposition index, NP)


@dataclasses.dataclass
class Sentence:
  clauses: list
  conj: Optional[int] = None


class ToyLanguage:
  """The lexicon (deterministic from ``lexicon_seed``) and the grammar."""

  def __init__(self, lexicon_seed: int = 0):
    rng = random.Random(lexicon_seed)
    used = {RELATIVIZER, SUBJECT, OBJECT, LINKER}
    self.src, self.tgt = {}, {}
    # Function words first so they are short.
    for cat, n in [('aux', 2), ('pron', NUM_PERSONS), ('det', SIZES['det']),
                   ('prep', SIZES['prep']), ('conj', SIZES['conj']),
                   ('noun', SIZES['noun']), ('adj', SIZES['adj']),
                   ('verb', SIZES['verb_t'] + SIZES['verb_i'])]:
      short = cat in ('aux', 'pron', 'det', 'prep', 'conj')
      self.src[cat] = [self._new_word(rng, used, 'src', short,
                                      plural=cat == 'noun') for _ in range(n)]
      self.tgt[cat] = [self._new_word(rng, used, 'tgt', short,
                                      plural=cat == 'noun', verb=cat == 'verb')
                       for _ in range(n)]
    self.num_transitive = SIZES['verb_t']
    # Source surface form -> (category, index, plural) for the parser.
    self.src_lookup = {}
    for cat, words in self.src.items():
      for i, w in enumerate(words):
        self.src_lookup[w] = (cat, i, False)
        if cat == 'noun':
          self.src_lookup[w + SOURCE_PLURAL] = (cat, i, True)
    self.src_lookup[RELATIVIZER] = ('that', 0, False)

  @staticmethod
  def _new_word(rng, used, side, short, plural=False, verb=False):
    """A fresh pronounceable word none of whose inflected forms is taken."""
    while True:
      if side == 'src':
        n = 1 if short else rng.choice((2, 2, 3))
        word = ''.join(rng.choice(_SOURCE_ONSETS) + rng.choice(_SOURCE_VOWELS)
                       for _ in range(n))
        if short or rng.random() < 0.3:
          word += rng.choice(_SOURCE_CODAS)
        forms = [word] + ([word + SOURCE_PLURAL] if plural else [])
      else:
        n = rng.choice((1, 2)) if short else rng.choice((2, 2, 3))
        word = ''.join(rng.choice(_TARGET_ONSETS) + rng.choice(_TARGET_VOWELS)
                       for _ in range(n))
        forms = [word] + ([word + PLURAL_SUFFIX] if plural else [])
        if verb:
          forms = [word + t + a for t in TENSE_SUFFIX for a in AGREEMENT_SUFFIX]
      if len(word) >= 2 and not any(f in used for f in forms):
        used.update(forms)
        return word

  # ---------------------------------------------------------------- sampling
  def sample(self, rng: random.Random, long: bool = False) -> Sentence:
    """Draws a parse tree; ``long`` makes optional parts likelier."""
    clauses = [self._clause(rng, long)]
    conj = None
    if rng.random() < (0.95 if long else 0.5):
      conj = rng.randrange(SIZES['conj'])
      clauses.append(self._clause(rng, long))
    return Sentence(clauses, conj)

  def _clause(self, rng, long, relative=False):
    transitive = rng.random() < 0.7
    verb = (rng.randrange(self.num_transitive) if transitive else
            self.num_transitive + rng.randrange(SIZES['verb_i']))
    tense = rng.choice((PRESENT, PRESENT, PAST, FUTURE))
    if relative:  # no PP and no nested relative clause: keeps parsing unique
      obj = self._np(rng, long, allow_rc=False) if transitive else None
      return Clause(None, tense, verb, obj)
    subj = self._np(rng, long, allow_rc=True, allow_pron=True)
    obj = self._np(rng, long, allow_rc=True) if transitive else None
    pp = None
    if rng.random() < (0.7 if long else 0.45):
      pp = (rng.randrange(SIZES['prep']), self._np(rng, long, allow_rc=True))
    return Clause(subj, tense, verb, obj, pp)

  def _np(self, rng, long, allow_rc, allow_pron=False):
    if allow_pron and rng.random() < 0.2:
      return NP(pron=rng.randrange(NUM_PERSONS))
    r = rng.random()
    n_adj = 0 if r < (0.3 if long else 0.45) else 1 if r < 0.8 else 2
    adjs = tuple(rng.sample(range(SIZES['adj']), n_adj))  # distinct
    rc = None
    if allow_rc and rng.random() < (0.35 if long else 0.15):
      rc = self._clause(rng, long, relative=True)
    return NP(None, rng.randrange(SIZES['det']), adjs,
              rng.randrange(SIZES['noun']), rng.random() < 0.35, rc)

  # --------------------------------------------------------------- rendering
  # Both renderers return [(word, key)]; equal keys mark aligned words (the
  # same lexical item), key None marks target particles with no source word.
  def render_source(self, s: Sentence) -> list:
    out = self._src_clause(s.clauses[0])
    if s.conj is not None:
      out += [(self.src['conj'][s.conj], ('conj',))]
      out += self._src_clause(s.clauses[1])
    return out

  def _src_clause(self, c: Clause) -> list:
    out = self._src_np(c.subj) if c.subj is not None else []
    if c.tense != PRESENT:
      out.append((self.src['aux'][c.tense - 1], (id(c), 'verb')))
    out.append((self.src['verb'][c.verb], (id(c), 'verb')))
    if c.obj is not None:
      out += self._src_np(c.obj)
    if c.pp is not None:
      out.append((self.src['prep'][c.pp[0]], (id(c), 'prep')))
      out += self._src_np(c.pp[1])
    return out

  def _src_np(self, np_: NP) -> list:
    if np_.pron is not None:
      return [(self.src['pron'][np_.pron], (id(np_), 'pron'))]
    out = [(self.src['det'][np_.det], (id(np_), 'det'))]
    out += [(self.src['adj'][a], (id(np_), 'adj', k))
            for k, a in enumerate(np_.adjs)]
    noun = self.src['noun'][np_.noun] + (SOURCE_PLURAL if np_.plural else '')
    out.append((noun, (id(np_), 'noun')))
    if np_.rc is not None:
      out.append((RELATIVIZER, (id(np_), 'rc')))
      out += self._src_clause(np_.rc)
    return out

  def render_target(self, s: Sentence) -> list:
    out = self._tgt_clause(s.clauses[0])
    if s.conj is not None:
      out += [(self.tgt['conj'][s.conj], ('conj',))]
      out += self._tgt_clause(s.clauses[1])
    return out

  def _tgt_verb(self, c: Clause, person: int):
    word = (self.tgt['verb'][c.verb] + TENSE_SUFFIX[c.tense] +
            AGREEMENT_SUFFIX[person])
    return (word, (id(c), 'verb'))

  def _tgt_clause(self, c: Clause) -> list:
    out = self._tgt_np(c.subj) + [(SUBJECT, None)]
    if c.pp is not None:
      out += self._tgt_np(c.pp[1])
      out.append((self.tgt['prep'][c.pp[0]], (id(c), 'prep')))
    if c.obj is not None:
      out += self._tgt_np(c.obj) + [(OBJECT, None)]
    out.append(self._tgt_verb(c, c.subj.person))
    return out

  def _tgt_np(self, np_: NP) -> list:
    if np_.pron is not None:
      return [(self.tgt['pron'][np_.pron], (id(np_), 'pron'))]
    out = []
    if np_.rc is not None:  # the relative clause precedes its head noun
      if np_.rc.obj is not None:
        out += self._tgt_np(np_.rc.obj) + [(OBJECT, None)]
      out.append(self._tgt_verb(np_.rc, np_.person))
      out.append((LINKER, (id(np_), 'rc')))
    noun = self.tgt['noun'][np_.noun] + (PLURAL_SUFFIX if np_.plural else '')
    out.append((noun, (id(np_), 'noun')))
    out += [(self.tgt['adj'][a], (id(np_), 'adj', k))
            for k, a in reversed(list(enumerate(np_.adjs)))]
    out.append((self.tgt['det'][np_.det], (id(np_), 'det')))
    return out

  def pair(self, s: Sentence):
    """Returns (source text, target text, alignment [(src_i, tgt_j), ...])."""
    src, tgt = self.render_source(s), self.render_target(s)
    where = {}
    for i, (_, key) in enumerate(src):
      where.setdefault(key, []).append(i)
    alignment = [(i, j) for j, (_, key) in enumerate(tgt) if key is not None
                 for i in where[key]]
    return (' '.join(w for w, _ in src), ' '.join(w for w, _ in tgt),
            alignment)

  # ----------------------------------------------------------------- parsing
  def parse(self, text: str) -> Sentence:
    """Parses a source sentence (inverse of `render_source`); ValueError if not
    in the language."""
    words = text.split()
    for w in words:
      if w not in self.src_lookup:
        raise ValueError(f'{w!r} is not a source-language word')
    toks = [self.src_lookup[w] for w in words]
    pos = [0]

    def peek():
      return toks[pos[0]][0] if pos[0] < len(toks) else None

    def take(*cats):
      if peek() not in cats:
        where = words[pos[0]] if pos[0] < len(toks) else 'end of sentence'
        raise ValueError(f'expected {"/".join(cats)} at word {pos[0]} '
                         f'({where!r}) in {text!r}')
      pos[0] += 1
      return toks[pos[0] - 1]

    def np_(allow_rc):
      if peek() == 'pron':
        return NP(pron=take('pron')[1])
      det = take('det')[1]
      adjs = []
      while peek() == 'adj':
        adjs.append(take('adj')[1])
      _, noun, plural = take('noun')
      rc = None
      if allow_rc and peek() == 'that':
        take('that')
        rc = clause(None, relative=True)
      return NP(None, det, tuple(adjs), noun, plural, rc)

    def clause(subj, relative=False):
      tense = take('aux')[1] + 1 if peek() == 'aux' else PRESENT
      verb = take('verb')[1]
      obj = np_(not relative) if verb < self.num_transitive else None
      pp = None
      if not relative and peek() == 'prep':
        pp = (take('prep')[1], np_(True))
      return Clause(subj, tense, verb, obj, pp)

    clauses = [clause(np_(True))]
    conj = None
    if peek() == 'conj':
      conj = take('conj')[1]
      clauses.append(clause(np_(True)))
    if pos[0] != len(toks):
      raise ValueError(f'unexpected {words[pos[0]]!r} at word {pos[0]} '
                       f'in {text!r}')
    return Sentence(clauses, conj)


LANGUAGE = ToyLanguage()


def reference_translation(source: str) -> str:
  """The one correct target sentence for a source sentence."""
  return LANGUAGE.pair(LANGUAGE.parse(source))[1]


def is_monotonic(alignment) -> bool:
  """True if no two alignment links cross (i1 < i2 but j1 > j2)."""
  links = sorted(alignment, key=lambda ij: (ij[1], ij[0]))
  return all(a[0] <= b[0] for a, b in zip(links, links[1:]))
