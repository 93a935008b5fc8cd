"""The service's limits: a bounded queue (503), a deadline (504), clients
that leave, API keys (401), Prometheus metrics, memory over many requests and
fuzzed request bodies.

The app runs in this process (uvicorn in a thread, or starlette's test
client) around a stand-in translator whose decoder can be held, so that the
queue's state is known at every step; tests/test_service.py drives the real
exported model in a real process.
"""
import asyncio
import json
import os
import threading
import time

import pytest

httpx = pytest.importorskip('httpx')
pytest.importorskip('uvicorn')
pytest.importorskip('starlette')
pytest.importorskip('prometheus_client')

from starlette.testclient import TestClient  # noqa: E402

from tests.local_server import serve_in_thread  # noqa: E402
from xfmr_jax import service, service_request  # noqa: E402
from xfmr_jax.serving import InputTooLong  # noqa: E402

KEY = 'k' * 20


class HeldTranslator:
  """A translator whose "translation" of a text is the text reversed, and
  whose decoder waits while ``gate`` is clear."""

  batch_size, beam_sizes, buckets, max_input = 4, [1, 4], [8, 16, 32], 32
  manifest = {'platforms': ['cpu']}
  options = frozenset()   # the plain search only, as an artifact

  def __init__(self):
    self.gate = threading.Event()
    self.gate.set()
    self.entered = threading.Event()   # a batch reached the decoder
    self.holding = []   # the texts of the batch being decoded
    self.decoded = []   # every text decoded, in order

  def encode(self, text, index, too_long='truncate'):
    if not text.strip():
      return None
    if len(text) > self.max_input:
      raise InputTooLong(f'input {index} has {len(text)} tokens, more than '
                         f'the model maximum {self.max_input}')
    return text

  def bucket(self, n):
    return next(b for b in self.buckets if b >= n)

  def translate_encoded(self, rows, beam_size):
    self.holding = list(rows)
    self.entered.set()
    self.gate.wait(30)
    self.holding = []
    self.decoded += rows
    return [r[::-1] for r in rows]


def _metrics(url, **kw):
  return httpx.get(url + '/metrics', **kw).json()


def _wait_for(predicate, timeout=10):
  deadline = time.time() + timeout
  while not predicate():
    assert time.time() < deadline, 'timed out'
    time.sleep(0.02)


async def _post_all(url, bodies, timeout=30):
  async with httpx.AsyncClient(timeout=timeout) as client:
    return await asyncio.gather(*(client.post(url + '/translate', json=b)
                                  for b in bodies), return_exceptions=True)


async def _held_in_decoder(client, url, translator, texts):
  """Sends ``texts`` and returns the pending request once its batch is in
  the (held) decoder."""
  request = asyncio.ensure_future(client.post(url + '/translate',
                                              json={'texts': texts}))
  assert await asyncio.to_thread(translator.entered.wait, 10)
  return request


def test_a_full_queue_answers_503_with_retry_after_then_serves():
  translator = HeldTranslator()
  app = service.make_app(translator, max_queue=6, max_wait_ms=0)
  with serve_in_thread(app) as url:
    translator.gate.clear()
    # 'a' goes to the decoder (held there); 6 more texts fill the queue.
    async def scenario():
      async with httpx.AsyncClient(timeout=30) as client:
        first = await _held_in_decoder(client, url, translator, ['a'])
        queued = [asyncio.ensure_future(client.post(
            url + '/translate', json={'texts': [f'q{i}', f'r{i}']}))
            for i in range(3)]
        await asyncio.to_thread(_wait_for,
                                lambda: _metrics(url)['queued'] == 6)
        full = await client.post(url + '/translate', json={'texts': ['x']})
        translator.gate.set()
        return full, await first, await asyncio.gather(*queued)
    full, first, queued = asyncio.run(scenario())
    assert full.status_code == 503, full.text
    assert 'limit 6' in full.json()['error']
    assert int(full.headers['retry-after']) >= 1
    assert first.json()['translations'] == ['a']
    assert [r.json()['translations'] for r in queued] == [
        [f'q{i}'[::-1], f'r{i}'[::-1]] for i in range(3)]
    ok = httpx.post(url + '/translate', json={'texts': ['later']})
    assert ok.json()['translations'] == ['retal']
    assert _metrics(url)['requests_by_status']['503'] == 1


