"""Export a trained translator as a self-contained artifact (``jax.export``).

    export_workdir('workdir', 'artifact', beam_sizes=(1, 4))
    translate = xfmr_jax.serving.load('artifact')   # no flax, no model code

An artifact is a folder:

- ``translate_b{beam}_s{width}.jaxexport``: one serialized ``jax.export``
  module per decode setting and source bucket: the encoder and the cached
  greedy (beam 1) or beam-search decoder exactly as :class:`Translator` runs
  them, for inputs ``[batch, width]`` with a symbolic ``batch``, lowered for
  every platform asked for. Each takes ``(param_leaves, inputs)`` and returns
  ``[batch, width + extra]`` output ids (capped by the model's ``max_len``).
- ``translate_b{beam}_s{width}_r{rows}.jaxexport``: the beam search again for
  exactly ``rows`` sentences, for each padded row count of 16 or more. A
  search whose batch is known drops its finished sentences from the decoded
  rows as the batch thins out (:func:`xfmr_jax.beam_search.segment_sizes`);
  with a symbolic batch it cannot, and every sentence costs until the last
  one ends.
- ``params.npz``: the parameters as a flat list of arrays, passed to the
  modules at call time rather than baked into them, so the modules stay small
  and one parameter file serves every bucket.
- ``tokenizer.model`` (or ``marian_tokenizer/`` for an imported Marian
  model): the tokenizer, as a workdir keeps it.
- ``manifest.json``: versions (jax, jaxlib, the export calling convention),
  platforms, buckets, decode settings, the parameter shapes and dtypes, and a
  SHA-256 of every file so that a damaged copy is caught on load.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import export as jax_export

from xfmr_jax import beam_search, decode, source_batches, translate
from xfmr_jax.model import SequenceModel
from xfmr_jax import serving
from xfmr_jax.serving import FORMAT, MANIFEST, PARAMS, sha256
from xfmr_jax.workdir import Workdir

PLATFORMS = ('cpu', 'cuda', 'rocm', 'tpu')


def module_name(beam_size: int, width: int, rows: int | None = None) -> str:
  """The file of the module for ``beam_size`` and bucket ``width``; ``rows``:
  the one for exactly that many sentences (None: any number)."""
  suffix = '' if rows is None else f'_r{rows}'
  return f'translate_b{beam_size}_s{width}{suffix}.jaxexport'


def fixed_row_counts(beam_size: int, batch_size: int) -> list[int]:
  """The row counts that get a module of their own: those where a beam
  search of known batch compacts (more than one segment). Greedy search
  has no segments, so the symbolic module serves it alone."""
  if beam_size == 1:
    return []
  return [rows for rows in source_batches.row_counts(batch_size)
          if len(beam_search.segment_sizes(rows)) > 1]


def default_platforms() -> list[str]:
  """The CPU plus the backend this process runs on (if another)."""
  here = serving.platform()
  return ['cpu'] + ([here] if here != 'cpu' else [])


def _decode_fn(model: SequenceModel, treedef, beam_size: int, alpha: float,
               beam_rules: str, length: int):
  """``(param_leaves, inputs [b, s]) -> [b, length]`` ids, as Translator."""
  def run(leaves, inputs):
    return translate.search(model, jax.tree.unflatten(treedef, leaves), inputs,
                            beam_size=beam_size, alpha=alpha,
                            beam_rules=beam_rules, max_decode_len=length)
  return jax.jit(run)


def export_translator(model: SequenceModel, params, tokenizer, out_dir: str,
                      *, beam_sizes: Sequence[int] = (4, 1),
                      alpha: float = 0.6, beam_rules: str = 'gnmt',
                      max_decode_extra: int = decode.DECODE_EXTRA,
                      batch_size: int = 64,
                      platforms: Sequence[str] | None = None,
                      buckets: Sequence[int] | None = None,
                      progress=print) -> dict:
  """Write an artifact for ``model`` and ``params`` to ``out_dir``.

  Args:
    tokenizer: a :class:`~xfmr_jax.tokenizer.Tokenizer` or an imported
      Marian one (saved as the workdir keeps it).
    beam_sizes: decoders to export; 1 is greedy. The first is the default.
    alpha, beam_rules: the beam search's scoring, as for :class:`Translator`.
    batch_size: the most sentences the loaded translator decodes per call.
    platforms: lowering targets (default :func:`default_platforms`).
    buckets: source widths (default every bucket up to the model maximum);
      the largest is the longest input the loaded translator takes.
    progress: called with one line per exported module.

  Returns:
    The manifest.

  The artifact is written into ``out_dir + '.tmp'`` and renamed at the end,
  so an interrupted export leaves no half-written artifact behind.
  """
  platforms = list(platforms or default_platforms())
  bad = [p for p in platforms if p not in PLATFORMS]
  if bad:
    raise ValueError(f'unknown platforms {bad}; choose from {list(PLATFORMS)}')
  beam_sizes = list(dict.fromkeys(int(b) for b in beam_sizes))
  if not beam_sizes or min(beam_sizes) < 1:
    raise ValueError(f'beam sizes must be >= 1, got {beam_sizes}')
  if beam_rules not in translate.BEAM_RULES:
    raise ValueError(f'beam_rules must be one of {translate.BEAM_RULES}, got '
                     f'{beam_rules!r}')
  if batch_size < 1:
    raise ValueError(f'batch_size must be >= 1, got {batch_size}')
  config = model.config
  if config.model_kind == 'encoder_only':
    raise ValueError('an encoder_only model tags tokens; it does not translate')
  max_input = source_batches.max_input_length(config.max_len,
                                              config.model_kind)
  widths = (source_batches.buckets_up_to(max_input) if buckets is None
            else sorted({source_batches.bucket(b, max_input) for b in buckets}))
  leaves, treedef = jax.tree.flatten(nn.unbox(params))
  leaves = [np.asarray(x) for x in leaves]
  specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  batch, = jax_export.symbolic_shape('batch')

  tmp = out_dir.rstrip('/') + '.tmp'
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  np.savez(os.path.join(tmp, PARAMS),
           **{f'{i:05d}': x for i, x in enumerate(leaves)})
  tokenizer.save(tmp)
  modules, start = {}, time.time()
  for beam_size in beam_sizes:
    for width in widths:
      length = decode.decode_length(config, width, extra=max_decode_extra)
      fn = _decode_fn(model, treedef, beam_size, alpha, beam_rules, length)
      for rows in [None] + fixed_row_counts(beam_size, batch_size):
        exported = jax_export.export(fn, platforms=platforms)(
            specs, jax.ShapeDtypeStruct((rows or batch, width), jnp.int32))
        name = module_name(beam_size, width, rows)
        with open(os.path.join(tmp, name), 'wb') as f:
          f.write(exported.serialize())
        modules[name] = dict(beam_size=beam_size, width=width, rows=rows,
                             output_length=length)
        progress(f'exported {name} ({time.time() - start:.1f} s)')

  files = sorted(os.path.relpath(os.path.join(root, name), tmp)
                 for root, _, names in os.walk(tmp) for name in names)
  manifest = dict(
      format=FORMAT, created=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
      jax_version=jax.__version__, jaxlib_version=jaxlib.__version__,
      calling_convention_version=exported.calling_convention_version,
      platforms=platforms, model_kind=config.model_kind,
      vocab_size=tokenizer.vocab_size, max_input=widths[-1], buckets=widths,
      beam_sizes=beam_sizes, alpha=alpha, beam_rules=beam_rules,
      max_decode_extra=max_decode_extra,
      batch_size=batch_size, modules=modules,
      params=[dict(shape=list(x.shape), dtype=str(x.dtype)) for x in leaves],
      sha256={name: sha256(os.path.join(tmp, name)) for name in files})
  with open(os.path.join(tmp, MANIFEST), 'w') as f:
    json.dump(manifest, f, indent=2)
  shutil.rmtree(out_dir, ignore_errors=True)
  os.replace(tmp, out_dir)
  return manifest


def export_workdir(workdir: str, out_dir: str, step: int | None = None,
                   **kwargs) -> dict:
  """:func:`export_translator` for the newest (or given) checkpoint of a
  training workdir; ``alpha`` and ``beam_rules`` default to the workdir's
  (as for ``Translator.from_workdir``)."""
  trained = Workdir(workdir).load(step)
  return export_translator(
      trained.model, trained.params, trained.tokenizer, out_dir,
      **{**translate.beam_settings(trained.config), **kwargs})
