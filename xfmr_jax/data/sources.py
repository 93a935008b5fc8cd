"""`get_source`: one entry point for every parallel corpus.

A source is a random-access sequence of ``(source_text, target_text)`` string
pairs (``len(src)``, ``src[i]``, and ``src.__getitems__(indices)`` for fast
batched reads). ``dataset`` names it:

  'toy_translate'                 the synthetic task, built on first use in
  'toy_translate/<config>'        ``data_dir``; config 'default' (150k train
                                  pairs), 'small' (5k), or 'train<N>[_seed<S>]'
                                  for N training pairs from seed S.
  'wmt14_translate/de-en'         TFDS WMT, German->English; ``reverse=True``
  'wmt17_translate/de-en'         (or the name '.../en-de') gives English to
  'wmt_t2t_translate/de-en'       German.
  'tsv:/path/{split}.tsv'         ``source<TAB>target`` lines.
  'files:/path/{split}.src,/path/{split}.tgt'   two line-aligned files.

For user files, ``{split}`` in a path is replaced by the split name; a path
without it is the 'train' split only.

Preparing WMT (needs internet once, then copy ``DATA_DIR`` anywhere)::

    python -m experiments.prepare_data --dataset=wmt14_translate/de-en \\
        --data_dir=DATA_DIR

(`xfmr_jax.data.wmt_prepare`; no TensorFlow needed). Reading needs neither
TensorFlow nor internet: ``tfds.data_source`` reads array_record files.
"""
from __future__ import annotations

import re
from typing import Sequence

from xfmr_jax.data.text_files import DataError, TextPairSource

WMT = ('wmt14_translate/de-en', 'wmt17_translate/de-en',
       'wmt_t2t_translate/de-en')
VALID = ("'toy_translate', 'toy_translate/<config>', "
         + ', '.join(repr(w) for w in WMT)
         + ", 'tsv:/path/{split}.tsv', "
         + "'files:/path/{split}.src,/path/{split}.tgt'")
_SPLIT_NAME = re.compile(r'^(\w+)')  # 'train[:10%]' -> 'train'


class TfdsPairSource:
  """Text pairs from a TFDS data source whose features are strings."""

  def __init__(self, data_source, source_key: str, target_key: str):
    self.data_source = data_source
    self.keys = (source_key, target_key)

  def _pair(self, example) -> tuple[str, str]:
    return tuple(v.decode('utf-8') if isinstance(v, bytes) else str(v)
                 for v in (example[self.keys[0]], example[self.keys[1]]))

  def __len__(self) -> int:
    return len(self.data_source)

  def __getitem__(self, index: int) -> tuple[str, str]:
    return self._pair(self.data_source[index])

  def __getitems__(self, indices: Sequence[int]) -> list[tuple[str, str]]:
    # One batched array_record read costs far less than one read per record.
    try:
      examples = self.data_source.__getitems__(list(indices))
    except TypeError:  # tfds.testing.mock_data (4.9.10) breaks __getitems__
      examples = [self.data_source[i] for i in indices]
    return [self._pair(e) for e in examples]


def _tfds_split(builder, name: str, split: str):
  """``builder.as_data_source(split)`` with errors that say what to do."""
  known = list(builder.info.splits.keys())
  base = _SPLIT_NAME.match(split)
  if known and (base is None or base.group(1) not in known):
    raise DataError(f'split {split!r} does not exist in {name}; '
                    f'available: {known}')
  try:
    return builder.as_data_source(split=split)
  except (NotImplementedError, AssertionError, FileNotFoundError) as e:
    raise DataError(
        f'{name} is not prepared as array_record in data_dir '
        f'{builder.data_dir!r}; build it with python -m '
        f'experiments.prepare_data --dataset={name} --data_dir=DATA_DIR '
        f'({type(e).__name__}: {str(e)[:200]})') from None


def _toy(name: str, split: str, data_dir, reverse: bool):
  from xfmr_jax.data import toy_translate  # imports TFDS only when needed
  config = name.partition('/')[2] or 'default'
  registered = [c.name for c in toy_translate.ToyTranslate.BUILDER_CONFIGS]
  custom = re.fullmatch(r'train(\d+)(?:_seed(\d+))?', config)
  if config in registered:
    builder = toy_translate.build_toy_dataset(data_dir, config=config)
  elif custom:
    builder = toy_translate.build_toy_dataset(
        data_dir, num_train=int(custom.group(1)),
        seed=int(custom.group(2) or 0))
  else:
    raise DataError(f'unknown toy_translate config {config!r}; use one of '
                    f'{registered} or train<N>[_seed<S>]')
  keys = ('target', 'source') if reverse else ('source', 'target')
  return TfdsPairSource(_tfds_split(builder, name, split), *keys)


def _wmt(name: str, split: str, data_dir, reverse: bool):
  import tensorflow_datasets as tfds
  if name.endswith('/en-de'):  # the same data, read the other way round
    name, reverse = name[:-len('en-de')] + 'de-en', not reverse
  builder = tfds.builder(name, data_dir=data_dir)
  keys = ('en', 'de') if reverse else ('de', 'en')
  return TfdsPairSource(_tfds_split(builder, name, split), *keys)


def _user_files(kind: str, spec: str, split: str, reverse: bool):
  paths = spec.split(',') if kind == 'files' else [spec]
  if len(paths) != (2 if kind == 'files' else 1) or not all(paths):
    raise DataError(f"bad {kind}: spec {spec!r}; expected "
                    + ("'files:SRC_PATH,TGT_PATH'" if kind == 'files'
                       else "'tsv:PATH'"))
  if not any('{split}' in p for p in paths) and split != 'train':
    raise DataError(f"split {split!r} does not exist for {kind}:{spec}: "
                    "without a {split} placeholder the file is the 'train' "
                    "split only")
  paths = [p.replace('{split}', split) for p in paths]
  try:
    if kind == 'tsv':
      return TextPairSource(paths[0], reverse=reverse)
    return TextPairSource(source_path=paths[0], target_path=paths[1],
                          reverse=reverse)
  except DataError as e:
    if 'file not found' in str(e):
      raise DataError(f'split {split!r} does not exist: {e}') from None
    raise


def get_source(dataset: str, split: str, data_dir: str | None = None,
               reverse: bool = False):
  """Returns the random-access ``(source, target)`` pairs of one split.

  Args:
    dataset: see the module docstring for the accepted names.
    split: 'train', 'validation', 'test' (toy also 'long'); TFDS slicing such
      as 'train[:1000]' works for TFDS datasets.
    data_dir: TFDS data directory (None: TFDS's default). Unused for files.
    reverse: translate in the other direction (swap source and target).
  """
  kind, colon, spec = dataset.partition(':')
  if colon and kind in ('tsv', 'files'):
    return _user_files(kind, spec, split, reverse)
  if dataset == 'toy_translate' or dataset.startswith('toy_translate/'):
    return _toy(dataset, split, data_dir, reverse)
  if dataset in WMT or dataset.replace('/en-de', '/de-en') in WMT:
    return _wmt(dataset, split, data_dir, reverse)
  raise DataError(f'unknown dataset {dataset!r}; valid: {VALID}')