def test_a_request_past_its_deadline_gets_504_and_leaves_the_queue():
  translator = HeldTranslator()
  app = service.make_app(translator, request_timeout_s=0.5)
  with serve_in_thread(app) as url:
    translator.gate.clear()
    async def scenario():
      async with httpx.AsyncClient(timeout=30) as client:
        held = await _held_in_decoder(client, url, translator, ['held'])
        late = await client.post(url + '/translate',
                                 json={'texts': ['late1', 'late2']})
        return [await held, late]
    results = asyncio.run(scenario())
    assert [r.status_code for r in results] == [504, 504]
    assert 'within 0.5 s' in results[1].json()['error']
    assert _metrics(url)['queued'] == 0   # 'late*' never reached the decoder
    translator.gate.set()
    ok = httpx.post(url + '/translate', json={'texts': ['next']})
    assert ok.json()['translations'] == ['txen']
    assert translator.decoded == ['held', 'next']


def test_clients_that_disconnect_leave_the_queue_empty():
  translator = HeldTranslator()
  app = service.make_app(translator, max_queue=1000)
  with serve_in_thread(app) as url:
    translator.gate.clear()
    async def hundred_clients_that_give_up():
      async with httpx.AsyncClient(timeout=30) as client:
        jobs = [asyncio.ensure_future(client.post(
            url + '/translate', json={'texts': [f'gone{i}']}))
            for i in range(100)]
        await asyncio.to_thread(_wait_for, lambda: _metrics(url)[
            'queued'] + len(translator.holding) == 100)
        for job in jobs:
          job.cancel()   # each closes its connection
        await asyncio.gather(*jobs, return_exceptions=True)
    asyncio.run(hundred_clients_that_give_up())
    _wait_for(lambda: _metrics(url)['queued'] == 0)
    translator.gate.set()
    texts = [f'text {i}' for i in range(20)]
    results = asyncio.run(_post_all(url, [{'texts': [t]} for t in texts]))
    assert [r.json()['translations'] for r in results] == [
        [t[::-1]] for t in texts]
    # At most the batch that was already decoding ran for the leavers.
    assert sum(t.startswith('gone') for t in translator.decoded) <= 4
    assert _metrics(url)['requests_by_status']['499'] >= 96


def test_api_keys_guard_translate_and_metrics_not_health():
  app = service.make_app(HeldTranslator(), api_keys=[KEY, 'm' * 20])
  with TestClient(app) as client:
    body = {'texts': ['abc']}
    for headers in ({}, {'Authorization': 'Bearer wrong'},
                    {'X-API-Key': KEY[:-1]}):
      r = client.post('/translate', json=body, headers=headers)
      assert r.status_code == 401 and 'API key' in r.json()['error']
      assert r.headers['www-authenticate'] == 'Bearer'
    assert client.get('/metrics').status_code == 401
    for headers in ({'Authorization': f'Bearer {KEY}'},
                    {'X-API-Key': 'm' * 20}):
      r = client.post('/translate', json=body, headers=headers)
      assert r.json()['translations'] == ['cba']
    assert client.get('/health').json()['api_keys'] is True
    assert client.get('/metrics', headers={'X-API-Key': KEY}).json()[
        'requests_by_status'] == {'200': 2, '401': 3}


