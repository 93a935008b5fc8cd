"""The service served from a workdir: every decoding option per request, each
answer equal to what :class:`Translator` gives for the same texts and settings.

Run in process (Starlette's test client around the app), so the expected
translations and the service share compiled programs.
"""
import json

import pytest

pytest.importorskip('httpx')  # Starlette's test client

from starlette.testclient import TestClient  # noqa: E402

from xfmr_jax import data, service  # noqa: E402
from xfmr_jax.translate import Translator  # noqa: E402
from xfmr_jax.workdir_translator import WorkdirTranslator  # noqa: E402


@pytest.fixture(scope='module')
def client(trained_workdir):
  app = service.make_app(WorkdirTranslator(str(trained_workdir), batch_size=8,
                                           max_settings=2), max_texts=8)
  with TestClient(app) as c:
    yield c


@pytest.fixture(scope='module')
def sources(data_dir):
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  return [test[i][0] for i in range(6)]


@pytest.fixture(scope='module')
def translators(trained_workdir):
  made = {}

  def make(**settings):
    key = tuple(sorted(settings.items()))
    if key not in made:
      made[key] = Translator.from_workdir(str(trained_workdir), batch_size=8,
                                          **settings)
    return made[key]
  return make


def _post(client, **body):
  r = client.post('/translate', json=body)
  assert r.status_code == 200, r.text
  return r.json()


def test_plain_and_documents_equal_the_translator(client, sources,
                                                  translators):
  from tests.test_translate import toy_document
  beam, greedy = translators(beam_size=4), translators(beam_size=1)
  assert _post(client, texts=sources + [''])['translations'] == beam(
      sources) + ['']
  assert _post(client, texts=sources[:2], beam_size=1)['translations'] == (
      greedy(sources[:2]))
  assert _post(client, texts=[toy_document(sources[:3])], document=True,
               no_repeat_ngram_size=2)['translations'] == [
                   translators(beam_size=4, no_repeat_ngram_size=2)
                   .translate_document(toy_document(sources[:3]))]
  health = client.get('/health').json()
  assert 'num_hypotheses' in health['options'] and health['beam_sizes'] == [
      4, 1]


def test_nbest_lists_with_scores_equal_the_translators(client, sources,
                                                      translators):
  body = _post(client, texts=sources[:3] + [''], num_hypotheses=3)
  nbest = translators(beam_size=4).nbest(sources[:3] + [''], 3)
  # Equal texts; equal scores but for float rounding (a sentence's batch
  # mates and row differ between the service's batches and the call's).
  for got, hyps in zip(body['hypotheses'], nbest):
    assert [g['text'] for g in got] == [h.text for h in hyps]
    for g, h in zip(got, hyps):
      assert g['score'] == pytest.approx(h.score, abs=1e-5)
      assert g['log_prob'] == pytest.approx(h.log_prob, abs=1e-5)
  assert body['translations'] == [hyps[0].text for hyps in nbest[:3]] + ['']
  assert all(len(hyps) == 3 for hyps in body['hypotheses'][:3])
  assert body['hypotheses'][3] == []


def test_prefixes_constraints_and_anti_repetition_equal_the_translators(
    client, sources, translators):
  beam = translators(beam_size=4)
  plain = beam(sources)
  prefixes = [plain[0].split()[0], None, ' '.join(plain[2].split()[:2])]
  got = _post(client, texts=sources[:3], prefixes=prefixes)['translations']
  assert got == beam(sources[:3], prefixes)
  assert got[0].startswith(prefixes[0]) and got[2].startswith(prefixes[2])
  # A word of another sentence's translation that this one lacks.
  absent = next(w for w in plain[1].split() if w not in plain[0].split())
  constraints = [[absent], None]
  got = _post(client, texts=sources[:2], constraints=constraints)
  assert got['translations'] == beam(sources[:2], constraints=constraints)
  assert absent in got['translations'][0].split()
  assert got['translations'][1] == plain[1]
  for settings in (dict(no_repeat_ngram_size=2),
                   dict(repetition_penalty=1.5)):
    assert _post(client, texts=sources, **settings)['translations'] == (
        translators(beam_size=4, **settings)(sources))


