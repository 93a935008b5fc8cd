"""Evaluation of a translation model: token-level loss and accuracy, and
translation quality (sacreBLEU on detokenized text, exact match).

    metrics, samples = evaluate(config, model, params, tokenizer, eval_fn,
                                batches, source, limit)
"""
from __future__ import annotations

import math

import jax
import numpy as np
import sacrebleu
import tqdm

from xfmr_jax import sharding, train_steps
from xfmr_jax.data import pipeline
from xfmr_jax.translate import Translator, beam_settings


class Stopped(Exception):
  """Evaluation was asked to stop (``should_stop`` returned True)."""


def translator(config, model, params, tokenizer) -> Translator:
  """The :class:`Translator` a training config evaluates with (its beam size,
  length penalty, decode length and batch size)."""
  return Translator(model, params, tokenizer, beam_size=config.beam_size,
                    **beam_settings(config),
                    max_decode_extra=config.max_decode_extra,
                    batch_size=config.eval_batch_size)


def _check(should_stop):
  if should_stop is not None and should_stop():
    raise Stopped


def evaluate_loss(eval_fn, params, batches, mesh=None,
                  should_stop=None) -> dict:
  """Per-token smoothed loss, NLL, perplexity and accuracy over ``batches``.

  With ``mesh``, each (whole, same on every process) batch is split over the
  mesh's data axes.
  """
  totals = None
  for batch in batches:
    _check(should_stop)
    arrays = train_steps.model_inputs(batch)
    if mesh is not None:
      arrays = sharding.global_batch(arrays, mesh, replicated_input=True)
    metrics = jax.device_get(eval_fn(params, arrays))
    totals = metrics if totals is None else {
        k: totals[k] + metrics[k] for k in totals}
  tokens = max(float(totals['tokens']), 1.0)
  nll = float(totals['nll']) / tokens
  return {'loss': float(totals['loss']) / tokens, 'nll': nll,
          'perplexity': math.exp(min(nll, 50.0)),
          'accuracy': float(totals['correct']) / tokens}


def evaluate_translation(translate: Translator, source, limit: int, *,
                         progress: str | None = None,
                         should_stop=None) -> dict:
  """sacreBLEU (:func:`corpus_bleu`, with its ``bleu_signature``) and exact
  match of ``translate`` on the first ``limit`` pairs (all if
  ``limit <= 0``), with the ``samples`` (source, reference, output).

  ``progress`` names a progress bar over the decoder calls (none if None);
  ``should_stop()`` is asked before each of them (True raises :class:`Stopped`).
  """
  n = len(source) if limit <= 0 else min(limit, len(source))
  pairs = pipeline.read_pairs(source, list(range(n)))
  sources = [p[0] for p in pairs]
  # Length-sorted chunks of a few decoder batches: the bar moves, and each
  # chunk pads about as little as one call over everything would.
  order = sorted(range(n), key=lambda i: len(sources[i]))
  chunk = 4 * translate.batch_size
  hyps = [''] * n
  starts = range(0, n, chunk)
  bar = tqdm.tqdm(starts, desc=progress, leave=False, dynamic_ncols=True,
                  disable=progress is None or jax.process_index() != 0)
  for start in bar:
    _check(should_stop)
    part = order[start:start + chunk]
    for i, h in zip(part, translate([sources[i] for i in part])):
      hyps[i] = h
  refs = [p[1] for p in pairs]
  bleu, signature = corpus_bleu(hyps, refs)
  exact = float(np.mean([h == r for h, r in zip(hyps, refs)]))
  samples = [dict(source=p[0], reference=p[1], output=h)
             for p, h in zip(pairs, hyps)]
  return {'bleu': bleu, 'bleu_signature': signature, 'exact_match': exact,
          'samples': samples}


def corpus_bleu(hypotheses, references) -> tuple[float, str]:
  """sacreBLEU of detokenized text, and the signature that says how it was
  computed (``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:...``).

  Both sides are plain text: the references as the corpus has them, the
  hypotheses as the SentencePiece decoder writes them, so sacreBLEU applies
  its own standard tokenization (13a) to both. This is the score WMT reports
  today; the paper's tables used tokenized BLEU (docs/data.md).
  """
  metric = sacrebleu.metrics.BLEU()
  score = metric.corpus_score(list(hypotheses), [list(references)])
  return score.score, str(metric.get_signature())


def evaluate(config, model, params, tokenizer, eval_fn, batches, source,
             limit: int, mesh=None, progress: str | None = None,
             should_stop=None):
  """``(metrics, samples)``: :func:`evaluate_loss` over ``batches`` and
  :func:`evaluate_translation` of the first ``limit`` pairs of ``source``."""
  metrics = evaluate_loss(eval_fn, params, batches, mesh, should_stop)
  translation = evaluate_translation(
      translator(config, model, params, tokenizer), source, limit,
      progress=progress, should_stop=should_stop)
  samples = translation.pop('samples')
  return {**metrics, **translation}, samples


def format_samples(samples, n: int) -> str:
  """The first ``n`` samples as indented source / reference / output lines."""
  return '\n'.join(f"  source:    {s['source']}\n  reference: {s['reference']}"
                   f"\n  output:    {s['output']}" for s in samples[:n])
