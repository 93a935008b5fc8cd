"""`get_source`: toy, WMT (mocked TFDS, offline) and the user's own files."""
import logging

import pytest
import tensorflow_datasets as tfds

from xfmr_jax import data
from xfmr_jax.data import DataError, get_source
from xfmr_jax.tokenizer import Tokenizer


# ----------------------------------------------------------------------- WMT
@pytest.mark.parametrize('name', ['wmt14_translate/de-en',
                                  'wmt17_translate/de-en'])
def test_wmt_both_directions_feed_the_pipelines(name, tmp_path):
  with tfds.testing.mock_data(num_examples=12):
    de_en = get_source(name, 'train', str(tmp_path))
    en_de = get_source(name, 'train', str(tmp_path), reverse=True)
    alias = get_source(name.replace('de-en', 'en-de'), 'train', str(tmp_path))
    example = tfds.data_source(name, split='train', data_dir=str(tmp_path),
                               download=False)[0]
    assert len(de_en) == 12
    assert de_en[0] == (example['de'], example['en'])
    assert en_de[0] == (example['en'], example['de']) == alias[0]
    tok = Tokenizer.train([t for i in range(12) for t in de_en[i]], None,
                          vocab_size=40)
    it = data.make_train_iterator(en_de, tok, batch_size=2, max_length=64,
                                  seed=0, shard_index=0, shard_count=1)
    batch = next(it)
    assert batch['inputs'].shape == (2, 64) and batch['inputs'].any()
    evals = data.make_eval_batches(de_en, tok, batch_size=5, max_length=64)
    assert [b['weights'].sum() for b in evals] == [5, 5, 2]
    assert evals[0]['source_text'][0] == example['de']


def test_wmt_not_prepared_says_how_to_build(tmp_path):
  with pytest.raises(DataError, match='not prepared.*wmt14'):
    get_source('wmt14_translate/de-en', 'train', str(tmp_path))


# ----------------------------------------------------------------------- toy
def test_toy_source_and_errors(tmp_path):
  src = get_source('toy_translate/train300', 'test', str(tmp_path))
  rev = get_source('toy_translate/train300', 'test', str(tmp_path),
                   reverse=True)
  assert len(src) == 2000 and src[5] == rev[5][::-1]
  assert isinstance(src[5][0], str)
  assert src.__getitems__([5, 6]) == [src[5], src[6]]
  with pytest.raises(DataError, match="split 'dev' does not exist.*'long'"):
    get_source('toy_translate/train300', 'dev', str(tmp_path))
  with pytest.raises(DataError, match="unknown toy_translate config 'huge'"):
    get_source('toy_translate/huge', 'train', str(tmp_path))


def test_unknown_dataset_lists_valid_ones():
  with pytest.raises(ValueError, match="unknown dataset 'wmt19'.*toy_translate"
                     ".*wmt14_translate/de-en.*tsv:"):
    get_source('wmt19', 'train', None)


# ---------------------------------------------------------------- user files
def _write(path, content: bytes):
  path.write_bytes(content)
  return str(path)


def test_tsv_with_split_placeholder(tmp_path):
  _write(tmp_path / 'train.tsv', 'hallo welt\thello world\r\nja\tyes\n'.encode())
  _write(tmp_path / 'test.tsv', b'nein\tno\n')
  spec = f'tsv:{tmp_path}/{{split}}.tsv'
  train = get_source(spec, 'train', None)
  assert list(train) == [('hallo welt', 'hello world'), ('ja', 'yes')]
  assert get_source(spec, 'test', None, reverse=True)[0] == ('no', 'nein')
  with pytest.raises(DataError, match=r"split 'validation' does not exist.*"
                     r"validation\.tsv"):
    get_source(spec, 'validation', None)


