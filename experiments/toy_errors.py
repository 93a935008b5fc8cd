r"""Which toy-task sentences a trained model gets wrong, and how.

    python -m experiments.toy_errors --workdir=workdir/toy [--split=test]

Decodes the split (greedy unless ``--beam_size``) and prints Markdown tables:
exact match by source length and by the number of relative clauses, and each
wrong word of the failed sentences by kind: a verb's tense/agreement suffix,
a noun's number, another word, a missing or extra word, or the right words in
the wrong order.
"""
from __future__ import annotations

import collections
import difflib
import json
import os

from absl import app, flags

from experiments import entry
from xfmr_jax import data, evaluation, repetition
from xfmr_jax.data import toy_language as tl
from xfmr_jax.translate import Translator

_WORKDIR = flags.DEFINE_string('workdir', 'workdir/toy', 'A trained toy run.')
_SPLIT = flags.DEFINE_string('split', 'test', 'Split to decode.')
_BEAM = flags.DEFINE_integer('beam_size', 1, '1 = greedy.')
_LIMIT = flags.DEFINE_integer('limit', 0, 'Sentences to decode; 0 = all.')
_NO_REPEAT = flags.DEFINE_integer('no_repeat_ngram_size', 0,
                                  'Decode with no repeated n-gram of this size.')
_PENALTY = flags.DEFINE_float('repetition_penalty', 1.0,
                              'Decode with this repetition penalty.')

# A target verb ends in (tense +) agreement, e.g. 'mishoti' + 'zo' + 'nar'.
VERB_ENDINGS = {t + a for t in tl.TENSE_SUFFIX for a in tl.AGREEMENT_SUFFIX}


def word_error(out: str, ref: str) -> str:
  """The kind of one substituted word ``out`` for ``ref``."""
  if tl.PLURAL_SUFFIX in (out[len(ref):], ref[len(out):]) and (
      out.startswith(ref) or ref.startswith(out)):
    return 'noun number'
  for cut in range(len(os.path.commonprefix([out, ref])), 0, -1):
    if out[cut:] in VERB_ENDINGS and ref[cut:] in VERB_ENDINGS:
      return 'verb tense/agreement'
  return 'other word'


def errors_of(output: str, reference: str) -> list[str]:
  """Kinds of the differences between one output and its reference."""
  o, r = output.split(), reference.split()
  if sorted(o) == sorted(r):
    return ['word order']
  kinds = []
  for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=o, b=r).get_opcodes():
    if op == 'replace' and i2 - i1 == j2 - j1:
      kinds += [word_error(a, b) for a, b in zip(o[i1:i2], r[j1:j2])]
    elif op != 'equal':
      kinds.append('missing/extra words')
  return kinds


def length_bin(n: int) -> str:
  return '3-10' if n <= 10 else '11-20' if n <= 20 else '21-30' if n <= 30 \
      else '31+'


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  translate = Translator.from_workdir(
      _WORKDIR.value, beam_size=_BEAM.value,
      no_repeat_ngram_size=_NO_REPEAT.value,
      repetition_penalty=_PENALTY.value)
  with open(os.path.join(_WORKDIR.value, 'config.json')) as f:
    config = json.load(f)
  source = data.get_source(config['dataset'], _SPLIT.value,
                           config['data_dir'] or None)
  result = evaluation.evaluate_translation(translate, source, _LIMIT.value,
                                           progress='decode')
  samples = result['samples']
  by_len, by_rc = collections.defaultdict(list), collections.defaultdict(list)
  kinds = collections.Counter()
  for s in samples:
    ok = s['output'] == s['reference']
    words = s['source'].split()
    by_len[length_bin(len(words))].append(ok)
    by_rc[min(words.count(tl.RELATIVIZER), 3)].append(ok)
    if not ok:
      kinds.update(errors_of(s['output'], s['reference']))
  print(f"{_SPLIT.value}: {len(samples)} sentences, exact match "
        f"{100 * result['exact_match']:.2f}%, BLEU {result['bleu']:.2f}\n")
  print('| source words | sentences | exact match |\n|---|---:|---:|')
  for k in ('3-10', '11-20', '21-30', '31+'):
    if by_len[k]:
      print(f'| {k} | {len(by_len[k])} | '
            f'{100 * sum(by_len[k]) / len(by_len[k]):.2f}% |')
  print('\n| relative clauses | sentences | exact match |\n|---|---:|---:|')
  for k in sorted(by_rc):
    label = f'{k}+' if k == 3 else str(k)
    print(f'| {label} | {len(by_rc[k])} | '
          f'{100 * sum(by_rc[k]) / len(by_rc[k]):.2f}% |')
  print('\n| error in a failed sentence | count |\n|---|---:|')
  for kind, n in kinds.most_common():
    print(f'| {kind} | {n} |')
  failed = [s for s in samples if s['output'] != s['reference']]
  loops = sum(repetition.loops(s['output'].split()) for s in failed)
  print(f'\n{loops} of the {len(failed)} failed outputs loop (one to three '
        'words three times in a row)')
  for s in failed[:5]:
    print(f"\n  source:    {s['source']}\n  reference: {s['reference']}\n"
          f"  output:    {s['output']}")


if __name__ == '__main__':
  entry.run(main)
