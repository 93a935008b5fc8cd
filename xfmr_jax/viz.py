"""Pictures of the model, shared by the notebooks and ``experiments/figures.py``.

Each plotting function draws on a matplotlib ``Axes`` (created if not given)
and returns it (or the array of axes it drew on), so a notebook can compose
figures and a script can :func:`save` them. A few functions also compute what
they draw with the library's own functions (``score_histograms``,
``mask_gallery``, ``permutation_errors``, ``attention_cost``): the picture is
then a measurement of this code, not an illustration.

  training     read_metrics, training_curve
  attention    attention_map, attention_heads, token_alignment,
               translation_attention
  anatomy      score_histograms, mask_image, mask_gallery, positional_heatmap,
               position_similarity, permutation_errors, equivariance_plot,
               attention_cost, complexity_plot
  overview     architecture_diagram
"""
from __future__ import annotations

import json
import os
import sys
import time

import matplotlib

if 'ipykernel' not in sys.modules and 'MPLBACKEND' not in os.environ:
  matplotlib.use('Agg', force=False)  # headless scripts; notebooks keep inline
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _axes(ax, figsize=(7, 4)):
  return ax if ax is not None else plt.figure(figsize=figsize).add_subplot()


def _figure_of(obj):
  if isinstance(obj, np.ndarray):
    obj = obj.flat[0]
  return obj if isinstance(obj, matplotlib.figure.Figure) else obj.figure


def save(ax, path: str) -> str:
  """Write the figure holding ``ax`` (an Axes, array of Axes or Figure) to
  ``path`` and close it."""
  fig = _figure_of(ax)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


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
  ax = _axes(ax)
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
  ax = _axes(ax, (0.3 * weights.shape[1] + 2, 0.3 * weights.shape[0] + 1.5))
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
  from xfmr_jax import decode
  from xfmr_jax.data import toy_language
  from xfmr_jax.tokenizer import EOS
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


# ------------------------------------------------------------------ anatomy --

def score_histograms(d_ks=(4, 64, 1024), queries: int = 64, keys: int = 64,
                     seed: int = 0, axes=None):
  """The sqrt(d_k) argument, measured (paper 3.2.1, seed section 3).

  With unit-variance independent components, ``q . k`` has variance ``d_k``;
  dividing by sqrt(d_k) brings it back to 1. Left: score histograms without
  scaling; middle: with it; right: the largest softmax weight per query from
  :func:`xfmr_jax.attention.attention_weights` (near 1 = saturated, one-hot).

  Returns:
    ``(axes, stats)``; stats maps ``d_k`` to the measured score variances and
    mean largest weight, unscaled and scaled.
  """
  import jax
  from xfmr_jax import attention
  if axes is None:
    _, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  stats = {}
  key = jax.random.key(seed)
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  for i, d_k in enumerate(d_ks):
    color = colors[i % len(colors)]
    kq, kk, key = jax.random.split(key, 3)
    q = jax.random.normal(kq, (1, queries, 1, d_k))
    k = jax.random.normal(kk, (1, keys, 1, d_k))
    raw = np.asarray(np.einsum('bqhd,bkhd->bhqk', q, k)).ravel()
    scaled = raw / np.sqrt(d_k)
    # attention_weights divides by sqrt(d_k); multiplying q undoes it.
    w_scaled = attention.attention_weights(q, k)
    w_raw = attention.attention_weights(q * np.sqrt(d_k), k)
    top_scaled = np.asarray(w_scaled.max(-1)).ravel()
    top_raw = np.asarray(w_raw.max(-1)).ravel()
    stats[d_k] = dict(var_unscaled=float(raw.var()),
                      var_scaled=float(scaled.var()),
                      max_weight_unscaled=float(top_raw.mean()),
                      max_weight_scaled=float(top_scaled.mean()))
    axes[0].hist(raw, bins=60, histtype='step', density=True, color=color,
                 label=f'd_k={d_k}: var {raw.var():.1f}')
    axes[1].hist(scaled, bins=60, histtype='step', density=True, color=color,
                 label=f'd_k={d_k}: var {scaled.var():.2f}')
    axes[2].hist(top_raw, bins=30, range=(0, 1), histtype='step',
                 color=color, ls='--', label=f'd_k={d_k}, unscaled')
    axes[2].hist(top_scaled, bins=30, range=(0, 1), histtype='step',
                 color=color,
                 label=f'd_k={d_k}, scaled')
  axes[0].set(title='q . k (no scaling): variance = d_k', xlabel='score')
  axes[1].set(title='q . k / sqrt(d_k): variance = 1', xlabel='score')
  axes[2].set(title='largest softmax weight per query', xlabel='max weight',
              ylabel='queries')
  for ax in axes:
    ax.legend(fontsize=7)
  return axes, stats