def test_anti_repetition_settings_are_bounded(client, sources):
  # The two settings the fixture allows, then a third: each would compile a
  # search of its own.
  for settings in (dict(no_repeat_ngram_size=2), dict(repetition_penalty=1.5),
                   dict(no_repeat_ngram_size=2, beam_size=1)):
    _post(client, texts=sources[:1], **settings)
  r = client.post('/translate', json={'texts': sources[:1],
                                      'repetition_penalty': 1.7})
  assert r.status_code == 422 and 'at most 2 distinct' in r.json()['error']
  assert '(2, 1.0)' in r.json()['error']


def test_alignments_equal_the_translators(client, sources, translators):
  body = _post(client, texts=sources[:3] + [''], beam_size=1, alignments=True,
               alignment_layer=0)
  aligned = translators(beam_size=1).align(sources[:3] + [''], layer=0)
  assert body['translations'] == [a.text for a in aligned]
  assert body['alignments'] == [[list(p) for p in a.links] for a in aligned]
  assert body['alignments'][3] == [] and all(body['alignments'][:3])
  # With constraints, at beam 4.
  constraints = [['ki'], None]
  body = _post(client, texts=sources[:2], alignments=True,
               constraints=constraints)
  aligned = translators(beam_size=4).align(sources[:2],
                                           constraints=constraints)
  assert body['translations'] == [a.text for a in aligned]
  assert 'ki' in body['translations'][0].split()
  assert body['alignments'] == [[list(p) for p in a.links] for a in aligned]


def test_scores_equal_the_translators(client, data_dir, translators):
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  pairs = [test[i] for i in range(3)] + [(test[3][0], '')]
  r = client.post('/score', json={'sources': [s for s, _ in pairs],
                                  'targets': [t for _, t in pairs]})
  assert r.status_code == 200, r.text
  want = translators(beam_size=4).score(*zip(*pairs))
  for got, w in zip(r.json()['scores'], want, strict=True):
    assert got['token_log_probs'] == pytest.approx(w.tolist(), abs=1e-5)
    assert got['log_prob'] == pytest.approx(float(w.sum()), abs=1e-4)
  for body, status, message in (
      ({'sources': ['a'], 'targets': []}, 422, '1 sources but 0 targets'),
      ({'sources': ['a', ' '], 'targets': ['b', 'c']}, 422,
       'source 1 is empty'),
      ({'sources': ['a'], 'targets': ['b ' * 300]}, 422,
       'more than the model maximum'),
      ({'sources': ['a'], 'texts': ['b']}, 422, "unknown field 'texts'"),
      ({'sources': ['a'] * 9, 'targets': ['b'] * 9}, 413, 'at most 8')):
    r = client.post('/score', json=body)
    assert r.status_code == status and message in r.json()['error'], r.text


@pytest.mark.parametrize('body, message', [
    (dict(num_hypotheses=5), 'num_hypotheses must be an int from 0'),
    (dict(num_hypotheses=2, beam_size=1), 'to the beam size 1'),
    (dict(num_hypotheses=2, alignments=True), 'not with num_hypotheses'),
    (dict(prefixes=['a']), 'one entry per text (2)'),
    (dict(prefixes=[None, 'x']), 'text 1 is empty but has a prefix'),
    (dict(prefixes=['日本', None]), 'prefix 0 has a token the vocabulary'),
    (dict(constraints=[['日本'], None]), 'vocabulary lacks'),
    (dict(constraints=[[3], None]), 'constraints[0][0] is int'),
    (dict(constraints=[['horitanar'], None], beam_size=1),
     "need GNMT's beam search"),
    (dict(no_repeat_ngram_size=-1), 'no_repeat_ngram_size must be'),
    (dict(repetition_penalty=0), 'repetition_penalty must be'),
    (dict(alignments='yes'), 'alignments must be true or false'),
    (dict(alignments=True, alignment_layer=5), 'layer 5 is not one of the 2'),
    (dict(document=True, num_hypotheses=2), 'a document request takes'),
])
def test_bad_options_get_422_and_the_service_keeps_serving(
    client, sources, translators, body, message):
  r = client.post('/translate', content=json.dumps(
      {'texts': [sources[0], ''], **body}))
  assert r.status_code == 422, r.text
  assert message in r.json()['error']
  assert _post(client, texts=sources[:1])['translations'] == translators(
      beam_size=4)(sources[:1])
