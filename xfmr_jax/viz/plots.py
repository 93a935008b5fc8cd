"""Plots of training and of what the model computes: the training curve,
attention maps (one head, all heads, over a reference word alignment), the
masks and the positional encodings."""
from __future__ import annotations

import json
import os

import numpy as np

from xfmr_jax import decode, masks
from xfmr_jax.data import toy_language
from xfmr_jax.token_ids import EOS, PAD
from xfmr_jax.viz.figure import axes_or_new, plt


# ----------------------------------------------------------------- training --

def read_metrics(workdir: str) -> list[dict]:
  """Rows of ``<workdir>/metrics.jsonl`` (or of that file given directly)."""
  path = workdir if workdir.endswith('.jsonl') else os.path.join(
      workdir, 'metrics.jsonl')
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def training_curve(rows: list[dict], ax=None, key: str = 'loss'):
  """``key`` against step: train as a line, eval and test as markers.

  ``rows`` as from :func:`read_metrics`. The loss is label-smoothed (it cannot
  reach 0); pass ``key='nll'`` for the plain negative log-likelihood.
  """
  ax = axes_or_new(ax)
  styles = {'train': dict(ls='-'), 'eval': dict(ls='', marker='o'),
            'test': dict(ls='', marker='*', ms=12)}
  for split, style in styles.items():
    pts = [(r['step'], r[key]) for r in rows
           if r.get('split') == split and key in r]
    if pts:
      ax.plot(*zip(*pts), label=split, **style)
  ax.set_yscale('log')
  ax.set(xlabel='step', ylabel=key, title=f'Training curve ({key})')
  ax.legend()
  return ax


# ---------------------------------------------------------------- attention --

def attention_map(weights, query_labels=None, key_labels=None, ax=None,
                  title: str | None = None, alignment=None):
  """One ``[queries, keys]`` attention matrix as an image.

  Args:
    weights: ``[q, k]`` (rows sum to 1).
    query_labels, key_labels: tick labels (e.g. sentencepiece pieces).
    alignment: optional ``(query_index, key_index)`` pairs drawn as hollow
      squares, e.g. the reference word alignment from :func:`token_alignment`.
  """
  weights = np.asarray(weights, np.float32)
  ax = axes_or_new(ax, (0.3 * weights.shape[1] + 2,
                       0.3 * weights.shape[0] + 1.5))
  ax.imshow(weights, cmap='viridis', vmin=0, vmax=max(weights.max(), 1e-6),
            aspect='auto', interpolation='nearest')
  if key_labels is not None:
    ax.set_xticks(range(len(key_labels)), key_labels, rotation=90, fontsize=8)
  if query_labels is not None:
    ax.set_yticks(range(len(query_labels)), query_labels, fontsize=8)
  if alignment:
    q, k = np.asarray(list(alignment)).T
    ax.scatter(k, q, marker='s', s=60, facecolors='none', edgecolors='red',
               linewidths=1.0, label='reference alignment')
    ax.legend(loc='upper right', fontsize=7)
  ax.set(xlabel='key', ylabel='query')
  if title:
    ax.set_title(title)
  return ax


def attention_heads(weights, query_labels=None, key_labels=None, heads=None,
                    title: str | None = None, axes=None):
  """Several heads of one layer side by side.

  Args:
    weights: ``[heads, q, k]`` (one example of one layer).
    heads: which heads to draw (default: all).

  Returns:
    the array of axes.
  """
  weights = np.asarray(weights)
  heads = list(range(weights.shape[0])) if heads is None else list(heads)
  if axes is None:
    q, k = weights.shape[1:]
    size = (min(4.5, 0.22 * k + 1.5) * len(heads), min(4.5, 0.22 * q + 1.2))
    _, axes = plt.subplots(1, len(heads), figsize=size, squeeze=False)
    axes = axes[0]
  for ax, h in zip(axes, heads):
    attention_map(weights[h], query_labels if ax is axes[0] else None,
                  key_labels, ax=ax, title=f'head {h}')
    if ax is not axes[0]:
      ax.set_yticks([])
      ax.set_ylabel('')
  if title:
    axes[0].figure.suptitle(title)
  return axes


def token_alignment(source_pieces, target_pieces, word_alignment,
                    word_start: str = '\u2581'):
  """Map a word alignment onto sentencepiece tokens.

  Args:
    source_pieces, target_pieces: pieces in order; a piece starting with
      ``word_start`` (sentencepiece's "\u2581") begins a new word.
    word_alignment: ``(source_word, target_word)`` pairs, e.g. from
      :meth:`xfmr_jax.data.toy_language.ToyLanguage.pair`.

  Returns:
    ``(target_token, source_token)`` pairs (query, key), every token of each
    aligned word pair.
  """
  def words(pieces):
    index, out = -1, []
    for p in pieces:
      if p.startswith(word_start) or index < 0:
        index += 1
      out.append(index)
    return np.asarray(out)
  src, tgt = words(source_pieces), words(target_pieces)
  return sorted({(int(j), int(i)) for s, t in word_alignment
                 for j in np.flatnonzero(tgt == t)
                 for i in np.flatnonzero(src == s)})


# A toy source sentence whose translation reorders a lot: the verb goes to the
# end, the relative clause ("that ...") before its noun, the adjectives after it.
EXAMPLE_SENTENCE = 'drag glipos that vol fodibri lod plowad'


