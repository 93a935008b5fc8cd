"""The translate Python API and CLI on a model trained for a short while."""
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from xfmr_jax import checkpoint, data, decode, source_batches
from xfmr_jax.token_ids import EOS, PAD
from xfmr_jax.translate import BUCKETS, Translator

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def workdir(trained_workdir):
  return trained_workdir


@pytest.fixture(scope='module')
def translator(workdir):
  return Translator.from_workdir(str(workdir), batch_size=8)


@pytest.fixture(scope='module')
def beam_translator(workdir):
  return Translator.from_workdir(str(workdir), batch_size=8, beam_size=4)


@pytest.mark.slow
def test_trained_model_translates_held_out_sentences(translator, data_dir):
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  pairs = sorted((test[i] for i in range(len(test))),
                 key=lambda p: len(p[0].split()))[:12]
  outputs = translator([p[0] for p in pairs])
  exact = sum(o == p[1] for o, p in zip(outputs, pairs))
  assert exact >= 9, list(zip(outputs, pairs))


def test_order_count_empty_lines_and_batching(translator, data_dir):
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  sources = [test[i][0] for i in range(20)]
  inputs = sources[:7] + ['', '   '] + sources[7:]
  out = translator(inputs)
  assert len(out) == len(inputs)
  assert out[7] == '' and out[8] == ''
  alone = [translator([s])[0] for s in sources[:4]]
  assert out[:4] == alone  # batching and sorting do not change a translation
  assert out[9:] == translator(sources[7:])


def test_compilations_are_bounded_by_buckets(translator):
  words = 'drag glipos that vol fodibri lod plowad wad vobrap glapi'.split()
  before = sum(decode.TRACE_COUNTS.values())
  for n in range(1, 41):
    translator([' '.join((words * 5)[:n])])
  compiled = sum(decode.TRACE_COUNTS.values()) - before
  assert compiled <= 3  # lengths 2..~50 tokens fall into buckets 16, 32, 64
  assert 16 in BUCKETS and Translator.bucket(17, 512) == 32


def test_a_call_pads_its_rows_to_a_power_of_two(translator, monkeypatch):
  rows, decode_ids = [], translator.decode_ids
  monkeypatch.setattr(translator, 'decode_ids',
                      lambda x, *options: rows.append(len(x)) or
                      decode_ids(x, *options))
  for n in (1, 3, 8, 9):  # batch_size 8
    out = translator(['drag glipos'] * n)
    assert len(out) == n and len(set(out)) == 1
  assert rows == [1, 4, 8, 8, 1]


def test_row_counts_stop_at_a_batch_size_that_is_no_power_of_two():
  assert source_batches.row_counts(6) == [1, 2, 4, 6]
  for n, rows in ((1, 1), (3, 4), (5, 6), (6, 6)):
    padded = source_batches.pad_rows([[5, 7, 1]] * n, 4, 6)
    assert padded.shape == (rows, 4)
    assert (padded[:n] == [5, 7, 1, 0]).all() and (padded[n:] == 0).all()


