"""The translation service under load, and its cold start.

    python -m experiments.benchmark.serving --workdir=workdir/toy
    python -m experiments.benchmark.serving --workdir=DIR --requests=400 \\
        --json=serving.json

Exports the workdir's translator, then measures, in one run:

- cold start, in fresh processes (alternating, median of ``--cold_reps``):
  from the interpreter's start to the first translation, (a) loading the
  exported artifact (``xfmr_jax.serving.load``), (b) the same with jax's
  persistent compilation cache filled by an earlier run (what the service's
  ``--compilation_cache_dir`` does) and (c) building the model and restoring
  the checkpoint (``Translator.from_workdir``);
- the decoder alone, in this process (``serving.load``, no HTTP): ms per
  sentence for 64 one-bucket test sentences decoded in batches of 1, 4, 16
  and 64 (best of 3), the ceiling that batching can give the service;
- requests/s and p50/p99 latency of ``POST /translate`` (one test sentence per
  request, beam 4 and greedy) at concurrency 1, 8 and 32, against
  the service with dynamic batching and against the same service limited to
  one sentence per decoder call (``--max_batch=1``), so the speed-up of
  batching is measured side by side. The service compiles every batch size
  before it starts (``--warm_up``) and each level runs briefly untimed first.

The load generator (httpx) runs in this process on the same machine.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

from experiments import benchmark as package
from experiments.benchmark.common import machine
from experiments.benchmark.report import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

CACHE_FLAGS = ('import jax; '
               'jax.config.update("jax_compilation_cache_dir", {cache!r}); '
               'jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1); '
               'jax.config.update("jax_persistent_cache_min_compile_time_secs", 0); ')
COLD = {
    'artifact': ('from xfmr_jax import serving; '
                 't = serving.load({path!r}); t(["{text}"])'),
    'artifact_cached': (CACHE_FLAGS + 'from xfmr_jax import serving; '
                        't = serving.load({path!r}); t(["{text}"])'),
    'checkpoint': ('from xfmr_jax.translate import Translator; '
                   't = Translator.from_workdir({path!r}); t(["{text}"])'),
}


def cold_start(kind: str, path: str, text: str, cache: str) -> float:
  """Seconds from a fresh interpreter to its first translation."""
  code = COLD[kind].format(path=path, text=text, cache=cache)
  start = time.perf_counter()
  # Only 'artifact_cached' uses a compilation cache: its own.
  subprocess.run([sys.executable, '-c', code], check=True, cwd=ROOT,
                 capture_output=True, env=package.cold_env())
  return time.perf_counter() - start


def _start_service(artifact: str, port: int, *extra: str):
  proc = subprocess.Popen(
      [sys.executable, '-m', 'experiments.serve', f'--artifact={artifact}',
       f'--port={port}', '--warm_up', *extra], cwd=ROOT,
      stdout=subprocess.DEVNULL)
  url = f'http://127.0.0.1:{port}'
  for _ in range(3000):
    try:
      if httpx.get(url + '/health').status_code == 200:
        return proc, url
    except httpx.TransportError:
      time.sleep(0.1)
  proc.kill()
  raise RuntimeError('the service did not start')


def decoder_alone(loaded, texts: list[str], beam_sizes,
                  batches=(1, 4, 16, 64)) -> dict:
  """``{beam: {batch: ms per sentence}}`` of a loaded translator (the
  artifact's or the workdir's), called directly on 64 sentences of the first
  bucket (best of 3 passes)."""
  rows = [ids for ids in (loaded.encode(t) for t in texts)
          if ids and loaded.bucket(len(ids)) == loaded.buckets[0]][:64]
  out = {}
  for beam in beam_sizes:
    out[beam] = {}
    for n in batches:
      loaded.translate_encoded(rows[:n], beam)  # compiles
      best = float('inf')
      for _ in range(3):
        start = time.perf_counter()
        for i in range(0, len(rows), n):
          loaded.translate_encoded(rows[i:i + n], beam)
        best = min(best, time.perf_counter() - start)
      out[beam][n] = best / len(rows) * 1e3
  return out


async def _load(url: str, texts: list[str], concurrency: int, requests: int,
                beam_size: int):
  """Latencies (s) of ``requests`` one-sentence requests and the wall time."""
  latencies, todo = [], list(range(requests))
  limits = httpx.Limits(max_connections=concurrency)
  async with httpx.AsyncClient(timeout=600, limits=limits) as client:
    async def worker():
      while todo:
        text = texts[todo.pop() % len(texts)]
        start = time.perf_counter()
        r = await client.post(url + '/translate', json={
            'texts': [text], 'beam_size': beam_size})
        r.raise_for_status()
        latencies.append(time.perf_counter() - start)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
  return latencies, time.perf_counter() - start


def load_levels(url: str, texts: list[str], levels, requests: int,
                beam_size: int) -> dict:
  rows = {}
  for concurrency in levels:
    n = max(requests // 4, concurrency) if concurrency == 1 else requests
    asyncio.run(_load(url, texts, concurrency, min(n, 4 * concurrency),
                      beam_size))
    before = httpx.get(url + '/metrics').json()
    latencies, wall = asyncio.run(_load(url, texts, concurrency, n, beam_size))
    after = httpx.get(url + '/metrics').json()
    ms = np.asarray(latencies) * 1e3
    rows[concurrency] = dict(
        requests=n, requests_per_s=n / wall,
        p50_ms=float(np.percentile(ms, 50)),
        p99_ms=float(np.percentile(ms, 99)),
        mean_batch=n / max(after['batches'] - before['batches'], 1))
  return rows


def test_sources(workdir: str, n: int = 512) -> list[str]:
  """The first ``n`` source sentences of the workdir's test split."""
  from xfmr_jax import data
  from xfmr_jax.workdir import Workdir
  config = Workdir(workdir).read_config()
  test = data.get_source(config['dataset'], 'test', config['data_dir'] or None)
  return [test[i][0] for i in range(min(len(test), n))]