def translation_attention(model, params, tokenizer, source: str):
  """Greedy-translate ``source`` and return its attention maps and labels.

  Returns:
    dict with ``maps`` (see :func:`xfmr_jax.decode.attention_maps`, batch of
    one, trimmed to the real tokens), ``source_pieces``, ``output_pieces``,
    ``translation``, ``reference`` and ``alignment`` (the reference word
    alignment mapped to tokens; None unless ``source`` is a toy-language
    sentence and the translation equals its reference).
  """
  ids = tokenizer.encode(source) + [EOS]
  inputs = np.asarray([ids], np.int32)
  out = np.asarray(decode.greedy_decode(model, params, inputs,
                                        max_decode_len=len(ids) + 20))[0]
  n_out = int(np.argmax(out == EOS)) + 1 if (out == EOS).any() else len(out)
  outputs = out[None, :n_out]
  maps = {k: np.asarray(v) for k, v in
          decode.attention_maps(model, params, inputs, outputs).items()}
  piece = tokenizer.id_to_piece
  src_pieces = [piece(int(i)) for i in ids]
  out_pieces = [piece(int(i)) for i in outputs[0]]
  translation = tokenizer.decode(outputs[0])
  alignment = reference = None
  try:
    language = toy_language.LANGUAGE
    _, reference, words = language.pair(language.parse(source))
  except Exception:  # pylint: disable=broad-except  # not a toy sentence
    words = None
  if words is not None and translation == reference:
    alignment = token_alignment(src_pieces[:-1], out_pieces[:-1], words)
    # The final EOS tokens are aligned too (they end both sentences).
    alignment.append((len(out_pieces) - 1, len(src_pieces) - 1))
  return dict(maps=maps, source_pieces=src_pieces, output_pieces=out_pieces,
              translation=translation, reference=reference,
              alignment=alignment)


# -------------------------------------------------------- masks, positions --

def mask_image(mask, ax=None, title: str | None = None, query_labels=None,
               key_labels=None):
  """A boolean mask ``[..., q, k]`` (leading size-1 axes dropped) as a picture:
  dark = may attend, light = blocked (score set to -inf before the softmax)."""
  m = np.asarray(mask)
  while m.ndim > 2:
    m = m[0]
  ax = axes_or_new(ax, (4, 4))
  ax.imshow(m, cmap='Greys', vmin=0, vmax=1.4, interpolation='nearest')
  ax.set_xticks(range(m.shape[1]),
                key_labels if key_labels is not None else range(m.shape[1]),
                fontsize=7)
  ax.set_yticks(range(m.shape[0]),
                query_labels if query_labels is not None else range(m.shape[0]),
                fontsize=7)
  ax.set(xlabel='key', ylabel='query')
  if title:
    ax.set_title(title, fontsize=10)
  return ax


def mask_gallery(length: int = 8, padding: int = 3, axes=None):
  """Causal, padding, both, and packed-segment masks from :mod:`xfmr_jax.masks`.

  One example row of ``length`` tokens whose last ``padding`` are padding;
  the packed row holds two sequences (segment ids 1 and 2) then padding.
  """
  tokens = np.arange(1, length + 1)
  tokens[length - padding:] = PAD
  tokens = tokens[None]
  first = (length - padding) // 2
  segments = np.array([[1] * first + [2] * (length - padding - first)
                       + [0] * padding])
  causal = masks.causal_mask(length)
  pad = masks.padding_mask(tokens, tokens)
  panels = [(causal, 'causal_mask: query i sees keys <= i'),
            (pad, 'padding_mask: no pad keys or queries'),
            (masks.combine_masks(causal, pad), 'decoder: causal AND padding'),
            (masks.combine_masks(causal, masks.segment_mask(segments, segments)),
             'packed: causal AND segment_mask')]
  if axes is None:
    _, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
  labels = [str(t) if t else 'pad' for t in tokens[0]]
  for ax, (m, title) in zip(axes, panels):
    mask_image(m, ax, title, labels, labels)
  axes[-1].set_xticks(range(length), [f's{s}' if s else 'pad'
                                      for s in segments[0]], fontsize=7)
  axes[-1].set_yticks(range(length), [f's{s}' if s else 'pad'
                                      for s in segments[0]], fontsize=7)
  return axes


def positional_heatmap(pe: np.ndarray, ax=None):
  """Heatmap of a ``[length, d_model]`` positional-encoding table."""
  ax = axes_or_new(ax)
  image = ax.imshow(np.asarray(pe), aspect='auto', cmap='RdBu', vmin=-1, vmax=1)
  ax.figure.colorbar(image, ax=ax)
  ax.set(xlabel='dimension', ylabel='position',
         title='Sinusoidal positional encoding')
  return ax


def position_similarity(pe: np.ndarray, reference_positions=(0, 25, 50),
                        ax=None):
  """``PE(p) . PE(q)`` against q for a few reference positions p."""
  ax = axes_or_new(ax)
  pe = np.asarray(pe, np.float64)
  for p in reference_positions:
    ax.plot(pe @ pe[p], label=f'p = {p}')
    ax.axvline(p, color='grey', lw=0.5, ls=':')
  ax.set(xlabel='position q', ylabel='PE(p) . PE(q)',
         title='Dot product peaks at q = p and depends on |p - q|')
  ax.legend()
  return ax
