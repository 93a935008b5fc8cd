"""grain pipelines: packing, checkpointable state, sharding, evaluation."""
import json
import logging

import numpy as np
import pytest

from xfmr_jax import data
from xfmr_jax.data import packing
from xfmr_jax.tokenizer import EOS, Tokenizer

L = 64


@pytest.fixture(scope='module')
def toy(data_dir):
  train = data.get_source('toy_translate/small', 'train', str(data_dir))
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  tok = Tokenizer.train((t for i in range(2000) for t in train[i]), None,
                        vocab_size=800)
  return train, test, tok


def _train(src, tok, **kw):
  args = dict(batch_size=8, max_length=L, seed=0, shard_index=0,
              shard_count=1)
  return data.make_train_iterator(src, tok, **{**args, **kw})


def _key(pair):
  return tuple(pair[0].tolist()), tuple(pair[1].tolist())


def test_packed_batch_layout(toy):
  train, _, tok = toy
  batch = next(_train(train, tok))
  assert set(batch) == set(packing.KEYS)
  for value in batch.values():
    assert value.shape == (8, L) and value.dtype == np.int32
  for side in ('inputs', 'targets'):
    seg, pos = batch[f'{side}_segmentation'], batch[f'{side}_position']
    assert np.all((batch[side] == 0) == (seg == 0))  # padding <=> segment 0
    assert np.all(pos[seg == 0] == 0)
    for row in range(8):
      n = seg[row].max()
      for s in range(1, n + 1):
        where = np.flatnonzero(seg[row] == s)
        assert np.all(np.diff(where) == 1)               # contiguous
        assert np.all(pos[row, where] == np.arange(len(where)))
        assert batch[side][row, where[-1]] == EOS
        assert np.sum(batch[side][row, where] == EOS) == 1
  # Source and target of a pair share a segment id; rows hold several pairs.
  assert np.all(batch['inputs_segmentation'].max(1) ==
                batch['targets_segmentation'].max(1))
  assert batch['inputs_segmentation'].max() >= 3


def test_packing_round_trip(toy):
  """Packed batches hold exactly the pairs of the unpacked stream, in bulk."""
  train, _, tok = toy
  packed, unpacked = _train(train, tok), _train(train, tok, pack=False)
  pairs = [p for _ in range(4) for p in data.unpack(next(packed))]
  stream = []
  while len(stream) < len(pairs):
    stream += data.unpack(next(unpacked))
  assert sorted(map(_key, pairs)) == sorted(map(_key, stream[:len(pairs)]))
  # And they are the tokenised source pairs themselves.
  expected = data.tokenize_pairs([train[i] for i in range(len(train))], tok)
  assert set(map(_key, pairs)) <= set(map(_key, expected))


@pytest.mark.parametrize('prefetch', [False, True])
def test_state_restores_the_same_batches(toy, prefetch):
  train, _, tok = toy
  it = _train(train, tok, prefetch=prefetch)
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # JSON-serialisable
  expected = [next(it) for _ in range(4)]
  fresh = _train(train, tok, prefetch=prefetch)
  fresh.set_state(state)
  for want in expected:
    got = next(fresh)
    for k in packing.KEYS:
      np.testing.assert_array_equal(got[k], want[k])
  assert fresh.stats == it.stats
  other_seed = next(_train(train, tok, seed=1))
  assert not np.array_equal(other_seed['inputs'], expected[0]['inputs'])


def test_epochs_and_shards_cover_the_data_once():
  pairs = [(f'a{i} b', f'c {i}') for i in range(50)]
  tok = Tokenizer.train([t for p in pairs for t in p], None, vocab_size=60)
  seen = []
  for shard in (0, 1):
    it = data.make_train_iterator(pairs, tok, batch_size=4, max_length=32,
                                  seed=3, shard_index=shard, shard_count=2,
                                  num_epochs=1)
    mine = [tok.decode(p[0]) for b in it for p in data.unpack(b)]
    assert len(mine) == 25
    seen.append(mine)
  assert not set(seen[0]) & set(seen[1])
  assert sorted(seen[0] + seen[1]) == sorted(p[0] for p in pairs)
  it = data.make_train_iterator(pairs, tok, batch_size=4, max_length=32,
                                seed=3, num_epochs=2)  # jax defaults: 1 process
  assert sum(len(data.unpack(b)) for b in it) == 100


@pytest.mark.parametrize('policy', ['filter', 'truncate'])
def test_length_policy_is_counted(toy, policy, caplog):
  train, _, tok = toy
  with caplog.at_level(logging.WARNING):
    it = _train(train, tok, max_length=12, length_policy=policy)
    pairs = [p for _ in range(5) for p in data.unpack(next(it))]
  counted, other = (('filtered', 'truncated') if policy == 'filter' else
                    ('truncated', 'filtered'))
  assert it.stats[counted] > 0 and it.stats[other] == 0
  assert all(len(a) <= 12 and len(b) <= 12 for a, b in pairs)
  ended = [a[-1] == EOS and b[-1] == EOS for a, b in pairs]
  assert all(ended) if policy == 'filter' else not all(ended)
  assert f'{counted} 1 pairs longer than max_length=12' in caplog.text
  with pytest.raises(ValueError, match='length_policy'):
    _train(train, tok, length_policy='drop')


def test_eval_batches(toy):
  _, test, tok = toy
  batches = data.make_eval_batches(test, tok, batch_size=64, max_length=L,
                                   limit=150)
  assert len(batches) == 3
  assert [b['weights'].sum() for b in batches] == [64, 64, 22]
  last = batches[-1]
  assert last['inputs'].shape == (64, L) and not last['inputs'][22:].any()
  assert last['source_text'][21] == test[149][0] and last['source_text'][22] == ''
  for batch in batches[:1]:
    for row in range(64):
      assert tok.decode(batch['inputs'][row]) == batch['source_text'][row]
      assert tok.decode(batch['targets'][row]) == batch['target_text'][row]
      assert batch['inputs_segmentation'][row].max() == 1


def test_throughput_is_far_above_need(toy):
  """Loose bound (shared CPU); typically ~300k tokens/s on one core."""
  import time
  train, _, tok = toy
  it = _train(train, tok, batch_size=32, max_length=128)
  next(it)
  start, tokens = time.perf_counter(), 0
  for _ in range(20):
    b = next(it)
    tokens += int((b['inputs'] > 0).sum() + (b['targets'] > 0).sum())
  assert tokens / (time.perf_counter() - start) > 20_000


def test_worker_processes_give_the_same_batches_and_resume_exactly(tmp_path):
  lines = [f'quelle {i} {"wort " * (i % 9)}\tziel {i} {"word " * (i % 7)}'
           for i in range(3000)]
  path = tmp_path / 'train.tsv'
  path.write_text('\n'.join(lines) + '\n')
  src = data.TextPairSource(str(path))
  tok = Tokenizer.train([t for p in src.__getitems__(range(3000)) for t in p],
                        vocab_size=200)
  make = lambda: data.make_train_iterator(src, tok, batch_size=8, max_length=32,
                                          seed=3, shard_index=0,
                                          shard_count=1, num_workers=2)
  a, b = make(), make()
  try:
    first = [next(a) for _ in range(4)]
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(first, [
        next(b) for _ in range(4)]) for k in x)
    state = json.loads(json.dumps(a.get_state()))
    expected = [next(a) for _ in range(3)]
  finally:
    a.close()
    b.close()
  c = make()
  try:
    c.set_state(state)
    got = [next(c) for _ in range(3)]
  finally:
    c.close()
  assert all(np.array_equal(x[k], y[k]) for x, y in zip(expected, got)
             for k in x)
