"""The requests of :mod:`xfmr_jax.service`: reading and checking them.

A body is a JSON object; every field but ``texts`` is optional::

    {"texts": ["...", ...],          # the sentences (or documents)
     "beam_size": 4,                 # one the service offers
     "document": false, "language": "en",
     "num_hypotheses": 0,            # > 0: n-best lists with scores
     "prefixes": ["..." | null, ...],            # per text
     "constraints": [["phrase", ...] | null, ...],  # per text
     "no_repeat_ngram_size": 0, "repetition_penalty": 1.0,
     "alignments": false, "alignment_layer": null}

The fields after ``language`` change the search, so they need a translator
that decodes them (a training workdir's; :mod:`xfmr_jax.workdir_translator`);
an exported artifact runs the plain search only. So does ``/score``'s
``{"sources": [...], "targets": [...]}``. Needs no model code.
"""
from __future__ import annotations

import json
from typing import NamedTuple, Sequence

# The fields that need a translator which decodes them (``options``).
OPTION_FIELDS = ('num_hypotheses', 'prefixes', 'constraints',
                 'no_repeat_ngram_size', 'repetition_penalty', 'alignments',
                 'alignment_layer')
FIELDS = ('texts', 'beam_size', 'document', 'language') + OPTION_FIELDS
# ``POST /score``: given translations' log-probabilities, which needs a
# translator that has ``SCORE`` among its options.
SCORE = 'score'
SCORE_FIELDS = ('sources', 'targets')


_NEEDS_WORKDIR = ('needs a service that decodes it: this one runs an exported '
                  'artifact, which holds the plain search only; serve a '
                  'training workdir (python -m experiments.serve '
                  '--workdir=DIR)')


class RequestError(Exception):
  """A bad request: its HTTP status and a message for the client."""

  def __init__(self, status: int, message: str, headers: dict | None = None):
    super().__init__(message)
    self.status, self.headers = status, headers


class Options(NamedTuple):
  """A request's settings for its whole batch (part of the batch key).

  ``num_hypotheses`` 0 asks for plain translations; ``alignment_layer``
  None is the default layer."""
  num_hypotheses: int = 0
  no_repeat_ngram_size: int = 0
  repetition_penalty: float = 1.0
  alignments: bool = False
  alignment_layer: int | None = None


PLAIN = Options()


class Job(NamedTuple):
  """One sentence to decode: source ids with EOS, and its checked target
  prefix ids and constraint phrases (id lists; None: none)."""
  ids: list[int]
  prefix: list[int] | None = None
  constraints: list[list[int]] | None = None


class TranslateRequest(NamedTuple):
  """A checked ``/translate`` body (``prefixes``/``constraints``: None when
  not given)."""
  texts: list[str]
  beam_size: int
  document: bool
  language: str
  options: Options
  prefixes: list[str | None] | None
  constraints: list[list[str] | None] | None


async def read_body(request, limit: int) -> bytes:
  """The body of a Starlette request, or a 400/413 RequestError."""
  declared = request.headers.get('content-length')
  if declared is not None:
    if not declared.isdigit():
      raise RequestError(400, f'bad Content-Length {declared!r}')
    if int(declared) > limit:
      raise RequestError(413, f'body of {declared} bytes; the limit is {limit}')
  chunks, size = [], 0
  async for chunk in request.stream():  # also caps bodies sent chunked
    size += len(chunk)
    if size > limit:
      raise RequestError(413, f'body over the limit of {limit} bytes')
    chunks.append(chunk)
  return b''.join(chunks)


def _json_object(body: bytes, fields: Sequence[str] = FIELDS) -> dict:
  try:
    text = body.decode('utf-8')
  except UnicodeDecodeError as e:
    raise RequestError(400, f'body is not valid UTF-8 ({e.reason} at byte '
                            f'{e.start})') from None
  try:
    request = json.loads(text)
  except json.JSONDecodeError as e:
    raise RequestError(400, f'body is not JSON: {e}') from None
  if not isinstance(request, dict):
    raise RequestError(422, 'body must be a JSON object like '
                            '{"texts": ["..."], "beam_size": 4}')
  unknown = sorted(set(request) - set(fields))
  if unknown:
    raise RequestError(422, f'unknown field {unknown[0]!r}; the fields are '
                            f'{list(fields)}')
  return request


def _strings(value, name: str, max_chars: int, nullable: bool = False):
  """``value`` checked as a list of strings (or nulls where ``nullable``)."""
  if not isinstance(value, list):
    raise RequestError(422, f'"{name}" must be a list of strings')
  for i, t in enumerate(value):
    if t is None and nullable:
      continue
    if not isinstance(t, str):
      raise RequestError(422, f'{name}[{i}] is {type(t).__name__}, not a '
                              'string')
    if len(t) > max_chars:
      raise RequestError(413, f'{name}[{i}] has {len(t)} characters; the '
                              f'limit is {max_chars}')
    try:
      t.encode('utf-8')
    except UnicodeEncodeError:  # a lone surrogate escaped in the JSON
      raise RequestError(422, f'{name}[{i}] is not valid Unicode') from None
  return value