def test_metrics_in_prometheus_text_agree_with_the_json():
  from prometheus_client.parser import text_string_to_metric_families
  app = service.make_app(HeldTranslator())
  with TestClient(app) as client:
    for texts in (['ab', 'cd'], ['e'], [5]):
      client.post('/translate', json={'texts': texts})
    as_json = client.get('/metrics').json()
    scraped = client.get('/metrics', headers={
        'Accept': 'application/openmetrics-text;version=1.0.0;q=0.5,'
                  'text/plain;version=0.0.4;q=0.4,*/*;q=0.1'})
    assert scraped.headers['content-type'].startswith('text/plain')
    assert client.get('/metrics?format=prometheus').text.startswith('# HELP')
  samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for family in text_string_to_metric_families(scraped.text)
             for s in family.samples}
  assert samples[('xfmr_requests_total', (('status', '200'),))] == 2
  assert samples[('xfmr_requests_total', (('status', '422'),))] == 1
  assert samples[('xfmr_texts_total', ())] == as_json['texts'] == 3
  assert samples[('xfmr_batched_sentences_total', ())] == 3
  assert samples[('xfmr_batches_total', ())] == as_json['batches']
  assert samples[('xfmr_queued_sentences', ())] == 0
  p50 = samples[('xfmr_request_latency_seconds', (('quantile', '0.5'),))]
  assert 0 < p50 < 10


def _rss_bytes():
  with open('/proc/self/statm') as f:
    return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


@pytest.mark.skipif(not os.path.exists('/proc/self/statm'),
                    reason='reads the resident size from /proc')
def test_resident_memory_stays_flat_over_20000_requests():
  app = service.make_app(HeldTranslator())
  with TestClient(app) as client:
    def send(n):
      for i in range(n):
        texts = [f'sentence {i}'] if i % 10 else ['', 'x' * 40]  # some 413s
        client.post('/translate', json={'texts': texts})
    send(1000)
    after_1000 = _rss_bytes()
    send(19_000)
    after_20000 = _rss_bytes()
    metrics = client.get('/metrics').json()
  assert metrics['requests'] == 20_000 and metrics['queued'] == 0
  assert after_20000 <= 1.10 * after_1000, (after_1000, after_20000)


hypothesis = pytest.importorskip('hypothesis')
st = hypothesis.strategies
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=8), inner, max_size=4), max_leaves=12)
_bodies = st.one_of(
    st.binary(max_size=200),
    _json.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({'texts': st.lists(st.text(max_size=40),
                                             max_size=6)},
                          optional={'beam_size': _json}).map(
                              lambda v: json.dumps(v).encode()))


_option_bodies = st.fixed_dictionaries(
    {'texts': st.lists(st.text(max_size=10), max_size=3)},
    optional={f: _json for f in service_request.OPTION_FIELDS + (
        'beam_size', 'document', 'language')}).map(
            lambda v: json.dumps(v).encode())


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(body=_option_bodies)
def test_fuzzed_options_are_a_request_or_a_4xx(body):
  try:
    asked = service_request.parse_request(
        body, beam_sizes=[4, 1], max_texts=3, max_chars=10,
        options=frozenset(service_request.OPTION_FIELDS))
  except service_request.RequestError as e:
    assert 400 <= e.status < 500 and str(e)
    return
  assert 0 <= asked.options.num_hypotheses <= asked.beam_size
  for per_text in (asked.prefixes, asked.constraints):
    assert per_text is None or len(per_text) == len(asked.texts)


@pytest.fixture(scope='module')
def fuzz_client():
  with TestClient(service.make_app(HeldTranslator(), max_texts=4)) as client:
    yield client


@hypothesis.settings(max_examples=300, deadline=None,
                     suppress_health_check=[
                         hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(body=_bodies)
def test_fuzzed_request_bodies_never_get_a_5xx(fuzz_client, body):
  r = fuzz_client.post('/translate', content=body)
  assert r.status_code < 500, (body, r.text)
  assert r.status_code == 200 or 'error' in r.json()


@pytest.mark.parametrize('content, message', [
    ('', 'holds no key'), ('# only a comment\n\n', 'holds no key'),
    ('short\n', 'at least 16 characters')])
def test_a_bad_api_keys_file_is_one_line(tmp_path, content, message):
  import subprocess
  import sys
  keys = tmp_path / 'keys'
  keys.write_text(content)
  run = subprocess.run(
      [sys.executable, '-m', 'experiments.serve', f'--artifact={tmp_path}',
       f'--api_keys_file={keys}'], capture_output=True, text=True,
      timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert run.returncode == 2 and message in run.stderr, run.stderr
  assert run.stderr.strip().count('\n') == 0
