"""Run an exported translator (see :mod:`xfmr_jax.export`) without model code.

    translate = xfmr_jax.serving.load('artifact')
    translate(['a source sentence', ''])            # -> list of str
    translate(texts, beam_size=1)                    # any exported beam size

Needs only jax, numpy and sentencepiece: importing this module loads neither
flax nor the model modules. Outputs equal :class:`xfmr_jax.translate.
Translator`'s for the same checkpoint and decode settings, token for token:
both batch with :mod:`xfmr_jax.source_batches`.

Rows are padded up to a power of two (at most the artifact's batch size), so a
stream of requests compiles each module for a handful of batch sizes only.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from typing import Sequence

import jax
import numpy as np
from jax import export as jax_export

from xfmr_jax import marian_tokenizer, source_batches
from xfmr_jax.source_batches import InputTooLong
from xfmr_jax.tokenizer import MODEL_FILENAME, Tokenizer, TokenizerError

FORMAT = 1  # the artifact layout (written by xfmr_jax.export)
MANIFEST = 'manifest.json'
PARAMS = 'params.npz'

__all__ = ['ArtifactError', 'ExportedTranslator', 'InputTooLong', 'load']


class ArtifactError(ValueError):
  """A missing, damaged or incompatible exported translator."""


def sha256(path: str) -> str:
  """Hex SHA-256 of a file (the manifest's checksums)."""
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def _read_manifest(path: str) -> dict:
  manifest_path = os.path.join(path, MANIFEST)
  if not os.path.isfile(manifest_path):
    raise ArtifactError(f'{path} is not an exported translator: '
                        f'{MANIFEST} is missing')
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
    if manifest.get('format') != FORMAT:
      raise ArtifactError(f'{manifest_path}: artifact format '
                          f'{manifest.get("format")!r}; this version reads '
                          f'{FORMAT}')
    for name, digest in manifest['sha256'].items():
      file = os.path.join(path, name)
      if not os.path.isfile(file):
        raise ArtifactError(f'{path}: {name} is missing')
      if sha256(file) != digest:
        raise ArtifactError(f'{path}: {name} is damaged (its SHA-256 differs '
                            'from the manifest); export it again')
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    if isinstance(e, ArtifactError):
      raise
    raise ArtifactError(f'{manifest_path} is damaged ({e})') from None
  return manifest


def _check_calling_convention(manifest: dict) -> None:
  version = manifest['calling_convention_version']
  low = jax_export.minimum_supported_calling_convention_version
  high = jax_export.maximum_supported_calling_convention_version
  if not low <= version <= high:
    raise ArtifactError(
        f'the artifact was exported by jax {manifest["jax_version"]} with '
        f'calling convention {version}; jax {jax.__version__} runs '
        f'{low}..{high}: export it again with this jax')


def _load_params(path: str, manifest: dict) -> list[np.ndarray]:
  with np.load(os.path.join(path, PARAMS), allow_pickle=False) as npz:
    leaves = [npz[f'{i:05d}'] for i in range(len(manifest['params']))]
  # numpy stores bfloat16 as raw 2-byte records: view them as the dtype again.
  return [x if str(x.dtype) == spec['dtype']
          else x.view(jax.numpy.dtype(spec['dtype']))
          for x, spec in zip(leaves, manifest['params'])]


def platform() -> str:
  """This process's backend by its ``jax.export`` lowering name ('cpu',
  'cuda', 'tpu'; jax calls a CUDA GPU 'gpu')."""
  backend = jax.default_backend()
  return 'cuda' if backend == 'gpu' else backend


class ExportedTranslator:
  """A callable ``list[str] -> list[str]`` around an artifact's modules.

  Thread-safe: decoder calls are serialised by a lock (one device).
  """

  # The request options of xfmr_jax.service_request it decodes: none, as the
  # artifact holds the plain search only.
  options = frozenset()

  def __init__(self, path: str):
    manifest = _read_manifest(path)
    _check_calling_convention(manifest)
    self.path, self.manifest = path, manifest
    backend = platform()
    if backend not in manifest['platforms']:
      raise ArtifactError(
          f'{path} was exported for {manifest["platforms"]}, not for this '
          f'{backend} backend: export it with --platforms={backend}')
    try:
      if os.path.isdir(os.path.join(path, marian_tokenizer.DIRNAME)):
        self.tokenizer = marian_tokenizer.MarianTokenizer.load(path)
      else:
        self.tokenizer = Tokenizer.load(os.path.join(path, MODEL_FILENAME))
    except (TokenizerError, FileNotFoundError) as e:
      raise ArtifactError(str(e)) from None
    self.params = [jax.device_put(x) for x in _load_params(path, manifest)]
    self.buckets = list(manifest['buckets'])
    self.beam_sizes = list(manifest['beam_sizes'])
    self.max_input = manifest['max_input']
    self.batch_size = manifest['batch_size']
    self._modules = {}
    for name, info in manifest['modules'].items():
      with open(os.path.join(path, name), 'rb') as f:
        blob = f.read()
      try:
        exported = jax_export.deserialize(bytearray(blob))
      except Exception as e:  # flatbuffers raises assorted errors
        raise ArtifactError(f'{path}: {name} cannot be read ({e})') from None
      key = info['beam_size'], info['width'], info.get('rows')
      self._modules[key] = jax.jit(exported.call)
    self._executables = {}   # (beam, width, rows) -> compiled
    self._lock = threading.Lock()

  def row_counts(self) -> list[int]:
    """The batch sizes decoder calls are padded to (see
    :func:`source_batches.row_counts`)."""
    return source_batches.row_counts(self.batch_size)

  def _executable(self, beam_size: int, width: int, rows: int):
    """The module compiled for ``[rows, width]`` inputs (compiled once): the
    one exported for exactly ``rows`` sentences where there is one (a beam
    search that drops finished sentences), else the any-batch one."""
    key = beam_size, width, rows
    if key not in self._executables:
      inputs = jax.ShapeDtypeStruct((rows, width), np.int32)
      module = (self._modules.get(key)
                or self._modules[beam_size, width, None])
      self._executables[key] = module.lower(self.params, inputs).compile()
    return self._executables[key]

  def warm_up(self, beam_sizes=None, widths=None) -> int:
    """Compile every row count for the given beam sizes and bucket widths
    (default all), so that no request waits for a compilation. Returns the
    number of executables compiled."""
    before = len(self._executables)
    with self._lock:
      for beam_size in beam_sizes or self.beam_sizes:
        for width in widths or self.buckets:
          for rows in self.row_counts():
            self._executable(self._beam(beam_size), width, rows)
    return len(self._executables) - before

  def encode(self, text: str, index: int = 0, too_long: str = 'error'):
    """Source ids with EOS (``None`` for a blank text); see
    :func:`source_batches.encode_source`."""
    return source_batches.encode_source(self.tokenizer, text, index,
                                        self.max_input, too_long)

  def bucket(self, length: int) -> int:
    return source_batches.bucket(length, self.max_input, self.buckets)

  def _beam(self, beam_size: int | None) -> int:
    beam_size = self.beam_sizes[0] if beam_size is None else beam_size
    if beam_size not in self.beam_sizes:
      raise ValueError(f'beam_size {beam_size} was not exported; this '
                       f'artifact has {self.beam_sizes}')
    return beam_size

  def decode_ids(self, inputs: np.ndarray, beam_size: int | None = None
                 ) -> np.ndarray:
    """``[rows, width]`` padded source ids (width a bucket) -> output ids."""
    beam_size = self._beam(beam_size)
    if inputs.shape[1] not in self.buckets:
      raise ValueError(f'input width {inputs.shape[1]} is not one of the '
                       f'exported buckets {self.buckets}')
    with self._lock:
      rows, width = inputs.shape
      call = self._executable(beam_size, width, rows)
      return np.asarray(call(self.params, inputs))

  def translate_encoded(self, rows: Sequence[list[int]], beam_size=None
                        ) -> list[str]:
    """Translations of encoded sources that share one bucket (at most
    ``batch_size`` of them), padded to a power-of-two number of rows."""
    width = self.bucket(max(len(r) for r in rows))
    outputs = self.decode_ids(
        source_batches.pad_rows(rows, width, self.batch_size), beam_size)
    return [self.tokenizer.decode(outputs[r]) for r in range(len(rows))]

  def __call__(self, texts: Sequence[str], beam_size: int | None = None, *,
               too_long: str = 'truncate') -> list[str]:
    """Translations of ``texts`` in order; an empty input gives ''."""
    beam_size = self._beam(beam_size)
    encoded = [self.encode(t, i, too_long) for i, t in enumerate(texts)]
    return source_batches.translate_in_order(
        encoded, self.batch_size, self.max_input,
        lambda chunk, _: self.translate_encoded([encoded[i] for i in chunk],
                                                beam_size), self.buckets)


def load(path: str) -> ExportedTranslator:
  """The translator exported to ``path`` by ``python -m experiments.export``."""
  if not os.path.isdir(path):
    raise ArtifactError(f'no exported translator at {path}')
  return ExportedTranslator(path)