def _per_text(request: dict, name: str, count: int, max_chars: int):
  """A per-text list field (None when absent): prefixes are strings or null,
  constraints lists of strings or null."""
  value = request.get(name)
  if value is None:
    return None
  if not isinstance(value, list) or len(value) != count:
    raise RequestError(422, f'"{name}" must be a list with one entry per '
                            f'text ({count})')
  if name == 'prefixes':
    return _strings(value, name, max_chars, nullable=True)
  return [None if v is None else _strings(v, f'{name}[{i}]', max_chars)
          for i, v in enumerate(value)]


def _options(request: dict, beam_size: int) -> Options:
  n = request.get('num_hypotheses', 0)
  if type(n) is not int or not 0 <= n <= beam_size:  # no bools
    raise RequestError(422, f'num_hypotheses must be an int from 0 (plain '
                            f'translations) to the beam size {beam_size}, got '
                            f'{n!r}')
  ngram = request.get('no_repeat_ngram_size', 0)
  if type(ngram) is not int or ngram < 0:
    raise RequestError(422, 'no_repeat_ngram_size must be an int >= 0 (0: '
                            f'off), got {ngram!r}')
  penalty = request.get('repetition_penalty', 1.0)
  if type(penalty) not in (int, float) or not 0 < penalty < float('inf'):
    raise RequestError(422, 'repetition_penalty must be a number > 0 (1: '
                            f'off), got {penalty!r}')
  alignments = request.get('alignments', False)
  if not isinstance(alignments, bool):
    raise RequestError(422, f'alignments must be true or false, got '
                            f'{alignments!r}')
  layer = request.get('alignment_layer')
  if layer is not None and type(layer) is not int:
    raise RequestError(422, f'alignment_layer must be an int, got {layer!r}')
  if n and alignments:
    raise RequestError(422, 'alignments come with plain translations, not '
                            'with num_hypotheses')
  return Options(n, ngram, float(penalty), alignments, layer)


def parse_request(body: bytes, *, beam_sizes: Sequence[int], max_texts: int,
                  max_chars: int, options: frozenset = frozenset()
                  ) -> TranslateRequest:
  """The :class:`TranslateRequest` of a ``/translate`` body, or a
  RequestError. ``options``: the :data:`OPTION_FIELDS` the translator
  decodes (none: an exported artifact's plain search)."""
  request = _json_object(body)
  absent = [f for f in OPTION_FIELDS if f in request and f not in options]
  if absent:
    raise RequestError(422, f'{absent[0]} {_NEEDS_WORKDIR}')
  texts = _strings(request.get('texts'), 'texts', max_chars)
  if len(texts) > max_texts:
    raise RequestError(413, f'{len(texts)} texts; at most {max_texts} per '
                            'request')
  beam_size = request.get('beam_size', beam_sizes[0])
  if type(beam_size) is not int or beam_size not in beam_sizes:  # no bools
    raise RequestError(422, f'beam_size must be one of {list(beam_sizes)}, '
                            f'got {beam_size!r}')
  document = request.get('document', False)
  if not isinstance(document, bool):
    raise RequestError(422, f'document must be true or false, got '
                            f'{document!r}')
  language = request.get('language', 'en')
  if not (isinstance(language, str) and language.isascii() and
          0 < len(language) <= 16):
    raise RequestError(422, 'language must be a language code such as "en", '
                            f'got {language!r}')
  asked = TranslateRequest(
      texts, beam_size, document, language, _options(request, beam_size),
      _per_text(request, 'prefixes', len(texts), max_chars),
      _per_text(request, 'constraints', len(texts), max_chars))
  if document and (asked.options.num_hypotheses or asked.options.alignments
                   or asked.prefixes or asked.constraints):
    raise RequestError(422, 'a document request takes beam_size and '
                            'anti-repetition; n-best lists, prefixes, '
                            'constraints and alignments are per sentence')
  return asked


def parse_score_request(body: bytes, *, max_texts: int, max_chars: int,
                        options: frozenset = frozenset()
                        ) -> tuple[list[str], list[str]]:
  """The sources and targets of a ``/score`` body
  (``{"sources": [...], "targets": [...]}``, as many of each), or a
  RequestError."""
  request = _json_object(body, SCORE_FIELDS)
  if SCORE not in options:
    raise RequestError(422, f'scoring {_NEEDS_WORKDIR}')
  sources = _strings(request.get('sources'), 'sources', max_chars)
  targets = _strings(request.get('targets'), 'targets', max_chars)
  if len(sources) != len(targets):
    raise RequestError(422, f'{len(sources)} sources but {len(targets)} '
                            'targets: give one target per source')
  if len(sources) > max_texts:
    raise RequestError(413, f'{len(sources)} pairs; at most {max_texts} per '
                            'request')
  return sources, targets
