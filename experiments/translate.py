"""Translate stdin to stdout with a trained model: one line in, one line out.

    echo "a source sentence" | python -m experiments.translate --workdir=DIR

Output has the same number of lines in the same order; an empty line gives an
empty line. Invalid UTF-8 bytes are replaced, never fatal. Lines longer than the
model's maximum are truncated with a warning on stderr (``--too_long=error``
rejects them instead).

``--nbest=K`` prints the K best translations of each line instead, best first,
one per output line in the Moses n-best format
``LINE ||| TRANSLATION ||| SCORE ||| LOG_PROB``: ``LINE`` counts input lines
from 0, ``SCORE`` is what the beam search ranks by (log p normalised for
length), ``LOG_PROB`` the plain log-probability. An empty line prints none.

``--prefixes=FILE`` gives each line a target prefix, the line of FILE with the
same number (an empty line: none): its translation starts with that prefix,
and the decoder continues from there (interactive translation). FILE must have
as many lines as the input.

``--constraints=FILE`` gives each line terminology constraints, the line of
FILE with the same number: target phrases separated by tabs (an empty line:
none), each of which its translation must contain (beam search only; see
:mod:`xfmr_jax.constraints`).

``--document`` reads stdin as one document instead: its sentences (split by
the rules of ``--language``) are translated and printed between the original
spaces, line breaks and blank lines; a sentence longer than the model's
maximum is cut into parts at word boundaries, never truncated.

``--score=FILE`` scores given translations instead, the line of FILE with the
same number for each input line: it prints ``LOG_PROB ||| TOKEN_LOG_PROBS``,
the target's log-probability under the model and that of each of its tokens
and the EOS (teacher forcing; an empty input line is an error).

``--alignments`` prints ``TRANSLATION ||| LINKS`` per line, ``LINKS`` being
``SOURCE_WORD-TRANSLATION_WORD`` index pairs (from 0, words split at
whitespace), from the cross-attention of ``--alignment_layer`` (default the
penultimate decoder layer); see :mod:`xfmr_jax.alignment`.
"""
from __future__ import annotations

import os
import sys

from absl import flags

from experiments import entry