def test_scores_equal_a_float64_teacher_forced_computation(translator,
                                                          data_dir):
  """One forward pass per call gives each target token's log-probability:
  the float64 log-softmax of the cached step decoder's logits (another path
  through the model, at the sentence's own unpadded width), whatever the
  batch; an empty target scores EOS alone."""
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  sources = [test[i][0] for i in range(10)]
  targets = [test[i][1] for i in range(10)]
  targets[2] = ''
  targets[5] = translator([sources[5]])[0] + ' extra'
  got = translator.score(sources, targets)
  tok = translator.tokenizer
  for i, (s, t) in enumerate(zip(sources, targets)):
    src = np.array([tok.encode(s) + [EOS]], np.int32)
    tgt = np.array([tok.encode(t) + [EOS]], np.int32)
    logits = np.asarray(decode.cached_logits(
        translator.model, translator.params, src, tgt), np.float64)[0]
    logits -= logits.max(-1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = log_p[np.arange(tgt.shape[1]), tgt[0]]
    assert got[i].shape == want.shape, i
    np.testing.assert_allclose(got[i], want, atol=1e-4)
  assert got[2].shape == (1,)
  # A reference translation is likelier than the same with a word appended.
  assert got[5][:-2].sum() > got[5].sum()
  alone = [translator.score([s], [t])[0] for s, t in zip(sources[:3],
                                                         targets[:3])]
  for a, b in zip(alone, got):
    np.testing.assert_allclose(a, b, atol=1e-5)


def gnmt_log_prob(translator, source, text):
  """``log p(text + EOS | source)`` in float64 by teacher forcing through the
  cached step decoder, the pad id banned as GNMT's search bans it."""
  tok = translator.tokenizer
  src = np.array([tok.encode(source) + [EOS]], np.int32)
  tgt = np.array([tok.encode_target(text) + [EOS]], np.int32)
  logits = np.asarray(decode.cached_logits(translator.model, translator.params,
                                           src, tgt), np.float64)[0]
  logits[:, PAD] = -np.inf
  logits -= logits.max(-1, keepdims=True)
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return log_p[np.arange(tgt.shape[1]), tgt[0]].sum()


def test_nbest_lists_rank_hypotheses_the_model_scores_alike(
    beam_translator, data_dir):
  """The n-best list's first entry is the translation; the entries are
  distinct, ranked by score, and each log_prob is what teacher forcing gives
  its text in float64 through the cached step decoder; an empty line gets
  an empty list."""
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  sources = [test[i][0] for i in range(6)] + ['']
  nbest = beam_translator.nbest(sources, 3)
  assert nbest[-1] == []
  best = beam_translator(sources[:-1])
  for i, hyps in enumerate(nbest[:-1]):
    assert len(hyps) == 3 and hyps[0].text == best[i]
    assert len({h.text for h in hyps}) == 3
    assert [h.score for h in hyps] == sorted((h.score for h in hyps),
                                             reverse=True)
    for h in hyps:
      assert h.log_prob == pytest.approx(
          gnmt_log_prob(beam_translator, sources[i], h.text), abs=1e-4)
      assert h.log_prob <= h.score < 0  # the penalty divides by >= 1
  with pytest.raises(ValueError, match='between 1 and the beam size 4'):
    beam_translator.nbest(sources, 5)
  sampler = Translator(beam_translator.model, beam_translator.params,
                       beam_translator.tokenizer, beam_size=4, temperature=1.0)
  with pytest.raises(ValueError, match='n-best lists come from beam search'):
    sampler.nbest(sources, 2)


def test_a_prefix_starts_the_translation_and_the_model_goes_on(
    translator, beam_translator, data_dir):
  """Greedy from its own first words gives its translation back; a prefix
  it would not choose (another sentence's first word) starts every output
  and n-best hypothesis, whose log_prob counts the prefix's tokens; a text
  without a prefix translates as it does alone."""
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  sources = [test[i][0] for i in range(4)]
  plain = translator(sources)
  own = [' '.join(t.split()[:2]) for t in plain]
  assert translator(sources, own) == plain
  other = [plain[(i + 1) % 4].split()[0] for i in range(4)]
  other[1] = None
  assert other[0] != plain[0].split()[0]
  for t in (translator, beam_translator):
    out = t(sources, other)
    assert out[1] == t([sources[1]])[0]
    for i in (0, 2, 3):
      assert out[i].split()[0] == other[i], (out[i], other[i])
  for i, hyps in enumerate(beam_translator.nbest(sources, 2, other)):
    for h in hyps:
      assert i == 1 or h.text.split()[0] == other[i]
      assert h.log_prob == pytest.approx(
          gnmt_log_prob(beam_translator, sources[i], h.text), abs=1e-4)


def test_bad_prefixes_are_one_clear_error_each(translator, beam_translator):
  limit = translator.model.config.max_len
  for texts, prefixes, match in (
      (['a b'], ['a', 'b'], '1 texts but 2 prefixes'),
      (['a b', ''], [None, 'a'], 'text 1 is empty but has a prefix'),
      (['a b'], [' '.join(['a'] * limit)], f'prefix 0 has .* at most '
       f'{limit - 1}')):
    with pytest.raises(ValueError, match=match):
      translator(texts, prefixes)
  hf = Translator(beam_translator.model, beam_translator.params,
                  beam_translator.tokenizer, beam_size=2, beam_rules='hf')
  with pytest.raises(ValueError, match="not under generate's rules"):
    hf(['a b'], ['a'])
  with pytest.raises(ValueError, match="not under generate's rules"):
    hf.nbest(['a b'], 1, ['a'])


def test_terminology_constraints_appear_and_leave_other_texts_alone(
    beam_translator, data_dir):
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  sources = [test[i][0] for i in range(6)]
  plain = beam_translator(sources)
  # Even texts: a word of another sentence's translation, one or two words
  # long, that theirs lacks; odd ones: none.
  words = sorted({w for t in plain for w in t.split()})
  constraints = []
  for i, out in enumerate(plain):
    absent = [w for w in words if w not in out.split()]
    constraints.append(None if i % 2 else
                       [absent[i]] if i % 4 else [' '.join(absent[:2])])
  out = beam_translator(sources, constraints=constraints)
  for i in range(0, 6, 2):
    assert all(phrase in out[i] for phrase in constraints[i]), (
        constraints[i], out[i])
  assert out[1::2] == plain[1::2]
  hyps = beam_translator.nbest(sources[:1], 2, constraints=constraints[:1])
  assert all(constraints[0][0] in h.text for h in hyps[0])


def test_bad_constraints_are_one_clear_error_each(translator,
                                                  beam_translator):
  for texts, constraints, match in (
      (['a b'], [['x'], None], '1 texts but 2 constraint lists'),
      (['a b', ''], [None, ['x']], 'text 1 is empty but has constraints'),
      (['a b'], [['horitanar', ' ']], 'constraint 1 of sentence 0 is empty'),
      (['a b'], [['日本']], 'vocabulary lacks')):
    with pytest.raises(ValueError, match=match):
      beam_translator(texts, constraints=constraints)
  with pytest.raises(ValueError, match="need GNMT's beam search"):
    translator(['a b'], constraints=[['horitanar']])
  with pytest.raises(ValueError, match='no target prefixes'):
    beam_translator(['a b'], ['yitu'], [['horitanar']])


def test_anti_repetition_settings_reach_the_decoder(translator, data_dir):
  """A translator's no_repeat_ngram_size reaches the jitted loop: its output
  ids hold no token twice; a bad setting is one error."""
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  tok = translator.tokenizer
  rows = [tok.encode(test[i][0]) + [EOS] for i in range(8)]
  inputs = source_batches.pad_rows(rows, max(map(len, rows)), 8)
  t = Translator(translator.model, translator.params, tok, batch_size=8,
                 no_repeat_ngram_size=1)
  for row in t.decode_ids(inputs):
    emitted = [int(x) for x in row if x]
    assert len(emitted) == len(set(emitted)), emitted  # no token twice
  with pytest.raises(ValueError, match='repetition_penalty must be > 0'):
    Translator(translator.model, translator.params, tok,
               repetition_penalty=0)


def test_score_rejects_bad_pairs_with_one_clear_error(translator):
  with pytest.raises(ValueError, match='2 sources but 1 targets'):
    translator.score(['drag', 'vol'], ['x'])
  with pytest.raises(ValueError, match='source 1 is empty'):
    translator.score(['drag', '  '], ['x', 'y'])
  with pytest.raises(ValueError, match=r'target 0 has \d+ tokens, more than'):
    translator.score(['drag'], [' '.join(['drag'] * 400)])


def test_long_input_is_truncated_with_a_warning_or_rejected(workdir, capsys):
  long_line = ' '.join(['drag'] * 400)
  t = Translator.from_workdir(str(workdir), batch_size=2)
  assert isinstance(t([long_line])[0], str)
  assert 'truncated' in capsys.readouterr().err
  strict = Translator.from_workdir(str(workdir), batch_size=2, too_long='error')
  with pytest.raises(ValueError, match='input 0 has'):
    strict([long_line])


def toy_document(sources):
  """Three sentences between paragraph breaks, indents and stray spaces."""
  return f'  {sources[0]}\n\n\n\t{sources[1]}  \r\n\n{sources[2]}\n'


def test_a_document_keeps_its_layout_and_long_sentences_whole(
    translator, data_dir, capsys):
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  sources = [test[i][0] for i in range(3)]
  assert (translator.translate_document(toy_document(sources)) ==
          toy_document(translator(sources)))
  # 200 one-token words: too long for the model (128), cut into the two
  # halves of 100, each translated.
  words = [w for w in 'drag plople wad vol lod peg'.split()
           if len(translator.tokenizer.encode(w)) == 1][:2]
  assert len(words) == 2
  halves = [' '.join([w] * 100) for w in words]
  assert translator.max_input < 200
  capsys.readouterr()
  assert (translator.translate_document(' '.join(halves)) ==
          ' '.join(translator(halves)))
  assert 'truncated' not in capsys.readouterr().err


def run_cli(stdin: bytes, *flags):
  return subprocess.run([sys.executable, '-m', 'experiments.translate', *flags],
                        input=stdin, capture_output=True, cwd=ROOT, timeout=300)


def test_cli_round_trip_with_bad_lines(workdir, translator, data_dir):
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  sources = [test[i][0] for i in range(3)]
  lines = [sources[0], '', sources[1], 'unknown ¿words? 日本', sources[2],
           ' '.join(['drag'] * 400)]
  stdin = ('\n'.join(lines) + '\n').encode() + b'bad \xff\xfe bytes\n'
  result = run_cli(stdin, f'--workdir={workdir}', '--beam_size=1')
  assert result.returncode == 0, result.stderr.decode()
  out = result.stdout.decode().split('\n')
  assert out[-1] == '' and len(out) - 1 == len(lines) + 1
  assert out[1] == ''
  assert out[0] == translator([sources[0]])[0]
  assert b'truncated' in result.stderr
  document = toy_document(sources)
  result = run_cli(document.encode(), f'--workdir={workdir}', '--beam_size=1',
                   '--document', '--language=en')
  assert result.returncode == 0, result.stderr.decode()
  assert result.stdout.decode() == translator.translate_document(document)


def test_cli_nbest_prefix_and_sampling_flags(workdir, data_dir,
                                            beam_translator, tmp_path):
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  sources = [test[0][0], '', test[1][0]]
  stdin = ('\n'.join(sources) + '\n').encode()
  prefixes = tmp_path / 'prefixes.txt'
  prefixes.write_text('\n\n' + beam_translator([sources[0]])[0].split()[0] +
                      '\n')
  beam = run_cli(stdin, f'--workdir={workdir}', '--beam_size=4', '--alpha=0.6',
                 '--nbest=2', f'--prefixes={prefixes}')
  # Tab-separated phrases per line.
  constraints = tmp_path / 'constraints.txt'
  constraints.write_text('ki\tshu\n\nhoritanar\n')
  constrained = run_cli(stdin, f'--workdir={workdir}', '--beam_size=4',
                        f'--constraints={constraints}')
  assert constrained.returncode == 0, constrained.stderr.decode()
  assert constrained.stdout.decode().splitlines() == beam_translator(
      sources, constraints=[['ki', 'shu'], None, ['horitanar']])
  # LOG_PROB ||| TOKEN_LOG_PROBS for given translations.
  targets = tmp_path / 'targets.txt'
  pairs = [test[0], test[1]]
  targets.write_text(''.join(t + '\n' for _, t in pairs))
  scored = run_cli(''.join(s + '\n' for s, _ in pairs).encode(),
                   f'--workdir={workdir}', f'--score={targets}')
  assert scored.returncode == 0, scored.stderr.decode()
  for line, want in zip(scored.stdout.decode().splitlines(),
                        beam_translator.score(*zip(*pairs)), strict=True):
    total, tokens = line.split(' ||| ')
    np.testing.assert_allclose([float(x) for x in tokens.split()], want,
                               atol=1e-5)
    assert float(total) == pytest.approx(float(np.sum(want)), abs=1e-4)
  sampled = run_cli(stdin, f'--workdir={workdir}', '--temperature=0.7',
                    '--top_k=5', '--seed=3', '--alignments',
                    '--alignment_layer=-1')
  for r in (beam, sampled):
    assert r.returncode == 0, r.stderr.decode()
  # TRANSLATION ||| SOURCE-OUTPUT word links
  aligned = [line.split(' ||| ') for line in sampled.stdout.decode().split(
      '\n')[:-1]]
  assert len(aligned) == 3 and aligned[1] == ['', '']
  for (text, links), source in zip(aligned[::2], sources[::2]):
    pairs = [tuple(map(int, link.split('-'))) for link in links.split()]
    assert pairs and all(0 <= s < len(source.split()) and
                         0 <= o < len(text.split()) for s, o in pairs)
  # LINE ||| TRANSLATION ||| SCORE ||| LOG_PROB, two per non-empty line.
  rows = [line.split(' ||| ') for line in beam.stdout.decode().splitlines()]
  want = beam_translator.nbest(sources, 2,
                               prefixes.read_text().split('\n')[:3])
  assert [r[0] for r in rows] == ['0', '0', '2', '2']
  for r, h in zip(rows, want[0] + want[2]):
    assert r[1] == h.text
    assert float(r[2]) == pytest.approx(h.score, abs=1e-5)
    assert float(r[3]) == pytest.approx(h.log_prob, abs=1e-5)


def test_missing_or_damaged_workdir_gives_a_clear_error(tmp_path, workdir):
  missing = tmp_path / 'nope'
  result = run_cli(b'x\n', f'--workdir={missing}')
  assert result.returncode == 2 and str(missing) in result.stderr.decode()
  with pytest.raises(checkpoint.CheckpointError, match='nope'):
    Translator.from_workdir(str(missing))
  # A copy of the workdir whose only checkpoint is garbage.
  import shutil
  broken = tmp_path / 'broken'
  shutil.copytree(workdir, broken)
  for f in (broken / 'checkpoints').rglob('*'):
    if f.is_file():
      f.write_bytes(b'\0garbage')
  with pytest.raises(checkpoint.CheckpointError, match='broken'):
    Translator.from_workdir(str(broken))