def export_for_load(workdir: str, beam_sizes) -> tuple[str, dict]:
  """``(artifact folder, manifest)``: the workdir exported to a temporary
  folder with ``beam_sizes`` and only the buckets the toy test sentences
  need, so that the service's warm-up compiles few executables."""
  from xfmr_jax import export
  artifact = os.path.join(tempfile.mkdtemp(), 'artifact')
  manifest = export.export_workdir(workdir, artifact, beam_sizes=beam_sizes,
                                   buckets=(16, 32, 64),
                                   progress=lambda line: None)
  return artifact, manifest


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog='python -m experiments.benchmark.serving')
  p.add_argument('--workdir', required=True, help='a trained toy workdir')
  p.add_argument('--requests', type=int, default=256,
                 help='timed requests per level (a quarter at concurrency 1)')
  p.add_argument('--levels', default='1,8,32')
  p.add_argument('--cold_reps', type=int, default=3)
  p.add_argument('--port', type=int, default=8731)
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)
  texts = test_sources(args.workdir)
  start = time.perf_counter()
  artifact, manifest = export_for_load(args.workdir, beam_sizes=(4, 1))
  result = dict(machine=machine(), export_s=time.perf_counter() - start,
                cold_start_s={})
  samples = {kind: [] for kind in COLD}
  cache = tempfile.mkdtemp()
  cold_start('artifact_cached', artifact, texts[0], cache)  # fills the cache
  for _ in range(args.cold_reps):
    for kind in COLD:
      path = args.workdir if kind == 'checkpoint' else artifact
      samples[kind].append(cold_start(kind, path, texts[0], cache))
  result['cold_start_s'] = {k: statistics.median(v) for k, v in samples.items()}
  levels = [int(c) for c in args.levels.split(',')]
  beams = manifest['beam_sizes']
  from xfmr_jax import serving, workdir_translator
  result['decoder_ms_per_sentence'] = {
      'artifact': decoder_alone(serving.load(artifact), texts, beams),
      'workdir': decoder_alone(workdir_translator.WorkdirTranslator(
          args.workdir, beam_sizes=beams), texts, beams)}
  # A port each: a service that has just been stopped may still hold its
  # port for a moment, and the next one would then fail to bind while the
  # health check reached the old one.
  for offset, (name, extra) in enumerate((('batched', ()),
                                          ('one_at_a_time',
                                           ('--max_batch=1',)))):
    proc, url = _start_service(artifact, args.port + offset, *extra)
    try:
      result[name] = {beam: load_levels(url, texts, levels, args.requests,
                                        beam) for beam in beams}
    finally:
      proc.terminate()
      proc.wait()
  result['batching_speedup'] = {
      beam: {c: result['batched'][beam][c]['requests_per_s']
             / result['one_at_a_time'][beam][c]['requests_per_s']
             for c in levels} for beam in beams}
  print(format_table(result, levels, beams))
  if args.json:
    write_json(result, args.json)
  return result


def format_table(result: dict, levels, beams) -> str:
  lines = [f"machine: {result['machine']}",
           f"export {result['export_s']:.1f} s; cold start to the first "
           f"translation: artifact {result['cold_start_s']['artifact']:.1f} s, "
           f"artifact with a filled compilation cache "
           f"{result['cold_start_s']['artifact_cached']:.1f} s, "
           f"checkpoint {result['cold_start_s']['checkpoint']:.1f} s",
           '| beam | concurrency | batched req/s | p50 ms | p99 ms | mean batch '
           '| one-at-a-time req/s | p50 ms | p99 ms | speed-up |',
           '|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
  for source, alone in result['decoder_ms_per_sentence'].items():
    lines.append(f'{source} decoder alone, ms per sentence by batch size: '
                 + '; '.join(f'beam {beam}: ' + ', '.join(
                     f'{n}: {ms:.2f}' for n, ms in alone[beam].items())
                             for beam in beams))
  for beam in beams:
    for c in levels:
      b, o = result['batched'][beam][c], result['one_at_a_time'][beam][c]
      lines.append(
          f"| {beam} | {c} | {b['requests_per_s']:.1f} | {b['p50_ms']:.0f} | "
          f"{b['p99_ms']:.0f} | {b['mean_batch']:.1f} | "
          f"{o['requests_per_s']:.1f} | {o['p50_ms']:.0f} | {o['p99_ms']:.0f} "
          f"| {result['batching_speedup'][beam][c]:.2f}x |")
  return '\n'.join(lines)


if __name__ == '__main__':
  main()
