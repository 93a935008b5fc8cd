"""An HTTP JSON translation service around an exported or a workdir translator.

    app = make_app(xfmr_jax.serving.load('artifact'))   # a Starlette app
    uvicorn.run(app, port=8000)       # python -m experiments.serve does this

Endpoints:

- ``GET /``: a page to type text into and translate it
  (:mod:`xfmr_jax.service_page`).
- ``POST /translate`` with ``{"texts": [str, ...], "beam_size": int}``
  (``beam_size`` optional: one the service offers) answers
  ``{"translations": [str, ...], "beam_size": int}`` in the same order; a
  blank text gives ''. With ``"document": true`` each text is a whole
  document, cut into sentences by the rules of ``"language"`` (default
  "en") and answered with its layout kept (:mod:`xfmr_jax.documents`; a
  sentence too long for the model is cut into parts, not refused). Served
  from a workdir (:class:`~xfmr_jax.workdir_translator.WorkdirTranslator`),
  a request may also ask for n-best lists (``"num_hypotheses": k`` adds
  ``"hypotheses"``: per text ``[{"text", "score", "log_prob"}, ...]``),
  ``"prefixes"``, ``"constraints"``, anti-repetition and alignments
  (``"alignments": true`` adds ``"alignments"``: per text ``[[source word,
  translation word], ...]``); see :mod:`xfmr_jax.service_request`.
- ``POST /score`` with ``{"sources": [str, ...], "targets": [str, ...]}``
  (from a workdir) answers ``{"scores": [{"log_prob": float,
  "token_log_probs": [float, ...]}, ...]}``: each target's log-probability
  given its source, and its tokens' with the EOS last (teacher forcing).
- ``GET /health``: ``{"status": "ok", ...}`` with the artifact's settings.
- ``GET /metrics``: request counts by status, texts, batches and their mean
  size, the queue, latency percentiles (ms) over the last 10,000 requests;
  in Prometheus' text format for ``?format=prometheus`` or an Accept header
  that prefers text/plain (as Prometheus' scraper sends).

Sentences of concurrent requests are batched dynamically: each goes to the
queue of its (beam size, source bucket, batch-wide options), and one decoding
thread takes the queue whose oldest sentence has waited longest, once it
holds ``max_batch`` sentences or its oldest has waited ``max_wait_ms``. With
the default wait of 0 an idle decoder starts at once (no added latency at low
load), and while it decodes, the sentences that arrive queue up and form the
next batch, so batches grow with the load.

Limits: at most ``max_queue`` sentences wait (beyond: 503 and
``Retry-After``, from the decoder's mean time per sentence so far); a request not
answered within ``request_timeout_s`` gets 504; a client that disconnects has
its waiting sentences dropped (a sentence already in a running batch finishes
there and is discarded); with ``api_keys``, ``/translate`` and ``/metrics``
answer 401 without one (``/health`` stays open for load balancers).

Bad requests get a 4xx and ``{"error": message}``; the service keeps serving.
Needs starlette and prometheus_client (the ``serve`` extra; and an ASGI
server such as uvicorn to run it), and no model code for an artifact.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import math
import time
from typing import Callable, Hashable, Sequence

from xfmr_jax import documents, service_page
from xfmr_jax.extras import require
from xfmr_jax.service_metrics import (PROMETHEUS_CONTENT_TYPE, Stats,
                                      prometheus_text, wants_prometheus)
from xfmr_jax.service_request import (SCORE, Job, RequestError, parse_request,
                                      parse_score_request, read_body)
from xfmr_jax.serving import InputTooLong

_WHY = 'the HTTP service (xfmr_jax.service)'
# A blank text's result, whatever the request asks for.
EMPTY = {'translation': '', 'hypotheses': [], 'alignment': []}
Starlette = require('starlette.applications', _WHY).Starlette
Request = require('starlette.requests', _WHY).Request
JSONResponse = require('starlette.responses', _WHY).JSONResponse
Response = require('starlette.responses', _WHY).Response
HTMLResponse = require('starlette.responses', _WHY).HTMLResponse
ClientDisconnect = require('starlette.requests', _WHY).ClientDisconnect
Route = require('starlette.routing', _WHY).Route

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


def make_app(translator, *, max_batch: int | None = None,
             max_wait_ms: float = 0.0, max_texts: int = 64,
             max_chars: int = 4000, max_body_bytes: int = 1 << 20,
             max_queue: int = 4096, request_timeout_s: float = 60.0,
             api_keys: Sequence[str] = ()) -> Starlette:
  """The service's Starlette app (see the module docstring).

  Args:
    translator: an :class:`~xfmr_jax.serving.ExportedTranslator` (the plain
      search) or a :class:`~xfmr_jax.workdir_translator.WorkdirTranslator`
      (every option of :mod:`xfmr_jax.service_request`).
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

  def run_batch(key, jobs):
    beam_size, _, options = key
    if beam_size == SCORE:
      return translator.score(jobs)
    if translator.options:
      return translator.run(jobs, beam_size, options)
    return [{'translation': t} for t in translator.translate_encoded(
        [job.ids for job in jobs], beam_size)]

  def encode(text: str, index: int):
    try:
      return translator.encode(text, index, too_long='error')
    except InputTooLong as e:
      raise RequestError(413, f'texts[{index}]: {e}') from None

  def jobs_of(asked) -> tuple[list, list]:
    """The request's jobs (None: a blank text) and its documents' layouts,
    checked before anything is queued."""
    layouts = []
    if asked.document:
      docs = [documents.split(t, asked.language) for t in asked.texts]
      parts = [documents.encode(d, translator.tokenizer, translator.max_input)
               for d in docs]
      encoded = [ids for rows, _ in parts for ids in rows]
      layouts = list(zip(docs, parts))
    else:
      encoded = [encode(t, i) for i, t in enumerate(asked.texts)]
    if not translator.options:
      return [None if ids is None else Job(ids) for ids in encoded], layouts
    try:
      return translator.prepare(encoded, asked.beam_size, asked.options,
                                asked.prefixes, asked.constraints), layouts
    except ValueError as e:
      raise RequestError(422, str(e)) from None

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

  def endpoint(answer):
    """A POST handler around ``answer(request, body) -> (JSON, texts)``: the
    key, the body, the errors and the counters of every request."""

    async def handle(request: Request):
      start = time.perf_counter()
      try:
        check_key(request)
        try:
          body = await read_body(request, max_body_bytes)
        except ClientDisconnect:
          raise RequestError(499, 'the client closed the connection') from None
        out, texts = await answer(request, body)
      except RequestError as e:
        stats.record(e.status, time.perf_counter() - start)
        return JSONResponse({'error': str(e)}, status_code=e.status,
                            headers=e.headers)
      except Exception as e:  # pylint: disable=broad-except
        stats.record(500, time.perf_counter() - start)
        return JSONResponse({'error': f'{type(e).__name__}: {e}'},
                            status_code=500)
      stats.record(200, time.perf_counter() - start, texts)
      return JSONResponse(out)
    return handle

  async def submit_all(request: Request, keyed: list) -> list:
    """The results of ``(key, item)`` pairs, queued if there is room."""
    check_room(state['batcher'], len(keyed))
    return await decode_all(request, [state['batcher'].submit(key, item)
                                      for key, item in keyed])

  async def translate(request: Request, body: bytes):
    asked = parse_request(
        body, beam_sizes=translator.beam_sizes, max_texts=max_texts,
        max_chars=max_chars, options=translator.options)
    jobs, layouts = jobs_of(asked)
    done = iter(await submit_all(request, [
        ((asked.beam_size, translator.bucket(len(job.ids)), asked.options),
         job) for job in jobs if job is not None]))
    results = [EMPTY if job is None else next(done) for job in jobs]
    out = {'translations': [r['translation'] for r in results]}
    if layouts:
      done = iter(out['translations'])
      out['translations'] = [
          documents.assemble(doc, owner, [next(done) for _ in owner])
          for doc, (_, owner) in layouts]
    if asked.options.num_hypotheses:
      out['hypotheses'] = [r['hypotheses'] for r in results]
    if asked.options.alignments:
      out['alignments'] = [r['alignment'] for r in results]
    return {**out, 'beam_size': asked.beam_size}, len(asked.texts)

  async def score(request: Request, body: bytes):
    sources, targets = parse_score_request(
        body, max_texts=max_texts, max_chars=max_chars,
        options=translator.options)
    encoded = [encode(t, i) for i, t in enumerate(sources)]
    try:
      wanted = translator.encode_targets(encoded, targets)
    except ValueError as e:
      raise RequestError(422, str(e)) from None
    scores = await submit_all(request, [
        ((SCORE, translator.bucket(len(ids)), None), (ids, target))
        for ids, target in zip(encoded, wanted)])
    return {'scores': [{'log_prob': sum(p), 'token_log_probs': p}
                       for p in scores]}, len(sources)

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
        api_keys=bool(keys), platforms=translator.manifest['platforms'],
        options=sorted(translator.options)))

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
                           Route('/translate', endpoint(translate),
                                 methods=['POST']),
                           Route('/score', endpoint(score), methods=['POST']),
                           Route('/health', health, methods=['GET']),
                           Route('/metrics', metrics, methods=['GET'])],
                   lifespan=lifespan)