def test_aligned_files(tmp_path):
  s = _write(tmp_path / 'train.de', 'eins\nzwei\n'.encode())
  t = _write(tmp_path / 'train.en', b'one\ntwo\n')
  src = get_source(f'files:{s},{t}', 'train', None)
  assert list(src) == [('eins', 'one'), ('zwei', 'two')]
  with pytest.raises(DataError, match="split 'test' does not exist.*"
                     "placeholder"):
    get_source(f'files:{s},{t}', 'test', None)
  with pytest.raises(DataError, match='bad files: spec'):
    get_source(f'files:{s}', 'train', None)


@pytest.mark.parametrize('content, message', [
    (b'a\tb\nno tab here\n', r'bad\.tsv:2: expected source<TAB>target.*0 tabs'),
    (b'a\tb\nx\ty\tz\n', r'bad\.tsv:2: .*found 2 tabs'),
    (b'a\tb\nc\td\n\xff\xfe\tx\n', r'bad\.tsv:3: invalid UTF-8'),
])
def test_bad_tsv_names_file_and_line(tmp_path, content, message):
  path = _write(tmp_path / 'bad.tsv', content)
  with pytest.raises(DataError, match=message):
    get_source(f'tsv:{path}', 'train', None)


def test_missing_and_misaligned_files(tmp_path):
  with pytest.raises(DataError, match=r'nope\.tsv: file not found'):
    get_source(f'tsv:{tmp_path}/nope.tsv', 'train', None)
  s = _write(tmp_path / 'a.src', b'1\n2\n3\n')
  t = _write(tmp_path / 'a.tgt', b'1\n2\n')
  with pytest.raises(DataError, match=r'a\.src has 3 lines but .*a\.tgt has 2'
                     r'; line-aligned files need the same number of lines$'):
    get_source(f'files:{s},{t}', 'train', None)
  (tmp_path / 'train.tsv').mkdir()
  with pytest.raises(DataError, match=r'train\.tsv: a directory, not a text '
                     'file'):
    get_source(f'tsv:{tmp_path}/{{split}}.tsv', 'train', None)
  bad = _write(tmp_path / 'b.tgt', b'1\n\x80\n3\n')
  with pytest.raises(DataError, match=r'b\.tgt:2: invalid UTF-8'):
    get_source(f'files:{s},{bad}', 'train', None)


def test_empty_lines_are_skipped_and_counted(tmp_path, caplog):
  path = _write(tmp_path / 'e.tsv', b'a\tb\n\n  \t \nc\t\n\td\ne\tf\n')
  with caplog.at_level(logging.WARNING):
    src = get_source(f'tsv:{path}', 'train', None)
  assert list(src) == [('a', 'b'), ('e', 'f')]
  assert src.num_skipped == 4
  assert [(n, r) for _, n, r in src.skipped] == [
      (2, 'empty line'), (3, 'empty line'), (4, 'empty target'),
      (5, 'empty source')]
  assert 'skipped 4 of 6 lines' in caplog.text and 'e.tsv:4' in caplog.text


def test_a_tsv_source_holds_offsets_not_text(tmp_path):
  # Each pair costs its 8-byte offset, whatever its length: a corpus of
  # millions of pairs fits in tens of MB, and a worker process gets a copy of
  # the source (pickled) that reads the same pairs.
  import pickle
  lines = [f'{"quelle " * (i % 40 + 1)}{i}\t{"target " * (i % 30 + 1)}{i}'
           for i in range(5000)]
  path = tmp_path / 'big.tsv'
  _write(path, ('\n'.join(lines) + '\n').encode())
  src = get_source(f'tsv:{path}', 'train', None)
  blob = pickle.dumps(src)
  assert len(blob) < 8 * len(src) + 4096 < path.stat().st_size // 10
  copy = pickle.loads(blob)
  for i in (0, 1234, 4999):
    s, t = lines[i].split('\t')
    assert copy[i] == src[i] == (s.strip(), t.strip())
  assert copy.__getitems__([3, 1]) == [src[3], src[1]]
