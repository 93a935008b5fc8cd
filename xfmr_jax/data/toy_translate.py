"""`toy_translate`: a TFDS dataset of the synthetic language pair (no download).

Features ``{'source': Text, 'target': Text}``. Splits: ``train`` (``num_train``
pairs, 3-30 words), ``validation`` and ``test`` (2,000 each, 3-30 words) and
``long`` (1,000 pairs of 31-60 words, for length generalisation). Every source
sentence occurs once in the whole dataset, so splits never overlap. The
evaluation splits are drawn first, each from its own seeded stream, so they do
not change when ``num_train`` does.

    builder = build_toy_dataset('/tmp/tfds')            # idempotent
    ds = builder.as_data_source(split='train')          # random access
    ds[0]  # {'source': b'...', 'target': b'...'}

Written as ``array_record`` so that `tfds.data_source` reads it without
TensorFlow; e.g. ``tfds.data_source('toy_translate/small', data_dir=...)``
once this module is imported.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time

import tensorflow_datasets as tfds

from xfmr_jax.data import toy_language

log = logging.getLogger(__name__)

SHORT_LENGTHS = (3, 30)  # words, inclusive
LONG_LENGTHS = (31, 60)


@dataclasses.dataclass(eq=False)
class ToyTranslateConfig(tfds.core.BuilderConfig):
  num_train: int = 150_000
  num_validation: int = 2_000
  num_test: int = 2_000
  num_long: int = 1_000
  seed: int = 0


def generate_splits(config: ToyTranslateConfig) -> dict:
  """Returns {split: [(source, target), ...]}, deterministic given config."""
  language = toy_language.LANGUAGE
  seen = set()
  plan = [('test', config.num_test, SHORT_LENGTHS),
          ('validation', config.num_validation, SHORT_LENGTHS),
          ('long', config.num_long, LONG_LENGTHS),
          ('train', config.num_train, SHORT_LENGTHS)]
  splits = {}
  for split, count, (lo, hi) in plan:
    rng = random.Random(f'toy_translate/{config.seed}/{split}')
    pairs = []
    while len(pairs) < count:
      tree = language.sample(rng, long=split == 'long')
      source, target, _ = language.pair(tree)
      if lo <= source.count(' ') + 1 <= hi and source not in seen:
        seen.add(source)
        pairs.append((source, target))
    splits[split] = pairs
  return splits


class ToyTranslate(tfds.core.GeneratorBasedBuilder):
  """Synthetic translation with reordering and agreement (see toy_language)."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.'}
  BUILDER_CONFIGS = [
      ToyTranslateConfig(name='default', description='150k training pairs'),
      ToyTranslateConfig(name='small', num_train=5_000, num_validation=500,
                         num_test=500, num_long=200,
                         description='smoke tests'),
  ]

  def _info(self):
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({
            'source': tfds.features.Text(),
            'target': tfds.features.Text(),
        }),
        supervised_keys=('source', 'target'),
        disable_shuffling=True,  # readers shuffle, so keep generation order
        homepage='https://arxiv.org/abs/1706.03762',
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    splits = generate_splits(self.builder_config)
    return {name: self._generate_examples(pairs)
            for name, pairs in splits.items()}

  def _generate_examples(self, pairs):
    for i, (source, target) in enumerate(pairs):
      yield i, {'source': source, 'target': target}


def build_toy_dataset(data_dir: str | None = None, *, config: str | None = None,
                      num_train: int | None = None,
                      seed: int = 0) -> ToyTranslate:
  """Prepares `toy_translate` under ``data_dir`` unless already there.

  Args:
    data_dir: TFDS data directory (None: TFDS's default, ~/tensorflow_datasets).
    config: a registered config name ('default', 'small'); exclusive with
      ``num_train``.
    num_train: training pairs for a custom config named
      ``train{num_train}_seed{seed}`` (evaluation splits as in 'default').
    seed: sentence seed of the custom config (the lexicon does not change).

  Returns:
    The prepared builder; ``builder.as_data_source(split=...)`` reads it.
  """
  if config is not None and num_train is not None:
    raise ValueError('give either config or num_train, not both')
  if config is None and (num_train is not None or seed != 0):
    num_train = 150_000 if num_train is None else num_train
    config = ToyTranslateConfig(name=f'train{num_train}_seed{seed}',
                                num_train=num_train, seed=seed)
  builder = ToyTranslate(data_dir=data_dir, config=config or 'default',
                         file_format='array_record')
  if not builder.is_prepared():
    start = time.time()
    builder.download_and_prepare(file_format='array_record')
    log.info('built %s in %.1f s', builder.data_path, time.time() - start)
  return builder
