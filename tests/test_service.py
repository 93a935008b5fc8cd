"""The HTTP service, started as a real process and driven with httpx."""
import asyncio
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip('httpx')

from tests.test_translate import toy_document  # noqa: E402
from xfmr_jax import data  # noqa: E402
from xfmr_jax.service import Batcher  # noqa: E402
from xfmr_jax.translate import Translator  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def _service(*args, ready_timeout=240):
  """A running ``experiments.serve`` process and its base URL."""
  port = _free_port()
  proc = subprocess.Popen(
      [sys.executable, '-m', 'experiments.serve', f'--port={port}', *args],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  url = f'http://127.0.0.1:{port}'
  deadline = time.time() + ready_timeout
  while True:
    try:
      if httpx.get(url + '/health', timeout=5).status_code == 200:
        break
    except httpx.TransportError:
      pass
    if proc.poll() is not None or time.time() > deadline:
      proc.kill()
      raise AssertionError(f'service did not start: {proc.communicate()}')
    time.sleep(0.2)
  try:
    yield proc, url
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


@pytest.fixture(scope='module')
def artifact(exported_artifact):
  return exported_artifact


@pytest.fixture(scope='module')
def service(artifact):
  # A 50 ms wait: the load test's client shares the cores with the service
  # (and, in the suite, with another test process), and with 20 ms a slow
  # moment of the machine left its concurrent requests in batches of 3.6.
  with _service(f'--artifact={artifact}', '--max_texts=8', '--max_chars=400',
                '--max_body_bytes=4096', '--max_wait_ms=50') as running:
    yield running[1]


@pytest.fixture(scope='module')
def sources(data_dir):
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  return [test[i][0] for i in range(40)]


@pytest.fixture(scope='module')
def expected(trained_workdir, sources):
  return {beam: dict(zip(sources, Translator.from_workdir(
      str(trained_workdir), beam_size=beam)(sources))) for beam in (4, 1)}


def test_translations_equal_translator(service, sources, expected):
  texts = sources[:6] + ['']
  r = httpx.post(service + '/translate', json={'texts': texts}, timeout=120)
  assert r.status_code == 200, r.text
  assert r.json() == {'translations': [expected[4][t] for t in texts[:6]] + [''],
                      'beam_size': 4}
  r = httpx.post(service + '/translate',
                 json={'texts': sources[6:8], 'beam_size': 1}, timeout=120)
  assert r.json()['translations'] == [expected[1][t] for t in sources[6:8]]
  assert httpx.post(service + '/translate', json={'texts': []}).json()[
      'translations'] == []
  # A document: its sentences translated, its layout kept.
  r = httpx.post(service + '/translate', json={
      'texts': [toy_document(sources[:3]), ' \n'], 'document': True,
      'language': 'en'}, timeout=120)
  assert r.status_code == 200, r.text
  assert r.json()['translations'] == [
      toy_document([expected[4][t] for t in sources[:3]]), ' \n']


@pytest.mark.parametrize('body, headers, status, message', [
    (b'{"texts": ["a"', {}, 400, 'body is not JSON'),
    (b'{"texts": ["\xff\xfe"]}', {}, 400, 'not valid UTF-8'),
    (b'["a"]', {}, 422, 'must be a JSON object'),
    (b'{"text": ["a"]}', {}, 422, "unknown field 'text'"),
    (b'{"texts": "a"}', {}, 422, 'must be a list of strings'),
    (b'{"texts": ["a", 3]}', {}, 422, 'texts[1] is int'),
    (b'{"texts": ["a"], "beam_size": 2}', {}, 422, 'beam_size must be one of'),
    (b'{"texts": ["a"], "beam_size": "4"}', {}, 422, 'beam_size must be one of'),
    (b'{"texts": ["\\ud800"]}', {}, 422, 'not valid Unicode'),
    (b'{"texts": ["a"], "document": "yes"}', {}, 422, 'document must be'),
    (b'{"texts": ["a"], "document": true, "language": 3}', {}, 422,
     'language must be a language code'),
    (b'{"texts": ["a"], "num_hypotheses": 2}', {}, 422,
     'num_hypotheses needs a service that decodes it'),
    (b'{"texts": ["a"], "prefixes": ["b"]}', {}, 422,
     'prefixes needs a service that decodes it'),
    (json.dumps({'texts': ['a'] * 9}).encode(), {}, 413, 'at most 8'),
    (json.dumps({'texts': ['a' * 401]}).encode(), {}, 413, '401 characters'),
    (json.dumps({'texts': ['z ' * 190]}).encode(), {}, 413,
     'more than the model maximum 128'),
    (b'{"texts": ["' + b'a' * 5000 + b'"]}', {}, 413, 'the limit is 4096'),
])
def test_bad_requests_get_a_4xx_and_the_service_keeps_serving(
    service, sources, expected, body, headers, status, message):
  r = httpx.post(service + '/translate', content=body, headers=headers)
  assert r.status_code == status, r.text
  assert message in r.json()['error']
  ok = httpx.post(service + '/translate', json={'texts': sources[:1]},
                  timeout=120)
  assert ok.json()['translations'] == [expected[4][sources[0]]]


def test_chunked_huge_body_and_wrong_method(service):
  def chunks():
    for _ in range(10):
      yield b'a' * 1000
  r = httpx.post(service + '/translate', content=chunks())  # no length
  assert r.status_code == 413 and 'over the limit' in r.json()['error']
  assert httpx.get(service + '/translate').status_code == 405
  r = httpx.post(service + '/score', json={'sources': ['a'], 'targets': ['b']})
  assert r.status_code == 422 and 'scoring needs a service' in r.json()['error']
  assert httpx.get(service + '/health').json()['status'] == 'ok'


async def _load(url, texts, concurrency, requests, beam_size=1):
  """Send ``requests`` one-text requests, ``concurrency`` at a time."""
  results, queue = [], list(range(requests))
  async with httpx.AsyncClient(timeout=120) as client:
    async def worker():
      while queue:
        i = queue.pop()
        text = texts[i % len(texts)]
        r = await client.post(url + '/translate', json={
            'texts': [text], 'beam_size': beam_size})
        results.append((text, r.status_code, r.json()))
    await asyncio.gather(*(worker() for _ in range(concurrency)))
  return results


def test_load_is_batched_and_every_answer_is_right(service, sources, expected):
  for concurrency, requests in ((1, 40), (8, 120), (32, 240)):
    before = httpx.get(service + '/metrics').json()
    results = asyncio.run(_load(service, sources, concurrency, requests))
    after = httpx.get(service + '/metrics').json()
    assert len(results) == requests
    for text, status, body in results:
      assert status == 200 and body['translations'] == [expected[1][text]]
    batches = after['batches'] - before['batches']
    assert batches <= requests
    if concurrency == 32:  # sentences of concurrent requests share batches
      assert requests / batches >= 4, (requests, batches)
  metrics = httpx.get(service + '/metrics').json()
  assert metrics['latency_ms']['p50'] <= metrics['latency_ms']['p99']
  assert metrics['requests_by_status']['200'] >= 400


@pytest.mark.slow
def test_sigterm_finishes_requests_in_flight_and_exits_0(trained_workdir,
                                                         sources, expected):
  # Served straight from the workdir (its model, no artifact).
  with _service(f'--workdir={trained_workdir}', '--max_wait_ms=50') as (
      proc, url):
    async def scenario():
      async with httpx.AsyncClient(timeout=120) as client:
        async def one(text):
          return await client.post(url + '/translate', json={
              'texts': [text] * 4, 'beam_size': 4})
        jobs = [asyncio.create_task(one(t)) for t in sources[:24]]
        await asyncio.sleep(0.3)  # requests are queued or decoding
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        responses = await asyncio.gather(*jobs)
        return responses, sent
    responses, _ = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 24
    for text, r in zip(sources, responses):
      assert r.json()['translations'] == [expected[4][text]] * 4
    assert proc.wait(timeout=60) == 0
    out, err = proc.communicate()
    assert 'stopped' in out, err
    with pytest.raises(httpx.TransportError):
      httpx.get(url + '/health', timeout=5)


def test_batcher_groups_by_key_up_to_the_batch_size():
  calls = []

  def run_batch(key, items):
    calls.append((key, list(items)))
    return [f'{key}:{i}' for i in items]

  async def scenario():
    batcher = Batcher(run_batch, max_batch=3, max_wait_s=0.05)
    batcher.start()
    jobs = [batcher.submit(k, i) for i, k in enumerate('aabaaab')]
    results = await asyncio.gather(*jobs)
    await batcher.close()
    return results

  results = asyncio.run(scenario())
  assert results == [f'{k}:{i}' for i, k in enumerate('aabaaab')]
  assert sorted(calls) == [('a', [0, 1, 3]), ('a', [4, 5]), ('b', [2, 6])]


def test_batcher_passes_errors_to_every_waiter_and_goes_on():
  def run_batch(key, items):
    if key == 'bad':
      raise RuntimeError('decoder failed')
    return items

  async def scenario():
    batcher = Batcher(run_batch, max_batch=4, max_wait_s=0.01)
    batcher.start()
    bad = await asyncio.gather(batcher.submit('bad', 1),
                               batcher.submit('bad', 2),
                               return_exceptions=True)
    good = await batcher.submit('good', 7)
    await batcher.close()
    return bad, good

  bad, good = asyncio.run(scenario())
  assert [str(e) for e in bad] == ['decoder failed'] * 2 and good == 7