def mask_image(mask, ax=None, title: str | None = None, query_labels=None,
               key_labels=None):
  """A boolean mask ``[..., q, k]`` (leading size-1 axes dropped) as a picture:
  dark = may attend, light = blocked (score set to -inf before the softmax)."""
  m = np.asarray(mask)
  while m.ndim > 2:
    m = m[0]
  ax = _axes(ax, (4, 4))
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
  from xfmr_jax import masks
  tokens = np.arange(1, length + 1)
  tokens[length - padding:] = masks.PAD_ID
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
  ax = _axes(ax)
  image = ax.imshow(np.asarray(pe), aspect='auto', cmap='RdBu', vmin=-1, vmax=1)
  ax.figure.colorbar(image, ax=ax)
  ax.set(xlabel='dimension', ylabel='position',
         title='Sinusoidal positional encoding')
  return ax


def position_similarity(pe: np.ndarray, reference_positions=(0, 25, 50),
                        ax=None):
  """``PE(p) . PE(q)`` against q for a few reference positions p."""
  ax = _axes(ax)
  pe = np.asarray(pe, np.float64)
  for p in reference_positions:
    ax.plot(pe @ pe[p], label=f'p = {p}')
    ax.axvline(p, color='grey', lw=0.5, ls=':')
  ax.set(xlabel='position q', ylabel='PE(p) . PE(q)',
         title='Dot product peaks at q = p and depends on |p - q|')
  ax.legend()
  return ax


def permutation_errors(length: int = 10, d_model: int = 32, num_heads: int = 4,
                       num_layers: int = 2, vocab_size: int = 64,
                       seed: int = 0) -> dict:
  """How far the encoder is from permutation equivariance.

  For a random token row ``x`` and a permutation ``P``, compares
  ``encode(P x)`` with ``P encode(x)`` per position, for an encoder with no
  positional encoding (self-attention alone: equivariant, error ~1e-7) and one
  with sinusoidal positions (not: shuffling the words changes the result).

  Returns:
    ``{'none': errors [length], 'sinusoidal': errors [length], 'permutation':
    P}``; errors are max-abs differences relative to the output scale.
  """
  import jax
  from xfmr_jax.config import ModelConfig
  from xfmr_jax.model import Transformer
  rng = np.random.default_rng(seed)
  x = rng.integers(2, vocab_size, (1, length)).astype(np.int32)
  perm = rng.permutation(length)
  out = {'permutation': perm}
  for positional in ('none', 'sinusoidal'):
    cfg = ModelConfig(vocab_size=vocab_size, d_model=d_model,
                      num_heads=num_heads, d_ff=2 * d_model,
                      num_encoder_layers=num_layers, num_decoder_layers=1,
                      dropout_rate=0.0, max_len=max(64, length),
                      positional=positional)
    model = Transformer(cfg)
    variables = model.init(jax.random.key(seed), x, x)
    encode = jax.jit(lambda v, t: model.apply(v, t, method=model.encode))
    a = np.asarray(encode(variables, x))[0][perm]    # P encode(x)
    b = np.asarray(encode(variables, x[:, perm]))[0]  # encode(P x)
    out[positional] = np.abs(a - b).max(-1) / np.abs(a).max()
  return out


def equivariance_plot(errors: dict, ax=None):
  """Bars of :func:`permutation_errors` per position, on a log scale."""
  ax = _axes(ax)
  n = len(errors['none'])
  width = 0.4
  floor = 1e-9  # exact zeros would vanish on a log axis
  for i, name in enumerate(('none', 'sinusoidal')):
    ax.bar(np.arange(n) + (i - 0.5) * width,
           np.maximum(errors[name], floor), width,
           label=f"positional='{name}'")
  ax.set_yscale('log')
  ax.set(xlabel='position', ylabel='|encode(Px) - P encode(x)| (relative)',
         title='Self-attention without positions is permutation-equivariant')
  ax.legend()
  return ax


def _time(fn, *args, repeats: int = 3) -> float:
  """Best-of-``repeats`` seconds of a compiled ``fn(*args)``."""
  import jax
  jax.block_until_ready(fn(*args))  # compile
  best = float('inf')
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t)
  return best


