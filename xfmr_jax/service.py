"""An HTTP JSON translation service around an exported translator.

    app = make_app(xfmr_jax.serving.load('artifact'))   # a Starlette app
    uvicorn.run(app, port=8000)       # python -m experiments.serve does this

Endpoints:

- ``GET /``: a page to type text into and translate it
  (:mod:`xfmr_jax.service_page`).
- ``POST /translate`` with ``{"texts": [str, ...], "beam_size": int}``
  (``beam_size`` optional: one the artifact exported) answers
  ``{"translations": [str, ...], "beam_size": int}`` in the same order; a
  blank text gives ''. With ``"document": true`` each text is a whole
  document, cut into sentences by the rules of ``"language"`` (default
  "en") and answered with its layout kept (:mod:`xfmr_jax.documents`; a
  sentence too long for the model is cut into parts, not refused).
- ``GET /health``: ``{"status": "ok", ...}`` with the artifact's settings.
- ``GET /metrics``: request counts by status, texts, batches and their mean
  size, the queue, latency percentiles (ms) over the last 10,000 requests;
  in Prometheus' text format for ``?format=prometheus`` or an Accept header
  that prefers text/plain (as Prometheus' scraper sends).

Sentences of concurrent requests are batched dynamically: each goes to the
queue of its (beam size, source bucket), and one decoding thread takes the
queue whose oldest sentence has waited longest, once it holds ``max_batch``
sentences or its oldest has waited ``max_wait_ms``. With the default wait of 0
an idle decoder starts at once (no added latency at low load), and while it
decodes, the sentences that arrive queue up and form the next batch, so
batches grow with the load.

Limits: at most ``max_queue`` sentences wait (beyond: 503 and
``Retry-After``, from the decoder's mean time per sentence so far); a request not
answered within ``request_timeout_s`` gets 504; a client that disconnects has
its waiting sentences dropped (a sentence already in a running batch finishes
there and is discarded); with ``api_keys``, ``/translate`` and ``/metrics``
answer 401 without one (``/health`` stays open for load balancers).

Bad requests get a 4xx and ``{"error": message}``; the service keeps serving.
Needs starlette and prometheus_client (the ``serve`` extra; and an ASGI
server such as uvicorn to run it), no model code.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import math
import time
from typing import Callable, Hashable, NamedTuple, Sequence

from xfmr_jax import documents, service_page
from xfmr_jax.extras import require
from xfmr_jax.service_metrics import (PROMETHEUS_CONTENT_TYPE, Stats,
                                      prometheus_text, wants_prometheus)
from xfmr_jax.serving import ExportedTranslator, InputTooLong

_WHY = 'the HTTP service (xfmr_jax.service)'
Starlette = require('starlette.applications', _WHY).Starlette
Request = require('starlette.requests', _WHY).Request
JSONResponse = require('starlette.responses', _WHY).JSONResponse
Response = require('starlette.responses', _WHY).Response
HTMLResponse = require('starlette.responses', _WHY).HTMLResponse
ClientDisconnect = require('starlette.requests', _WHY).ClientDisconnect
Route = require('starlette.routing', _WHY).Route

FIELDS = ('texts', 'beam_size', 'document', 'language')


class RequestError(Exception):
  """A bad request: its HTTP status and a message for the client."""

  def __init__(self, status: int, message: str, headers: dict | None = None):
    super().__init__(message)
    self.status, self.headers = status, headers


class Batcher:
  """Groups single items into batches by key and runs them on one thread.

  Args:
    run_batch: ``(key, items) -> results`` (same length), run off the event
      loop on a single worker thread.
    max_batch: the most items per call.
    max_wait_s: how long the oldest item of a key waits for company.
  """

  def __init__(self, run_batch: Callable[[Hashable, list], Sequence],
               max_batch: int, max_wait_s: float):
    self._run_batch, self.max_batch, self.max_wait_s = (
        run_batch, max_batch, max_wait_s)
    self._pending: dict = {}   # key -> [(arrival, item, future), ...]
    self._wake = asyncio.Event()
    self._pool = concurrent.futures.ThreadPoolExecutor(1, 'decode')
    self._task = None
    self._closing = False
    self.batches = 0
    self.items = 0
    self.busy_s = 0.0   # time spent in run_batch

  def start(self) -> None:
    self._task = asyncio.get_running_loop().create_task(self._loop())

  async def close(self) -> None:
    """Finish everything queued, then stop the worker."""
    self._closing = True
    self._wake.set()
    if self._task is not None:
      await self._task
    self._pool.shutdown()

  @property
  def queued(self) -> int:
    return sum(len(group) for group in self._pending.values())

  def seconds_per_item(self) -> float:
    """Mean decoder time per item so far (0 before the first batch)."""
    return self.busy_s / self.items if self.items else 0.0

  async def submit(self, key: Hashable, item):
    """The result for ``item``, once its batch has run. Cancelled (its
    client gone or out of time) while it waits, the item leaves the queue
    and is never decoded."""
    future = asyncio.get_running_loop().create_future()
    entry = (time.monotonic(), item, future)
    self._pending.setdefault(key, []).append(entry)
    self._wake.set()
    try:
      return await future
    except asyncio.CancelledError:
      group = self._pending.get(key, [])
      for i, queued in enumerate(group):
        if queued is entry:
          del group[i]
          if not group:
            del self._pending[key]
          break
      raise

  async def _sleep_until_woken(self, timeout: float | None) -> None:
    self._wake.clear()
    with contextlib.suppress(asyncio.TimeoutError):
      await asyncio.wait_for(self._wake.wait(), timeout)

  async def _loop(self) -> None:
    loop = asyncio.get_running_loop()
    while True:
      if not self._pending:
        if self._closing:
          return
        await self._sleep_until_woken(None)
        continue
      key = min(self._pending, key=lambda k: self._pending[k][0][0])
      group = self._pending[key]
      wait = group[0][0] + self.max_wait_s - time.monotonic()
      if (len(group) < self.max_batch and wait > 0
          and not self._closing):
        await self._sleep_until_woken(wait)
        continue
      batch, group[:] = group[:self.max_batch], group[self.max_batch:]
      if not group:
        del self._pending[key]
      items = [item for _, item, _ in batch]
      started = time.monotonic()
      try:
        results = await loop.run_in_executor(self._pool, self._run_batch,
                                             key, items)
      except Exception as e:  # pylint: disable=broad-except
        for _, _, future in batch:
          if not future.done():
            future.set_exception(e)
        continue
      self.batches += 1
      self.items += len(items)
      self.busy_s += time.monotonic() - started
      for (_, _, future), result in zip(batch, results):
        if not future.done():  # its client may have gone
          future.set_result(result)


async def _read_body(request: Request, limit: int) -> bytes:
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


class TranslateRequest(NamedTuple):
  """A checked ``/translate`` body."""
  texts: list[str]
  beam_size: int
  document: bool
  language: str


def parse_request(body: bytes, *, beam_sizes: Sequence[int], max_texts: int,
                  max_chars: int) -> TranslateRequest:
  """The :class:`TranslateRequest` of a ``/translate`` body, or a
  RequestError."""
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
  unknown = sorted(set(request) - set(FIELDS))
  if unknown:
    raise RequestError(422, f'unknown field {unknown[0]!r}; the fields are '
                            f'{list(FIELDS)}')
  texts = request.get('texts')
  if not isinstance(texts, list):
    raise RequestError(422, '"texts" must be a list of strings')
  if len(texts) > max_texts:
    raise RequestError(413, f'{len(texts)} texts; at most {max_texts} per '
                            'request')
  for i, t in enumerate(texts):
    if not isinstance(t, str):
      raise RequestError(422, f'texts[{i}] is {type(t).__name__}, not a string')
    if len(t) > max_chars:
      raise RequestError(413, f'texts[{i}] has {len(t)} characters; the limit '
                              f'is {max_chars}')
    try:
      t.encode('utf-8')
    except UnicodeEncodeError:  # a lone surrogate escaped in the JSON
      raise RequestError(422, f'texts[{i}] is not valid Unicode') from None
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
  return TranslateRequest(texts, beam_size, document, language)


async def _client_gone(request: Request) -> None:
  """Returns when the client disconnects (the server's ``http.disconnect``,
  which comes once the body has been read and the connection drops)."""
  while (await request.receive())['type'] != 'http.disconnect':
    pass


def _api_key(request: Request) -> str | None:
  auth = request.headers.get('authorization', '')
  if auth[:7].lower() == 'bearer ':
    return auth[7:].strip()
  return request.headers.get('x-api-key')


def make_app(translator: ExportedTranslator, *, max_batch: int | None = None,
             max_wait_ms: float = 0.0, max_texts: int = 64,
             max_chars: int = 4000, max_body_bytes: int = 1 << 20,
             max_queue: int = 4096, request_timeout_s: float = 60.0,
             api_keys: Sequence[str] = ()) -> Starlette:
  """The service's Starlette app (see the module docstring).

  Args:
    max_batch: sentences per decoder call (default: the artifact's).
    max_wait_ms: how long an idle decoder waits for a batch to fill.
    max_texts, max_chars, max_body_bytes: request limits (413 beyond them).
    max_queue: sentences that may wait for the decoder; a request that
      would go beyond gets 503 with ``Retry-After``.
    request_timeout_s: a request not answered by then gets 504 and its
      waiting sentences leave the queue (0: no deadline).
    api_keys: if given, ``/translate`` and ``/metrics`` need one of them
      (``Authorization: Bearer KEY`` or ``X-API-Key: KEY``; 401 without).
  """
  max_batch = min(max_batch or translator.batch_size, translator.batch_size)
  keys = [k.encode() for k in api_keys]
  stats = Stats()
  state = {}

  def run_batch(key, rows):
    beam_size, _ = key
    return translator.translate_encoded(rows, beam_size)

  def encode(text: str, index: int):
    try:
      return translator.encode(text, index, too_long='error')
    except InputTooLong as e:
      raise RequestError(413, f'texts[{index}]: {e}') from None

  def check_key(request: Request) -> None:
    if not keys:
      return
    given = (_api_key(request) or '').encode()
    # compare_digest against every key: the time does not tell which matched
    if not any([hmac.compare_digest(given, k) for k in keys]):
      raise RequestError(401, 'missing or unknown API key: send '
                         '"Authorization: Bearer KEY" or "X-API-Key: KEY"',
                         {'WWW-Authenticate': 'Bearer'})

  def check_room(batcher: Batcher, n: int) -> None:
    if batcher.queued + n <= max_queue:
      return
    wait = max(1, math.ceil(batcher.queued * batcher.seconds_per_item()))
    raise RequestError(
        503, f'the queue holds {batcher.queued} sentences and this request '
        f'adds {n} (limit {max_queue}); retry in {wait} s',
        {'Retry-After': str(wait)})

  async def decode_all(request: Request, jobs: list) -> list:
    """The results of ``jobs``, or a RequestError when the deadline passes
    or the client leaves (the waiting sentences then leave the queue)."""
    if not jobs:
      return []
    work = asyncio.ensure_future(asyncio.gather(*jobs))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
      done, _ = await asyncio.wait(
          {work, gone}, timeout=request_timeout_s or None,
          return_when=asyncio.FIRST_COMPLETED)
    finally:
      gone.cancel()
    if work in done:
      return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
      await work
    if gone in done:
      raise RequestError(499, 'the client closed the connection')
    raise RequestError(504, f'not translated within {request_timeout_s:g} s '
                       '(--request_timeout_s); the service is overloaded or '
                       'the texts are long: retry later or send fewer')

  async def translate(request: Request):
    start = time.perf_counter()
    try:
      check_key(request)
      try:
        body = await _read_body(request, max_body_bytes)
      except ClientDisconnect:
        raise RequestError(499, 'the client closed the connection') from None
      asked = parse_request(
          body, beam_sizes=translator.beam_sizes, max_texts=max_texts,
          max_chars=max_chars)
      texts, beam_size = asked.texts, asked.beam_size
      if asked.document:
        docs = [documents.split(t, asked.language) for t in texts]
        parts = [documents.encode(d, translator.tokenizer,
                                  translator.max_input) for d in docs]
        encoded = [ids for rows, _ in parts for ids in rows]
      else:
        encoded = [encode(t, i) for i, t in enumerate(texts)]
      batcher = state['batcher']
      rows = [ids for ids in encoded if ids is not None]
      check_room(batcher, len(rows))
      jobs = [batcher.submit((beam_size, translator.bucket(len(ids))), ids)
              for ids in rows]
      done = iter(await decode_all(request, jobs))
      out = ['' if ids is None else next(done) for ids in encoded]
      if asked.document:
        done = iter(out)
        out = [documents.assemble(d, owner, [next(done) for _ in owner])
               for d, (_, owner) in zip(docs, parts)]
    except RequestError as e:
      stats.record(e.status, time.perf_counter() - start)
      return JSONResponse({'error': str(e)}, status_code=e.status,
                          headers=e.headers)
    except Exception as e:  # pylint: disable=broad-except
      stats.record(500, time.perf_counter() - start)
      return JSONResponse({'error': f'{type(e).__name__}: {e}'},
                          status_code=500)
    stats.record(200, time.perf_counter() - start, len(texts))
    return JSONResponse({'translations': out, 'beam_size': beam_size})

  page = service_page.render(translator.beam_sizes, max_texts=max_texts,
                             max_chars=max_chars, needs_key=bool(keys))

  async def index(_):
    return HTMLResponse(page)

  async def health(_):
    return JSONResponse(dict(
        status='ok', beam_sizes=translator.beam_sizes,
        buckets=translator.buckets, max_input_tokens=translator.max_input,
        max_batch=max_batch, max_texts=max_texts, max_chars=max_chars,
        max_queue=max_queue, request_timeout_s=request_timeout_s,
        api_keys=bool(keys), platforms=translator.manifest['platforms']))

  async def metrics(request: Request):
    try:
      check_key(request)
    except RequestError as e:
      return JSONResponse({'error': str(e)}, status_code=e.status,
                          headers=e.headers)
    if wants_prometheus(request.headers.get('accept', ''),
                        request.query_params.get('format')):
      return Response(prometheus_text(stats, state['batcher']),
                      media_type=PROMETHEUS_CONTENT_TYPE)
    return JSONResponse(stats.snapshot(state['batcher']))

  @contextlib.asynccontextmanager
  async def lifespan(_):
    state['batcher'] = Batcher(run_batch, max_batch, max_wait_ms / 1e3)
    state['batcher'].start()
    yield
    await state['batcher'].close()

  return Starlette(routes=[Route('/', index, methods=['GET']),
                           Route('/translate', translate, methods=['POST']),
                           Route('/health', health, methods=['GET']),
                           Route('/metrics', metrics, methods=['GET'])],
                   lifespan=lifespan)