_WORKDIR = flags.DEFINE_string('workdir', None, 'Training workdir to load.',
                               required=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step; default newest.')
_BEAM = flags.DEFINE_integer('beam_size', 4, 'Beam size; 1 = greedy.')
_ALPHA = flags.DEFINE_float('alpha', None, 'Length penalty exponent; default '
                            "the workdir config's beam_alpha (0.6 unless set).")
_RULES = flags.DEFINE_enum('beam_rules', None, ['gnmt', 'hf'],
                           "Beam scoring; default the workdir config's "
                           "(gnmt; 'hf' for an imported Marian model).")
_EXTRA = flags.DEFINE_integer('max_decode_extra', 50,
                              'Decode up to input length + this many tokens.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.0,
                                  'Sample at this temperature if > 0.')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample from the k best (0 = all).')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
_BATCH = flags.DEFINE_integer('batch_size', 64,
                              'The most sentences per decoder call.')
_NBEST = flags.DEFINE_integer('nbest', 0, 'Print the K best translations of '
                              'each line (K <= beam_size; 0: the best alone).')
_NO_REPEAT = flags.DEFINE_integer(
    'no_repeat_ngram_size', 0, 'Never repeat an n-gram of this size in an '
    'output (0: off).')
_PENALTY = flags.DEFINE_float(
    'repetition_penalty', 1.0, 'Make tokens an output already has less '
    'likely by this factor (1: off).')
_PREFIXES = flags.DEFINE_string(
    'prefixes', None, 'A file of target prefixes, one per input line (an '
    'empty line: none); each translation starts with its prefix.')
_CONSTRAINTS = flags.DEFINE_string(
    'constraints', None, 'A file of terminology constraints, one line per '
    'input line: target phrases separated by tabs, each of which the '
    'translation must contain (an empty line: none).')
_SCORE = flags.DEFINE_string(
    'score', None, 'A file of translations, one per input line, to score '
    'instead of translating: prints LOG_PROB ||| TOKEN_LOG_PROBS per line.')
_ALIGN = flags.DEFINE_boolean(
    'alignments', False, 'Print each translation with its word alignment: '
    'TRANSLATION ||| 0-0 1-2 ...')
_ALIGN_LAYER = flags.DEFINE_integer(
    'alignment_layer', None, 'The decoder layer whose cross-attention aligns '
    '(default the penultimate; negative counts from the last).')
_DOCUMENT = flags.DEFINE_boolean(
    'document', False, 'Translate stdin as one document, sentence by '
    'sentence, keeping its layout.')
_LANGUAGE = flags.DEFINE_string(
    'language', 'en', "The source language's code (ISO 639), whose "
    'sentence-splitting rules --document uses.')
_TOO_LONG = flags.DEFINE_enum('too_long', 'truncate', ['truncate', 'error'],
                              'What to do with over-long lines.')


def read_lines(stream) -> list[str]:
  """Lines of a binary stream, decoded as UTF-8 with bad bytes replaced."""
  text = stream.read().decode('utf-8', errors='replace')
  lines = text.split('\n')
  if lines and lines[-1] == '':
    lines.pop()  # the final newline ends the last line; it adds none
  return [line.rstrip('\r') for line in lines]


def check_flags() -> None:
  """Every decoding flag in its range, before anything is loaded."""
  for name, value, low in (('beam_size', _BEAM.value, 1),
                           ('batch_size', _BATCH.value, 1),
                           ('max_decode_extra', _EXTRA.value, 0),
                           ('top_k', _TOP_K.value, 0),
                           ('nbest', _NBEST.value, 0),
                           ('no_repeat_ngram_size', _NO_REPEAT.value, 0)):
    if value < low:
      entry.fail(f'--{name} must be at least {low}, got {value}')
  if (_ALPHA.value is not None and _ALPHA.value < 0) or _TEMPERATURE.value < 0:
    entry.fail('--alpha and --temperature must be >= 0')
  if not _PENALTY.value > 0:
    entry.fail(f'--repetition_penalty must be > 0, got {_PENALTY.value}')
  if not 0 < _TOP_P.value <= 1:
    entry.fail(f'--top_p must be in (0, 1], got {_TOP_P.value}')
  if _NBEST.value > _BEAM.value:
    entry.fail(f'--nbest {_NBEST.value} is more than --beam_size '
               f'{_BEAM.value}: the search keeps beam_size hypotheses')
  if _NBEST.value and _TEMPERATURE.value > 0:
    entry.fail('--nbest needs beam search; it cannot be used with '
               '--temperature > 0')
  if _ALIGN.value and _NBEST.value:
    entry.fail('--alignments and --nbest cannot be combined: alignments are '
               'printed for the best translation')
  if _DOCUMENT.value and (_NBEST.value or _ALIGN.value or
                          _PREFIXES.value or _CONSTRAINTS.value):
    entry.fail('--document translates a whole text; it cannot be combined '
               'with --nbest, --alignments, --prefixes or --constraints')
  if _CONSTRAINTS.value is not None and (
      _BEAM.value == 1 or _TEMPERATURE.value > 0 or _PREFIXES.value):
    entry.fail('--constraints needs beam search (--beam_size > 1, no '
               '--temperature) and no --prefixes')
  if _SCORE.value is not None and (
      _DOCUMENT.value or _NBEST.value or _ALIGN.value or _PREFIXES.value or
      _CONSTRAINTS.value):
    entry.fail('--score scores given translations; it cannot be combined '
               'with --document, --nbest, --alignments, --prefixes or '
               '--constraints')
  if _ALIGN_LAYER.value is not None and not _ALIGN.value:
    entry.fail('--alignment_layer needs --alignments')
  for name, path in (('prefixes', _PREFIXES.value),
                     ('constraints', _CONSTRAINTS.value),
                     ('score', _SCORE.value)):
    if path is not None and not os.path.isfile(path):
      entry.fail(f'--{name} {path!r} is not a file')
  if not os.path.isdir(_WORKDIR.value):
    entry.fail(f'--workdir {_WORKDIR.value!r} is not a directory')


def main(argv):
  if len(argv) > 1:
    entry.fail(f'unexpected arguments: {argv[1:]}')
  check_flags()
  # Read before the model loads.
  if _DOCUMENT.value:
    text = sys.stdin.buffer.read().decode('utf-8', errors='replace')
  else:
    lines = read_lines(sys.stdin.buffer)
    prefixes = per_line(_PREFIXES, 'prefix', lines)
    targets = per_line(_SCORE, 'translation', lines)
    constraints = per_line(_CONSTRAINTS, 'constraint', lines)
    if constraints is not None:
      constraints = [[p for p in line.split('\t') if p] for line in
                     constraints]
  entry.quiet_libraries()
  from xfmr_jax.translate import Translator
  chosen = {name: flag.value for name, flag in (('alpha', _ALPHA),
                                                ('beam_rules', _RULES))
            if flag.value is not None}
  translator = Translator.from_workdir(
      _WORKDIR.value, _STEP.value, beam_size=_BEAM.value, **chosen,
      max_decode_extra=_EXTRA.value, batch_size=_BATCH.value,
      too_long=_TOO_LONG.value, temperature=_TEMPERATURE.value,
      top_k=_TOP_K.value, top_p=_TOP_P.value, seed=_SEED.value,
      no_repeat_ngram_size=_NO_REPEAT.value,
      repetition_penalty=_PENALTY.value)
  if _DOCUMENT.value:
    sys.stdout.write(translator.translate_document(text, _LANGUAGE.value))
  elif targets is not None:
    try:
      scored = translator.score(lines, targets)
    except ValueError as e:
      entry.fail(f'--score: {e}')
    sys.stdout.write(''.join(
        f"{sum(map(float, p)):.6f} ||| {' '.join(f'{x:.6f}' for x in p)}\n"
        for p in scored))
  elif _NBEST.value:
    sys.stdout.write(''.join(nbest_lines(translator.nbest(
        lines, _NBEST.value, prefixes, constraints))))
  elif _ALIGN.value:
    from xfmr_jax import alignment
    layers = translator.model.config.num_decoder_layers
    if _ALIGN_LAYER.value is not None:
      try:
        alignment.check_layer(_ALIGN_LAYER.value, layers)
      except ValueError as e:
        entry.fail(str(e))
    sys.stdout.write(''.join(
        f"{a.text} ||| {' '.join(f'{s}-{o}' for s, o in a.links)}\n"
        for a in translator.align(lines, prefixes, constraints,
                                  layer=_ALIGN_LAYER.value)))
  else:
    sys.stdout.write(''.join(
        line + '\n' for line in translator(lines, prefixes, constraints)))


def per_line(flag, what: str, lines) -> list[str] | None:
  """The lines of the file a flag names (None: no flag), one per input
  line."""
  if flag.value is None:
    return None
  with open(flag.value, 'rb') as f:
    given = read_lines(f)
  if len(given) != len(lines):
    entry.fail(f'--{flag.name} has {len(given)} lines but the input has '
               f'{len(lines)}: give one {what} line (maybe empty) per input '
               'line')
  return given


def nbest_lines(nbest) -> list[str]:
  """Moses n-best lines for :meth:`Translator.nbest`'s lists."""
  return [f'{i} ||| {h.text} ||| {h.score:.6f} ||| {h.log_prob:.6f}\n'
          for i, hyps in enumerate(nbest) for h in hyps]


if __name__ == '__main__':
  entry.run(main)