def attention_cost(lengths=(64, 128, 256, 512, 1024), d_model: int = 128,
                   num_heads: int = 4, batch: int = 1,
                   repeats: int = 3) -> dict:
  """Measure the seed's complexity table (section 8) on this backend.

  For each sequence length ``n``: the wall time of one self-attention
  (:func:`xfmr_jax.attention.dot_product_attention`, ``O(n^2 d)`` work, one
  parallel step) and of one recurrent layer ``h_t = tanh(x_t W + h_{t-1} U)``
  as a ``lax.scan`` (``O(n d^2)`` work, ``n`` sequential steps), and the
  compiler's temporary memory of the attention (it holds the ``n x n`` score
  matrix; ``None`` where the backend does not report it).

  Returns:
    dict of lists: ``length``, ``attention_s``, ``rnn_s``, ``attention_temp_bytes``,
    ``score_bytes`` (``batch * heads * n^2 * 4``).
  """
  import jax
  import jax.numpy as jnp
  from xfmr_jax import attention
  head_dim = d_model // num_heads
  attend = jax.jit(lambda q, k, v: attention.dot_product_attention(q, k, v))

  @jax.jit
  def rnn(x, w, u):
    def cell(h, x_t):
      h = jnp.tanh(x_t @ w + h @ u)
      return h, h
    _, hs = jax.lax.scan(cell, jnp.zeros((x.shape[0], d_model)),
                         x.swapaxes(0, 1))
    return hs
  key = jax.random.key(0)
  w = jax.random.normal(key, (d_model, d_model)) / np.sqrt(d_model)
  out = {k: [] for k in ('length', 'attention_s', 'rnn_s',
                         'attention_temp_bytes', 'score_bytes')}
  for n in lengths:
    q = jax.random.normal(key, (batch, n, num_heads, head_dim))
    x = jax.random.normal(key, (batch, n, d_model))
    out['length'].append(n)
    out['attention_s'].append(_time(attend, q, q, q, repeats=repeats))
    out['rnn_s'].append(_time(rnn, x, w, w, repeats=repeats))
    try:
      stats = attend.lower(q, q, q).compile().memory_analysis()
      temp = None if stats is None else int(stats.temp_size_in_bytes)
    except Exception:  # pylint: disable=broad-except
      temp = None
    out['attention_temp_bytes'].append(temp)
    out['score_bytes'].append(batch * num_heads * n * n * 4)
  return out


def complexity_plot(cost: dict, axes=None):
  """Time and memory of :func:`attention_cost` against n (log-log), with
  ``n`` and ``n^2`` guide lines through the first point."""
  if axes is None:
    _, axes = plt.subplots(1, 2, figsize=(12, 4))
  n = np.asarray(cost['length'], float)
  for key, label in (('attention_s', 'self-attention, O(n^2 d), 1 step'),
                     ('rnn_s', 'RNN (lax.scan), O(n d^2), n steps')):
    axes[0].plot(n, np.asarray(cost[key]) * 1e3, 'o-', label=label)
  t0 = cost['attention_s'][0] * 1e3
  axes[0].plot(n, t0 * (n / n[0]) ** 2, 'k:', lw=0.8, label='~ n^2')
  axes[0].plot(n, t0 * n / n[0], 'k--', lw=0.8, label='~ n')
  axes[0].set(xscale='log', yscale='log', xlabel='sequence length n',
              ylabel='ms', title='Time of one layer')
  axes[0].legend(fontsize=8)
  axes[1].plot(n, np.asarray(cost['score_bytes']) / 2**20, 'o-',
               label='score matrix b*h*n^2*4 bytes')
  temp = [t for t in cost['attention_temp_bytes'] if t is not None]
  if len(temp) == len(n):
    axes[1].plot(n, np.asarray(temp) / 2**20, 's--',
                 label='compiler temp memory (measured)')
  axes[1].set(xscale='log', yscale='log', xlabel='sequence length n',
              ylabel='MiB', title='Memory of attention grows as n^2')
  axes[1].legend(fontsize=8)
  return axes


# ----------------------------------------------------------------- overview --

def _box(ax, x, y, w, h, text, color, fontsize=8, sub=None):
  ax.add_patch(matplotlib.patches.FancyBboxPatch(
      (x - w / 2, y - h / 2), w, h, boxstyle='round,pad=0.02,rounding_size=0.08',
      facecolor=color, edgecolor='black', lw=0.8))
  ax.text(x, y + (0.07 if sub else 0), text, ha='center', va='center',
          fontsize=fontsize)
  if sub:
    ax.text(x, y - 0.13, sub, ha='center', va='center', fontsize=6,
            family='monospace', color='#333333')


def _arrow(ax, x0, y0, x1, y1, **kw):
  ax.annotate('', (x1, y1), (x0, y0),
              arrowprops=dict(arrowstyle='->', lw=0.9, **kw))


def _column(ax, x, w, h, colors, source, embed_sub, blocks):
  """One stack of figure 1: input box, embedding box, then ``blocks`` of
  ``(y, text, color key, subtitle)`` joined by arrows."""
  _box(ax, x, 0.55, w, h, source[0], 'white', sub=source[1])
  _box(ax, x, 1.6, w, 0.75, 'Embedding x sqrt(d_model)\n+ positional encoding',
       colors['emb'], sub=embed_sub)
  for y, text, c, sub in blocks:
    _box(ax, x, y, w, h, text, colors[c], sub=sub)
  _arrow(ax, x, 0.8, x, 1.22)
  _arrow(ax, x, 1.98, x, 2.75)
  for (y0, *_), (y1, *_) in zip(blocks, blocks[1:]):
    _arrow(ax, x, y0 + h / 2, x, y1 - h / 2)


