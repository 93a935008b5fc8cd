"""Preparing WMT as array_record with TFDS's own builders, without TensorFlow.

    from xfmr_jax.data import wmt_prepare
    counts = wmt_prepare.prepare('wmt14_translate/de-en', '/data/tfds')

TFDS's WMT builders download with ``requests`` and parse SGM, TSV and plain
parallel text through ``etils.epath``, none of which needs TensorFlow; only
TFDS's archive extractor reads and writes through ``tf.io.gfile``.
:func:`python_extraction` swaps in an extractor that does the same work with
Python's tarfile/gzip/bz2/zipfile and ``etils.epath``, for as long as the
``with`` block lasts, so nothing else in TFDS changes.

Everything is resumable the way TFDS lays it out under ``data_dir``: a
finished download stays in ``downloads/`` (an interrupted one is redone), a
finished extraction in ``downloads/extracted/`` (each one is written to a
temporary name and renamed when complete), and a finished dataset in
``<name>/<config>/<version>/``. Running again skips what is finished.

Archives already downloaded by hand (the file names TFDS registers, e.g.
``training-parallel-europarl-v7.tgz``, ``dev.tgz``) are taken from
``manual_dir`` (default ``data_dir/downloads/manual``) instead of the
network; downloads and manual files alike are checked against TFDS's
registered sizes and SHA-256 checksums.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid

from etils import epath

from xfmr_jax.data.sources import WMT as DATASETS
from xfmr_jax.data.text_files import DataError

log = logging.getLogger(__name__)

class DownloadFailed(OSError):
  """A download could not be completed; the message names the URL."""


def canonical_name(dataset: str) -> str:
  """``dataset`` as TFDS names it ('.../en-de' is the same data as de-en)."""
  name = dataset.strip()
  if name.endswith('/en-de'):
    name = name[:-len('en-de')] + 'de-en'
  if name not in DATASETS:
    raise DataError(f'unknown dataset {dataset!r}; prepare_data builds '
                    + ', '.join(DATASETS)
                    + " (toy_translate is built on first use)")
  return name


def _extractor_class():
  """TFDS's extractor with its TensorFlow file calls replaced.

  Defined on first use so that importing this module stays cheap.
  """
  from tensorflow_datasets.core import constants
  from tensorflow_datasets.core.download import extractor

  class PythonExtractor(extractor._Extractor):  # pylint: disable=protected-access
    """Reads the archive and writes its members with Python and epath."""

    def _extract(self, from_path, method, to_path):
      from_path, to_path = epath.Path(from_path), epath.Path(to_path)
      # A half-written extraction keeps a temporary name and is never reused.
      tmp = to_path.parent / (f'{constants.INCOMPLETE_PREFIX}'
                              f'{uuid.uuid4().hex}_{to_path.name}')
      try:
        with from_path.open('rb') as archive:
          # TFDS's member iterators take an open file as they take a path.
          for name, member in extractor.iter_archive(archive, method):
            dst = tmp / name if name else tmp
            dst.parent.mkdir(parents=True, exist_ok=True)
            with dst.open('wb') as out:
              shutil.copyfileobj(member, out, 1 << 20)  # streamed, not in RAM
            if self._pbar_path is not None:
              self._pbar_path.update_total(1)
              self._pbar_path.update(1)
      except Exception as e:  # pylint: disable=broad-except
        _remove(tmp)
        raise extractor.ExtractError(
            f'damaged archive {os.fspath(from_path)}: cannot extract it '
            f'({type(e).__name__}: {e}); delete it and run again') from e
      if to_path.exists():  # e.g. a forced re-extraction
        _remove(to_path)
      tmp.rename(to_path)
      return to_path

  return PythonExtractor


def _remove(path: epath.Path) -> None:
  if path.is_dir():
    path.rmtree()
  elif path.exists():
    path.unlink()


@contextlib.contextmanager
def python_extraction():
  """Within the block, TFDS download managers extract without TensorFlow."""
  from tensorflow_datasets.core.download import extractor
  original = extractor.get_extractor
  extractor.get_extractor = _extractor_class()  # one per download manager
  try:
    yield
  finally:
    extractor.get_extractor = original


def _check_writable(data_dir: str) -> None:
  try:
    os.makedirs(data_dir, exist_ok=True)
    probe = os.path.join(data_dir, f'.write_test_{uuid.uuid4().hex}')
    with open(probe, 'w'):
      pass
    os.remove(probe)
  except OSError as e:
    raise DataError(f'data_dir {data_dir!r} is not writable: '
                    f'{e.strerror or e}') from None


def _failure(e: BaseException) -> Exception | None:
  """The one-line error for a failed preparation, None if it is a bug."""
  from tensorflow_datasets.core.download import download_manager, extractor
  from tensorflow_datasets.core.download import util as download_util
  import requests
  if isinstance(e, extractor.ExtractError):
    return DataError(str(e).split('\n')[0])
  if isinstance(e, download_manager.NonMatchingChecksumError):
    # "Artifact URL, downloaded to PATH, has wrong checksum: ..."
    first = str(e).split('\n')[0].rstrip(':')
    return DataError(f'{first}; the file is damaged or changed upstream: '
                     'delete it and run again')
  if isinstance(e, requests.RequestException):
    url = getattr(e.request, 'url', None) or '(unknown URL)'
    return DownloadFailed(f'cannot download {url}: {type(e).__name__}: '
                          f'{str(e)[:300]}')
  if isinstance(e, download_util.DownloadError):
    return DownloadFailed(str(e))
  return None


def prepare(dataset: str, data_dir: str, *, manual_dir: str | None = None,
            download_dir: str | None = None) -> dict[str, int]:
  """Downloads, extracts and builds ``dataset`` as array_record in
  ``data_dir``; returns the number of pairs per split.

  Args:
    dataset: one of :data:`DATASETS` (or its '/en-de' spelling).
    data_dir: the TFDS data_dir that training reads (``config.data_dir``).
    manual_dir: archives downloaded by hand; default
      ``<download_dir>/manual``.
    download_dir: where archives go; default ``<data_dir>/downloads``.

  Raises DataError (unknown dataset, unwritable data_dir, damaged archive)
  or DownloadFailed (a URL that cannot be fetched), each naming the cause.
  """
  name = canonical_name(dataset)
  data_dir = os.path.abspath(os.path.expanduser(data_dir))
  _check_writable(data_dir)
  import tensorflow_datasets as tfds  # slow import: after the cheap checks
  builder = tfds.builder(name, data_dir=data_dir, file_format='array_record')
  download_dir = download_dir or os.path.join(data_dir, 'downloads')
  config = tfds.download.DownloadConfig(manual_dir=manual_dir)
  if builder.is_prepared():
    log.info('%s is already prepared in %s', name, builder.data_dir)
  else:
    log.info('preparing %s in %s (archives in %s; finished steps are '
             'reused if this is interrupted and run again)', name,
             builder.data_dir, download_dir)
    with python_extraction():
      try:
        builder.download_and_prepare(download_dir=download_dir,
                                     download_config=config)
      except Exception as e:  # pylint: disable=broad-except
        error = _failure(e)
        if error is None:
          raise
        raise error from e
  counts = {split: info.num_examples
            for split, info in builder.info.splits.items()}
  log.info('%s: %s pairs in %s', name,
           ', '.join(f'{s} {n}' for s, n in counts.items()), builder.data_dir)
  return counts
