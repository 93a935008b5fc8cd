"""What the HTTP service counts, as JSON and in Prometheus' text format.

    stats = Stats()
    stats.record(200, 0.031, texts=2)          # one answered request
    stats.snapshot(batcher)                    # GET /metrics (JSON)
    prometheus_text(stats, batcher)            # GET /metrics, Accept: text/plain

The Prometheus rendering reads the same counters at scrape time (one
collector over :class:`Stats`, through the ``prometheus_client`` library), so
the two formats cannot disagree. Latency percentiles are over the last
``window`` answered requests.
"""
from __future__ import annotations

import collections
import time

import numpy as np

from xfmr_jax.extras import require

_WHY = 'the HTTP service (xfmr_jax.service)'
_prom = require('prometheus_client', _WHY)
_core = require('prometheus_client.core', _WHY)
PROMETHEUS_CONTENT_TYPE = _prom.CONTENT_TYPE_LATEST
QUANTILES = (50, 90, 99)


class Stats:
  """Counters and recent latencies of ``/translate`` requests."""

  def __init__(self, window: int = 10_000):
    self.started = time.time()
    self.statuses = collections.Counter()
    self.texts = 0
    self.latencies = collections.deque(maxlen=window)

  def record(self, status: int, seconds: float, texts: int = 0) -> None:
    self.statuses[status] += 1
    self.texts += texts
    if status == 200:
      self.latencies.append(seconds)

  def percentiles_ms(self) -> dict:
    lat = np.asarray(self.latencies) * 1e3
    if not lat.size:
      return {}
    return ({f'p{q}': round(float(np.percentile(lat, q)), 2)
             for q in QUANTILES} | {'max': round(float(lat.max()), 2)})

  def snapshot(self, batcher) -> dict:
    """The JSON of ``GET /metrics``."""
    return dict(
        uptime_s=round(time.time() - self.started, 1),
        requests=sum(self.statuses.values()),
        requests_by_status={str(k): v for k, v in sorted(self.statuses.items())},
        texts=self.texts, batches=batcher.batches,
        mean_batch_size=round(batcher.items / max(batcher.batches, 1), 2),
        queued=batcher.queued, latency_ms=self.percentiles_ms())


class _Collector:
  """The service's metrics for one scrape (``prometheus_client`` calls
  :meth:`collect`)."""

  def __init__(self, stats: Stats, batcher):
    self.stats, self.batcher = stats, batcher

  def collect(self):
    s, b = self.stats, self.batcher
    requests = _core.CounterMetricFamily(
        'xfmr_requests', 'Translate requests by HTTP status (499: the '
        'client left before its answer).',
        labels=['status'])
    for status, n in sorted(s.statuses.items()):
      requests.add_metric([str(status)], n)
    yield requests
    yield _core.CounterMetricFamily('xfmr_texts',
                                    'Texts in answered requests.', s.texts)
    yield _core.CounterMetricFamily('xfmr_batches', 'Decoder calls.',
                                    b.batches)
    yield _core.CounterMetricFamily('xfmr_batched_sentences',
                                    'Sentences decoded.', b.items)
    yield _core.GaugeMetricFamily('xfmr_queued_sentences',
                                  'Sentences waiting for the decoder.',
                                  b.queued)
    latency = _core.GaugeMetricFamily(
        'xfmr_request_latency_seconds',
        f'Latency percentiles of the last {s.latencies.maxlen} answered '
        'requests.', labels=['quantile'])
    lat = np.asarray(s.latencies)
    if lat.size:
      for q in QUANTILES:
        latency.add_metric([str(q / 100)], float(np.percentile(lat, q)))
    yield latency
    yield _core.GaugeMetricFamily('xfmr_uptime_seconds',
                                  'Seconds since the service started.',
                                  time.time() - s.started)


def prometheus_text(stats: Stats, batcher) -> bytes:
  """The metrics in Prometheus' text exposition format."""
  registry = _prom.CollectorRegistry(auto_describe=False)
  registry.register(_Collector(stats, batcher))
  return _prom.generate_latest(registry)


def wants_prometheus(accept: str, query_format: str | None) -> bool:
  """Whether a ``GET /metrics`` asks for the text format: ``?format=
  prometheus``, or an Accept header naming text/plain or OpenMetrics before
  (or without) JSON, as Prometheus' scraper sends."""
  if query_format is not None:
    return query_format == 'prometheus'
  accept = accept.lower()
  text = min((i for i in (accept.find('text/plain'),
                          accept.find('application/openmetrics-text'))
              if i >= 0), default=-1)
  json_at = accept.find('application/json')
  return text >= 0 and (json_at < 0 or text < json_at)