def architecture_diagram(config=None, ax=None):
  """Figure 1 of the paper, drawn with the names of the functions in this
  library that implement each block.

  Args:
    config: a :class:`xfmr_jax.config.ModelConfig` for the labels (layer
      counts, widths); the paper's base model by default.
  """
  from xfmr_jax.config import ModelConfig
  cfg = config or ModelConfig()
  ax = _axes(ax, (10, 9.5))
  ax.set(xlim=(0, 10), ylim=(0, 11.6))
  ax.axis('off')
  colors = dict(attn='#fbd9a6', norm='#f6f3b5', ffn='#bfe3f5', emb='#f5c6cb',
                out='#d7c8ee', stack='#f2f2f2')
  w, h = 3.0, 0.5
  # Stacks.
  ex, dx = 2.6, 7.2
  ax.add_patch(matplotlib.patches.FancyBboxPatch(
      (ex - 1.8, 2.55), 3.6, 3.45, boxstyle='round,pad=0.05',
      facecolor=colors['stack'], edgecolor='grey'))
  ax.add_patch(matplotlib.patches.FancyBboxPatch(
      (dx - 1.8, 2.55), 3.6, 5.45, boxstyle='round,pad=0.05',
      facecolor=colors['stack'], edgecolor='grey'))
  ax.text(ex - 1.95, 4.3, f'N = {cfg.num_encoder_layers}\nEncoderLayer',
          ha='right', va='center', fontsize=8)
  ax.text(dx + 1.95, 5.3, f'N = {cfg.num_decoder_layers}\nDecoderLayer',
          ha='left', va='center', fontsize=8)
  # Encoder and decoder columns: input, embedding, then the sublayers.
  _column(ax, ex, w, h, colors, ('Inputs (source tokens)', None),
          'Embedder, sinusoidal_encoding',
          [(3.0, 'Multi-head self-attention', 'attn', 'MultiHeadAttention'),
           (3.8, 'Add & Norm', 'norm', 'Sublayer, layer_norm'),
           (4.6, 'Feed forward', 'ffn', 'feed_forward'),
           (5.4, 'Add & Norm', 'norm', 'Sublayer')])
  _column(ax, dx, w, h, colors, ('Outputs (shifted right)', 'shift_right'),
          'Embedder (shared weights)',
          [(3.0, 'Masked multi-head self-attention', 'attn',
            'causal_mask, padding_mask'),
           (3.8, 'Add & Norm', 'norm', 'Sublayer'),
           (4.6, 'Multi-head cross-attention', 'attn',
            'Q: decoder, K,V: encoder'),
           (5.4, 'Add & Norm', 'norm', 'Sublayer'),
           (6.2, 'Feed forward', 'ffn', 'feed_forward'),
           (7.0, 'Add & Norm', 'norm', 'Sublayer')])
  # Encoder output -> every decoder layer's cross-attention (K and V).
  ax.plot([ex, ex], [5.65, 6.6], color='black', lw=0.9)
  ax.plot([ex, 4.85], [6.6, 6.6], color='black', lw=0.9)
  ax.plot([4.85, 4.85], [6.6, 4.6], color='black', lw=0.9)
  _arrow(ax, 4.85, 4.6, dx - w / 2, 4.6)
  ax.text(4.95, 6.72, 'encoder output: keys and values', fontsize=7)
  # Output.
  _box(ax, dx, 8.6, w, 0.6, 'Linear (shared embedding) + softmax',
       colors['out'], sub='Embedder.attend')
  _box(ax, dx, 9.6, w, h, 'Output probabilities', 'white')
  _arrow(ax, dx, 7.25, dx, 8.3)
  _arrow(ax, dx, 8.9, dx, 9.35)
  ax.text(5, 11.2, 'The encoder-decoder Transformer (Vaswani et al., 2017, '
          'figure 1)', ha='center', fontsize=11, weight='bold')
  ax.text(5, 10.7, f'd_model = {cfg.d_model}, heads = {cfg.num_heads}, '
          f'd_k = {cfg.d_model // cfg.num_heads}, d_ff = {cfg.d_ff}, '
          f"{cfg.norm_position}-LN, positions: {cfg.positional}",
          ha='center', fontsize=9)
  ax.text(ex, 7.8, 'Attention(Q, K, V) =\nsoftmax(Q K^T / sqrt(d_k)) V\n'
          'attention.dot_product_attention', ha='center', fontsize=8,
          family='monospace', bbox=dict(facecolor='white', edgecolor='grey'))
  return ax
