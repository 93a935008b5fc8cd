r"""Terminology constraints on the toy task: do they appear, and what do they
do to the rest of each translation?

    python -m experiments.toy_constraints --workdir=workdir/toy [--limit=N]

Decodes the split with beam search (``--beam_size``, default 4) four ways and
prints one Markdown table:

- no constraints;
- one word of its reference per sentence (its longest, the first of equals):
  a correct term should cost nothing;
- on the sentences the plain search gets wrong, the first reference word the
  output lacks, as a translator correcting one term would give it;
- a word its reference lacks (the longest target word of the next sentence's
  reference that this one's does not hold): a wrong term, which shows whether
  the rest survives (``rest kept``: the output with that word taken out is
  the reference).
"""
from __future__ import annotations

import json
import os

from absl import app, flags

from experiments import entry
from xfmr_jax import data, evaluation
from xfmr_jax.translate import Translator

_WORKDIR = flags.DEFINE_string('workdir', 'workdir/toy', 'A trained toy run.')
_SPLIT = flags.DEFINE_string('split', 'test', 'Split to decode.')
_BEAM = flags.DEFINE_integer('beam_size', 4, 'Beam size (at least 2).')
_LIMIT = flags.DEFINE_integer('limit', 0, 'Sentences to decode; 0 = all.')


def longest(words) -> str:
  return max(words, key=len)


def without_first(output: str, word: str) -> str:
  words = output.split()
  if word in words:
    words.remove(word)
  return ' '.join(words)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  entry.quiet_libraries()
  translate = Translator.from_workdir(_WORKDIR.value, beam_size=_BEAM.value)
  with open(os.path.join(_WORKDIR.value, 'config.json')) as f:
    config = json.load(f)
  source = data.get_source(config['dataset'], _SPLIT.value,
                           config['data_dir'] or None)
  n = len(source) if _LIMIT.value <= 0 else min(_LIMIT.value, len(source))
  pairs = [source[i] for i in range(n)]
  sources, refs = [p[0] for p in pairs], [p[1] for p in pairs]
  plain = translate(sources)

  def row(name, picked, terms, keep_rest=False):
    outputs = translate([sources[i] for i in picked],
                        constraints=[[t] for t in terms])
    appear = sum(t in o.split() for t, o in zip(terms, outputs))
    exact = sum(o == refs[i] for i, o in zip(picked, outputs))
    bleu, _ = evaluation.corpus_bleu(outputs, [refs[i] for i in picked])
    rest = (sum(without_first(o, t) == refs[i]
                for i, t, o in zip(picked, terms, outputs))
            if keep_rest else None)
    print(f'| {name} | {len(picked)} | {100 * appear / len(picked):.1f}% | '
          f'{100 * exact / len(picked):.2f}% | {bleu:.2f} | '
          f'{"-" if rest is None else f"{100 * rest / len(picked):.1f}%"} |')

  print(f'{_SPLIT.value}, beam {_BEAM.value}\n')
  print('| constraint per sentence | sentences | constraint appears | '
        'exact match | BLEU | rest kept |\n|---|---:|---:|---:|---:|---:|')
  bleu, _ = evaluation.corpus_bleu(plain, refs)
  exact = sum(o == r for o, r in zip(plain, refs))
  print(f'| none | {n} | - | {100 * exact / n:.2f}% | {bleu:.2f} | - |')
  row('a reference word', range(n), [longest(r.split()) for r in refs])
  failed = [i for i in range(n) if plain[i] != refs[i]]
  missing = {i: [w for w in refs[i].split() if w not in plain[i].split()]
             for i in failed}
  fixable = [i for i in failed if missing[i]]
  if fixable:
    row('a reference word the output lacks (failed sentences)', fixable,
        [missing[i][0] for i in fixable])
  foreign = [[w for w in refs[(i + 1) % n].split()
              if w not in refs[i].split()] for i in range(n)]
  wrong = [i for i in range(n) if foreign[i]]
  row('a word the reference lacks', wrong,
      [longest(foreign[i]) for i in wrong], keep_rest=True)


if __name__ == '__main__':
  entry.run(main)
