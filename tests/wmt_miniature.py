"""A miniature of the WMT14 German-English downloads, for offline tests.

The archives have the names, member paths and formats that TFDS's WMT
builder reads for ``wmt14_translate/de-en``: plain parallel text in three
training .tgz files, and ``dev.tgz`` with newstest2013 as plain text and
newstest2014 as SGM. Sentences are made from a small bilingual lexicon (with
umlauts, so the UTF-8 path is exercised) and every pair is distinct.
"""
from __future__ import annotations

import hashlib
import io
import itertools
import os
import random
import tarfile

_DE = dict(the='der', a='ein', red='rote', small='kleine', old='alte',
           green='grüne', dog='Hund', cat='Kater', man='Mann', bird='Vogel',
           runs='läuft', sleeps='schläft', sings='singt', eats='isst',
           today='heute', here='hier', again='wieder', slowly='langsam')
_DETS, _ADJS = ('the', 'a'), ('red', 'small', 'old', 'green')
_NOUNS, _VERBS = ('dog', 'cat', 'man', 'bird'), ('runs', 'sleeps', 'sings',
                                                 'eats')
_ADVS = ('today', 'here', 'again', 'slowly')

# url -> (archive file name, {member path: (language, subset)})
ARCHIVES = {
    'http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz': (
        'training-parallel-europarl-v7.tgz',
        {'training/europarl-v7.de-en.%s': 'europarl'}),
    'http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz': (
        'training-parallel-commoncrawl.tgz',
        {'commoncrawl.de-en.%s': 'commoncrawl'}),
    'http://www.statmt.org/wmt14/training-parallel-nc-v9.tgz': (
        'training-parallel-nc-v9.tgz',
        {'training/news-commentary-v9.de-en.%s': 'newscommentary'}),
    'http://data.statmt.org/wmt19/translation-task/dev.tgz': (
        'dev.tgz',
        {'dev/newstest2013.%s': 'newstest2013',
         'dev/newstest2014-deen-%s.sgm': 'newstest2014'}),
}
SIZES = dict(europarl=120, commoncrawl=100, newscommentary=80,
             newstest2013=24, newstest2014=30)
SPLITS = dict(train=('europarl', 'commoncrawl', 'newscommentary'),
              validation=('newstest2013',), test=('newstest2014',))


def all_pairs(seed: int = 0) -> list[tuple[str, str]]:
  """Every distinct (German, English) sentence of the lexicon, shuffled."""
  pairs = []
  for det, adj, noun, verb, adv in itertools.product(_DETS, _ADJS, _NOUNS,
                                                     _VERBS, _ADVS):
    en = [det, adj, noun, verb, adv]
    de = [_DE[w] for w in (det, adj, noun, verb, adv)]
    pairs.append((' '.join(de).capitalize() + '.',
                  ' '.join(en).capitalize() + '.'))
  random.Random(seed).shuffle(pairs)
  return pairs


def subset_pairs() -> dict[str, list[tuple[str, str]]]:
  """The (German, English) pairs of each subset; no pair is in two."""
  pool, out, start = all_pairs(), {}, 0
  for name, n in SIZES.items():
    out[name] = pool[start:start + n]
    start += n
  return out


def _sgm(setid: str, kind: str, lang: str, sentences) -> str:
  segs = '\n'.join(f'<seg id="{i}">{s}</seg>'
                   for i, s in enumerate(sentences, 1))
  return (f'<{kind}set setid="{setid}" srclang="any" trglang="any">\n'
          f'<doc sysid="{kind}" docid="1" genre="news" origlang="de">\n'
          f'<p>\n{segs}\n</p>\n</doc>\n</{kind}set>\n')


def _members(pattern: str, subset: str, pairs) -> dict[str, bytes]:
  de = [p[0] for p in pairs]
  en = [p[1] for p in pairs]
  if pattern.endswith('.sgm'):
    return {pattern % 'src.de': _sgm(subset, 'src', 'de', de).encode(),
            pattern % 'ref.en': _sgm(subset, 'ref', 'en', en).encode()}
  return {pattern % 'de': ('\n'.join(de) + '\n').encode(),
          pattern % 'en': ('\n'.join(en) + '\n').encode()}


def _tgz(path: str, members: dict[str, bytes]) -> None:
  with tarfile.open(path, 'w:gz') as tar:
    for name, blob in sorted(members.items()):
      info = tarfile.TarInfo(name)
      info.size = len(blob)
      tar.addfile(info, io.BytesIO(blob))


def url_info(path):
  """The TFDS UrlInfo (size, SHA-256, file name) of the file at ``path``."""
  from tensorflow_datasets.core.download import checksums
  with open(path, 'rb') as f:
    blob = f.read()
  return checksums.UrlInfo(size=len(blob), filename=os.path.basename(path),
                           checksum=hashlib.sha256(blob).hexdigest())


def write_archives(folder) -> dict:
  """Writes the four archives into ``folder``; returns the TFDS url infos
  (url -> UrlInfo with their sizes and SHA-256) that validate them."""
  os.makedirs(folder, exist_ok=True)
  pairs = subset_pairs()
  for filename, layout in ARCHIVES.values():
    members = {}
    for pattern, subset in layout.items():
      members.update(_members(pattern, subset, pairs[subset]))
    _tgz(os.path.join(folder, filename), members)
  return url_infos(folder)


def url_infos(folder) -> dict:
  """url -> UrlInfo of the archives in ``folder``."""
  return {url: url_info(os.path.join(folder, filename))
          for url, (filename, _) in ARCHIVES.items()}


def split_pairs() -> dict[str, set[tuple[str, str]]]:
  """The (German, English) pairs each split of the built dataset must hold."""
  pairs = subset_pairs()
  return {split: {p for s in subsets for p in pairs[s]}
          for split, subsets in SPLITS.items()}


def register(url_infos: dict) -> None:
  """Makes TFDS expect the miniature archives' checksums for wmt14 de-en."""
  from tensorflow_datasets.translate import wmt14
  wmt14.Wmt14Translate.url_infos = url_infos


if __name__ == '__main__':
  # python -m tests.wmt_miniature ARCHIVE_DIR <prepare_data flags>: writes the
  # archives, then runs the prepare_data command line exactly as a user does,
  # with TFDS told the archives' checksums; finally says whether TensorFlow
  # was imported on the way.
  import runpy
  import sys
  folder = sys.argv.pop(1)
  register(write_archives(folder))
  try:
    runpy.run_module('experiments.prepare_data', run_name='__main__')
  finally:
    print(f"tensorflow imported: {'tensorflow' in sys.modules}",
          file=sys.stderr)
