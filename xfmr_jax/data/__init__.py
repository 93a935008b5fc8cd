"""Data: corpora (`sources`), the toy task, and grain input pipelines.

    from xfmr_jax import data
    src = data.get_source('toy_translate', 'train', data_dir)
    it = data.make_train_iterator(src, tokenizer, batch_size=64, max_length=128,
                                  seed=0)
"""
from xfmr_jax.data.pipeline import (make_eval_batches, make_train_iterator,
                                    tokenize_pairs, unpack)
from xfmr_jax.data.sources import get_source
from xfmr_jax.data.text_files import DataError, TextPairSource


def build_toy_dataset(data_dir=None, **kwargs):
  """See `xfmr_jax.data.toy_translate.build_toy_dataset` (imports TFDS)."""
  from xfmr_jax.data import toy_translate
  return toy_translate.build_toy_dataset(data_dir, **kwargs)


__all__ = ['DataError', 'TextPairSource', 'build_toy_dataset', 'get_source',
           'make_eval_batches', 'make_train_iterator', 'tokenize_pairs',
           'unpack']
