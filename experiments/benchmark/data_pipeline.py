"""The input pipeline at corpus scale, on a synthetic WMT-sized corpus:

    python -m experiments.benchmark.data_pipeline --pairs 4500000 --dir /tmp/corpus

writes (once; reused if present) the corpus as TSV and as array_record
(``source<TAB>target`` records read with ``grain.sources.ArrayRecordDataSource``),
then measures on one process and one core (``prefetch=False``, no threads):

* tokenizer training time on the configs' sample (``tokenizer_max_sentences``);
* packed-batch throughput of ``make_train_iterator``: non-padding tokens/s
  (source + target) and packing efficiency (non-padding share of the rows);
* the memory the source and iterator hold (growth of resident anonymous
  memory: mapped file pages are page cache, not counted);
* resuming mid-epoch: ``set_state`` on a fresh iterator, time to its first
  batch, and whether the batches that follow are identical;
* the same tokenised stream packed by ``grain.experimental.FirstFitPackIterDataset``
  (then ``.batch``): speed, efficiency, and exact resume of its state.

Sentence lengths are log-normal, chosen to resemble WMT14 (median 22 words, a
long tail; cut at 200), words Zipf-distributed over 60k synthetic words a side.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from experiments.benchmark.common import machine
from experiments.benchmark.report import write_json


def anon_bytes() -> int:
  """Resident anonymous memory: what the process holds, without the pages
  of files it maps (those are the page cache's, given back under pressure)."""
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('RssAnon:'):
        return int(line.split()[1]) * 1024
  raise OSError('no RssAnon in /proc/self/status')


def _words(n: int, rng) -> np.ndarray:
  letters = np.array(list('abcdefghijklmnopqrstuvwxyzäöü'))
  lengths = rng.integers(2, 11, n)
  return np.array([''.join(rng.choice(letters, k)) for k in lengths])


def write_corpus(folder: str, pairs: int, seed: int = 0) -> dict:
  """``folder``/train.tsv and train.array_record; returns their paths."""
  from array_record.python.array_record_module import ArrayRecordWriter
  paths = dict(tsv=os.path.join(folder, 'train.tsv'),
               array_record=os.path.join(folder, 'train.array_record'))
  done = os.path.join(folder, f'done_{pairs}')
  if os.path.exists(done):
    return paths
  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(seed)
  vocab = (_words(60_000, rng), _words(60_000, rng))
  zipf = 1.0 / np.arange(1, 60_001)
  zipf /= zipf.sum()
  writer = ArrayRecordWriter(paths['array_record'], 'group_size:1')
  with open(paths['tsv'], 'w', encoding='utf-8') as tsv:
    for start in range(0, pairs, 100_000):
      n = min(100_000, pairs - start)
      length = np.clip(rng.lognormal(3.1, 0.6, n), 1, 200).astype(int)
      sides = []
      for words in vocab:
        ids = rng.choice(60_000, int(length.sum()), p=zipf)
        flat = words[ids]
        cuts = np.cumsum(length)[:-1]
        sides.append([' '.join(s) for s in np.split(flat, cuts)])
      for s, t in zip(*sides):
        line = f'{s}\t{t}'
        tsv.write(line + '\n')
        writer.write(line.encode('utf-8'))
  writer.close()
  open(done, 'w').close()
  return paths


class ArrayRecordPairs:
  """``(source, target)`` pairs of tab-joined array_record records."""

  def __init__(self, path: str):
    from grain.sources import ArrayRecordDataSource
    self.records = ArrayRecordDataSource([path])

  def __len__(self):
    return len(self.records)

  def _pair(self, record: bytes):
    return tuple(record.decode('utf-8').split('\t', 1))

  def __getitem__(self, i):
    return self._pair(self.records[i])

  def __getitems__(self, indices):
    return [self._pair(r) for r in self.records.__getitems__(list(indices))]


def _tokens(batch) -> int:
  return int((batch['inputs'] > 0).sum() + (batch['targets'] > 0).sum())


def _throughput(it, batches: int) -> dict:
  next(it)  # warm-up: the first chunk's read
  t0, tokens, slots = time.perf_counter(), 0, 0
  for _ in range(batches):
    b = next(it)
    tokens += _tokens(b)
    slots += b['inputs'].size + b['targets'].size
  dt = time.perf_counter() - t0
  return dict(tokens_per_s=tokens / dt, batches_per_s=batches / dt,
              packing_efficiency=tokens / slots)


def _same(a, b) -> bool:
  return all(np.array_equal(a[k], b[k]) for k in a)


def _resume(make, skip: int, check: int) -> dict:
  """State after ``skip`` batches; a fresh iterator set to it must give the
  same next ``check`` batches."""
  it = make()
  for _ in range(skip):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # as it is checkpointed
  expected = [next(it) for _ in range(check)]
  t0 = time.perf_counter()
  fresh = make()
  fresh.set_state(state)
  first = next(fresh)
  seconds = time.perf_counter() - t0
  got = [first] + [next(fresh) for _ in range(check - 1)]
  return dict(resume_s=seconds, exact=all(map(_same, expected, got)),
              state_bytes=len(json.dumps(state)))


def _grain_packed(source, tokenizer, *, batch_size, max_length, seed):
  """The project's read/tokenise stream, packed by grain's first-fit."""
  import grain
  from xfmr_jax.data import pipeline
  ds = grain.MapDataset.range(len(source)).shuffle(seed=seed).repeat(None)
  ds = ds.batch(pipeline.READ_CHUNK).map(
      lambda idx: pipeline.tokenize_pairs(
          pipeline.read_pairs(source, idx.tolist()), tokenizer))
  flat = ds.to_iter_dataset(grain.ReadOptions(num_threads=0,
                                              prefetch_buffer_size=0))

  class Pairs(grain.experimental.FlatMapTransform):
    """A chunk -> its pairs, filtered by length as ours are."""
    max_fan_out = pipeline.READ_CHUNK

    def flat_map(self, chunk):
      return [dict(inputs=s, targets=t) for s, t in chunk
              if max(len(s), len(t)) <= max_length]

  flat = grain.experimental.FlatMapIterDataset(flat, Pairs())
  packed = grain.experimental.FirstFitPackIterDataset(
      flat, length_struct=dict(inputs=max_length, targets=max_length),
      num_packing_bins=batch_size, shuffle_bins=False)
  return iter(packed.batch(batch_size))


def _stages(source, tokenizer, chunks: int = 20) -> dict:
  """Random 256-pair reads alone, then SentencePiece alone on what they read:
  which of the two a packed batch waits for."""
  from xfmr_jax.data import pipeline
  rng = np.random.default_rng(1)
  t0, pairs = time.perf_counter(), []
  for _ in range(chunks):
    idx = rng.integers(0, len(source), pipeline.READ_CHUNK).tolist()
    pairs += pipeline.read_pairs(source, idx)
  read_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  tokens = sum(len(s) + len(t)
               for s, t in pipeline.tokenize_pairs(pairs, tokenizer))
  return dict(read_pairs_per_s=len(pairs) / read_s,
              tokenize_tokens_per_s=tokens / (time.perf_counter() - t0))


def bench(source, tokenizer, args) -> dict:
  from xfmr_jax import data
  make = lambda: data.make_train_iterator(
      source, tokenizer, batch_size=args.batch_size,
      max_length=args.max_length, seed=0, prefetch=False, shard_index=0,
      shard_count=1)
  out = dict(stages=_stages(source, tokenizer),
             ours=_throughput(make(), args.batches))
  out['ours'].update(_resume(make, args.resume_after, 3))
  make_grain = lambda: _grain_packed(source, tokenizer,
                                     batch_size=args.batch_size,
                                     max_length=args.max_length, seed=0)
  out['grain_first_fit'] = _throughput(make_grain(), args.batches)
  out['grain_first_fit'].update(_resume(make_grain, args.resume_after, 3))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(prog='python -m experiments.benchmark.data_pipeline')
  p.add_argument('--pairs', type=int, default=4_500_000)
  p.add_argument('--dir', default='/tmp/xfmr_corpus')
  p.add_argument('--vocab_size', type=int, default=37_000)
  p.add_argument('--tokenizer_sentences', type=int, default=200_000)
  p.add_argument('--batch_size', type=int, default=96)
  p.add_argument('--max_length', type=int, default=256)
  p.add_argument('--batches', type=int, default=40)
  p.add_argument('--resume_after', type=int, default=25)
  p.add_argument('--sources', default='array_record,tsv')
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)
  from xfmr_jax.data import TextPairSource
  from xfmr_jax.tokenizer import Tokenizer
  t0 = time.perf_counter()
  paths = write_corpus(args.dir, args.pairs)
  result = dict(machine=machine(), pairs=args.pairs, args=vars(args),
                corpus_s=time.perf_counter() - t0,
                corpus_bytes=os.path.getsize(paths['tsv']))
  print(f"corpus: {args.pairs} pairs, {result['corpus_bytes'] / 1e9:.2f} GB "
        f"TSV ({result['corpus_s']:.0f} s)", flush=True)
  sources = {}
  for kind in args.sources.split(','):
    before = anon_bytes()
    t0 = time.perf_counter()
    src = (ArrayRecordPairs(paths['array_record']) if kind == 'array_record'
           else TextPairSource(paths['tsv']))
    sources[kind] = src
    result[kind] = dict(open_s=time.perf_counter() - t0,
                        held_bytes=anon_bytes() - before)
    print(f"{kind}: opened in {result[kind]['open_s']:.1f} s, holds "
          f"{result[kind]['held_bytes'] / 1e6:.0f} MB", flush=True)
  src = next(iter(sources.values()))
  n = min(len(src), args.tokenizer_sentences // 2)
  sample = src.__getitems__(np.linspace(0, len(src) - 1, n).astype(int).tolist())
  t0 = time.perf_counter()
  tokenizer = Tokenizer.train([t for pair in sample for t in pair],
                              vocab_size=args.vocab_size)
  result['tokenizer_s'] = time.perf_counter() - t0
  print(f"tokenizer: {args.vocab_size} BPE pieces from {2 * n} sentences in "
        f"{result['tokenizer_s']:.1f} s", flush=True)
  for kind, src in sources.items():
    before = anon_bytes()
    result[kind].update(bench(src, tokenizer, args))
    result[kind]['pipeline_held_bytes'] = anon_bytes() - before
    st = result[kind]['stages']
    print(f"{kind}: random reads {st['read_pairs_per_s']:,.0f} pairs/s; "
          f"SentencePiece {st['tokenize_tokens_per_s']:,.0f} tokens/s",
          flush=True)
    for name in ('ours', 'grain_first_fit'):
      r = result[kind][name]
      print(f"{kind} {name}: {r['tokens_per_s']:,.0f} tokens/s, packing "
            f"{r['packing_efficiency']:.1%}, resume {r['resume_s']:.2f} s "
            f"(exact: {r['exact']}, state {r['state_bytes']} bytes)",
            flush=True)
  if args.json:
    write_json(result, args.json)
  return result


if __name__ == '__main__':
  main()
