"""Beam search with and without dropping finished sentences, on a trained
workdir's test sentences.

    python -m experiments.benchmark.compaction --workdir=workdir/toy \\
        [--sentences 256] [--batch_size 64] [--beam 4] [--rounds 5]

A random model seldom emits EOS, so its sentences all run to the output
length and have nothing to drop; a trained model's outputs end at many
different steps. The test sentences are cut into batches of ``--batch_size``
in file order (as requests arrive, not sorted by length), each padded to its
width bucket, and translated by :func:`xfmr_jax.decode.beam_search` with
``compact=False`` (every row decoded until the batch is done) and
``compact=True`` (the live sentences moved into a smaller batch as the
others finish), in alternating rounds after one untimed call of each. The
tokens of both are checked equal. Reported: sentences/s per round for each,
and the ratio.
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from experiments import benchmark as package
from experiments.benchmark.common import machine
from experiments.benchmark.report import write_json


def _batches(trained, texts, batch_size):
  from xfmr_jax import source_batches
  from xfmr_jax.translate import Translator
  max_len = trained.model.config.max_len
  out = []
  for start in range(0, len(texts), batch_size):
    rows = [source_batches.encode_source(trained.tokenizer, text, i, max_len)
            for i, text in enumerate(texts[start:start + batch_size])]
    width = Translator.bucket(max(len(r) for r in rows), max_len)
    out.append(source_batches.pad_rows(rows, width, batch_size))
  return out


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(prog='python -m experiments.benchmark.compaction')
  p.add_argument('--workdir', required=True)
  p.add_argument('--sentences', type=int, default=256)
  p.add_argument('--batch_size', type=int, default=64)
  p.add_argument('--beam', type=int, default=4)
  p.add_argument('--rounds', type=int, default=5)
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)
  from xfmr_jax import data, decode
  from xfmr_jax.workdir import Workdir
  trained = Workdir(args.workdir).load()
  test = data.get_source(trained.config.dataset, 'test',
                         trained.config.data_dir or None,
                         reverse=trained.config.reverse)
  texts = [test[i][0] for i in range(min(args.sentences, len(test)))]
  batches = _batches(trained, texts, args.batch_size)

  def run(compact):
    return [jax.block_until_ready(decode.beam_search(
        trained.model, trained.params, src, beam_size=args.beam,
        compact=compact)) for src in batches]

  outputs = {c: run(c) for c in (False, True)}  # compiles every width
  for (a, _), (b, _) in zip(outputs[False], outputs[True]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  seconds = {False: [], True: []}
  for r in range(args.rounds):
    for compact in ((False, True) if r % 2 == 0 else (True, False)):
      t0 = time.perf_counter()
      run(compact)
      seconds[compact].append(time.perf_counter() - t0)
  res = dict(command='python -m experiments.benchmark.compaction ' +
             ' '.join(argv), machine=machine(), sentences=len(texts),
             batch_size=args.batch_size, beam=args.beam,
             all_rows_sentences_per_sec=[len(texts) / s for s in seconds[False]],
             compact_sentences_per_sec=[len(texts) / s for s in seconds[True]])
  res['speedup'] = float(np.median(seconds[False]) / np.median(seconds[True]))
  print(f"{res['machine']}; {len(texts)} sentences, batches of "
        f"{args.batch_size}, beam {args.beam}\n"
        '| search | sentences/s per round (median) |\n|---|---:|')
  for name, key in (('every row to the end', 'all_rows_sentences_per_sec'),
                    ('finished sentences dropped', 'compact_sentences_per_sec')):
    rates = res[key]
    print(f"| {name} | {', '.join(f'{v:.1f}' for v in rates)} "
          f"({np.median(rates):.1f}) |")
  print(f"speed-up (median seconds): {res['speedup']:.2f}x")
  if args.json:
    write_json(res, args.json)
  return res


if __name__ == '__main__':
  package.no_compilation_cache()
  main()
