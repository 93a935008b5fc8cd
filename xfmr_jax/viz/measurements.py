"""Pictures that are measurements of this code: attention scores with and
without the 1/sqrt(d_k) scale, permutation equivariance with and without
positions, and attention's time and memory against sequence length (the
complexity comparison of self-attention with recurrent and convolutional
layers, section 4 of the paper)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from xfmr_jax import attention
from xfmr_jax.config import ModelConfig
from xfmr_jax.encoder_decoder import Transformer
from xfmr_jax.viz.figure import axes_or_new, plt


def score_histograms(d_ks=(4, 64, 1024), queries: int = 64, keys: int = 64,
                     seed: int = 0, axes=None):
  """The sqrt(d_k) argument, measured (paper section 3.2.1).

  With unit-variance independent components, ``q . k`` has variance ``d_k``;
  dividing by sqrt(d_k) brings it back to 1. Left: score histograms without
  scaling; middle: with it; right: the largest softmax weight per query from
  :func:`xfmr_jax.attention.attention_weights` (near 1 = saturated, one-hot).

  Returns:
    ``(axes, stats)``; stats maps ``d_k`` to the measured score variances and
    mean largest weight, unscaled and scaled.
  """
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
  ax = axes_or_new(ax)
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
  """Measure attention's cost against sequence length on this backend (the
  O(n^2 d) per layer of self-attention in the paper's table 1).

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
