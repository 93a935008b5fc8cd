"""The translation service overloaded, with and without a bounded queue.

    python -m experiments.benchmark.backpressure --workdir=workdir/toy

Exports the workdir's translator (beam 4), measures its capacity (answered
requests/s of 32 clients that each send the next one-sentence request when
the last is answered), then starts it twice: with a queue that never fills
(and no deadline) and with ``--max_queue=Q``. Each load sends one-sentence
requests at a fixed rate, a multiple of the capacity, for ``--seconds``,
whether or not earlier ones were answered (an open loop: what an overloaded
service sees). Reported per load and service: answered requests/s, the
shares rejected (503) and timed out (504), and p50/p99 latency of the
answered ones. Without a bound the queue, and the latency, grow for as long
as the overload lasts; with one, the latency of what is accepted stays near
a busy service's and the rest is told at once.

The load generator (httpx) runs in this process on the same machine.
"""
from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import numpy as np

from experiments.benchmark.common import machine
from experiments.benchmark.report import write_json
from experiments.benchmark.serving import (_start_service, export_for_load,
                                           test_sources)


async def _closed_loop(url, texts, concurrency, requests, beam_size) -> float:
  """Answered requests/s of ``concurrency`` clients that send the next
  request as soon as one is answered: the service's capacity."""
  todo = list(range(requests))
  limits = httpx.Limits(max_connections=concurrency)
  async with httpx.AsyncClient(timeout=600, limits=limits) as client:
    async def worker():
      while todo:
        r = await client.post(url + '/translate', json={
            'texts': [texts[todo.pop() % len(texts)]],
            'beam_size': beam_size})
        r.raise_for_status()
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
  return requests / (time.perf_counter() - start)


async def _open_loop(url, texts, rate, seconds, beam_size) -> dict:
  """Requests arriving at ``rate`` per second for ``seconds``, whether or
  not the earlier ones were answered (what an overloaded service sees)."""
  latencies, statuses = [], []
  limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
  async with httpx.AsyncClient(timeout=600, limits=limits) as client:
    async def one(i):
      start = time.perf_counter()
      r = await client.post(url + '/translate', json={
          'texts': [texts[i % len(texts)]], 'beam_size': beam_size})
      statuses.append(r.status_code)
      if r.status_code == 200:
        latencies.append(time.perf_counter() - start)
    jobs, start, n = [], time.perf_counter(), int(rate * seconds)
    for i in range(n):
      await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
      jobs.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*jobs)
    wall = time.perf_counter() - start
  ms = np.asarray(latencies) * 1e3
  return dict(
      sent=n, answered_per_s=len(latencies) / wall,
      rejected=statuses.count(503) / n, timed_out=statuses.count(504) / n,
      p50_ms=float(np.percentile(ms, 50)) if ms.size else None,
      p99_ms=float(np.percentile(ms, 99)) if ms.size else None,
      wall_s=wall)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog='python -m experiments.benchmark.backpressure')
  p.add_argument('--workdir', required=True, help='a trained toy workdir')
  p.add_argument('--max_queue', type=int, default=64)
  p.add_argument('--loads', default='0.5,1.5,3',
                 help='arrival rates, as multiples of the measured capacity')
  p.add_argument('--seconds', type=float, default=8.0,
                 help='how long each load sends')
  p.add_argument('--beam_size', type=int, default=4)
  p.add_argument('--port', type=int, default=8741)
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)
  texts = test_sources(args.workdir)
  artifact, _ = export_for_load(args.workdir, beam_sizes=(args.beam_size,))
  loads = [float(x) for x in args.loads.split(',')]
  services = (('unbounded', ('--max_queue=1000000', '--request_timeout_s=0')),
              (f'max_queue={args.max_queue}',
               (f'--max_queue={args.max_queue}',)))
  result = dict(machine=machine(), beam_size=args.beam_size,
                seconds=args.seconds, services={})
  for offset, (name, extra) in enumerate(services):
    proc, url = _start_service(artifact, args.port + offset, *extra)
    try:
      asyncio.run(_closed_loop(url, texts, 32, 128, args.beam_size))  # warm
      if 'capacity_per_s' not in result:
        result['capacity_per_s'] = asyncio.run(
            _closed_loop(url, texts, 32, 512, args.beam_size))
      rate = result['capacity_per_s']
      result['services'][name] = {
          load: asyncio.run(_open_loop(url, texts, load * rate, args.seconds,
                                       args.beam_size)) for load in loads}
    finally:
      proc.terminate()
      proc.wait()
  print(format_table(result))
  if args.json:
    write_json(result, args.json)
  return result


def format_table(result: dict) -> str:
  lines = [f"machine: {result['machine']}; beam {result['beam_size']}; "
           f"capacity {result['capacity_per_s']:.1f} requests/s (32 clients "
           f"in a closed loop); each load sends for {result['seconds']:g} s",
           '| service | arrivals (x capacity) | answered req/s | rejected '
           '(503) | timed out (504) | p50 ms | p99 ms |',
           '|---|---:|---:|---:|---:|---:|---:|']
  for name, rows in result['services'].items():
    for load, r in rows.items():
      p50 = '–' if r['p50_ms'] is None else f"{r['p50_ms']:.0f}"
      p99 = '–' if r['p99_ms'] is None else f"{r['p99_ms']:.0f}"
      lines.append(f"| {name} | {load:g} | {r['answered_per_s']:.1f} | "
                   f"{100 * r['rejected']:.0f}% | {100 * r['timed_out']:.0f}% "
                   f"| {p50} | {p99} |")
  return '\n'.join(lines)


if __name__ == '__main__':
  main()
