"""Independent float64 NumPy references for the numerics tests."""
import numpy as np


def attention(q, k, v, mask=None):
  """q ``[b, q, h, d]``, k/v ``[b, k, h, d]``, mask ``[b|1, h|1, q, k]``."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  scores = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(q.shape[-1])
  if mask is not None:
    scores = np.where(mask, scores, -np.inf)
  scores = scores - scores.max(-1, keepdims=True)
  w = np.exp(scores)
  w = w / w.sum(-1, keepdims=True)
  return np.einsum('bhqk,bkhd->bqhd', w, v)


def layer_norm(x, scale, bias, eps=1e-6):
  x = np.asarray(x, np.float64)
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * scale + bias


def sinusoid(positions, d_model):
  """The paper's formula, written out element by element."""
  pe = np.zeros((len(positions), d_model))
  for row, pos in enumerate(positions):
    for i in range(d_model // 2):
      pe[row, 2 * i] = np.sin(pos / 10000 ** (2 * i / d_model))
      pe[row, 2 * i + 1] = np.cos(pos / 10000 ** (2 * i / d_model))
  return pe


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def masked_attention(q, k, v, mask, bias=None):
  """:func:`attention` with rows that see no key set to 0 (not NaN).
  k/v may have fewer heads than q (each serves a group of query heads);
  ``bias`` (broadcastable to ``[b, h, q, k]``) is added to the scores."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  mask = np.broadcast_to(mask, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
  scores = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(q.shape[-1])
  if bias is not None:
    scores = scores + np.asarray(bias, np.float64)
  scores = np.where(mask, scores, -np.inf)
  top = np.max(scores, -1, keepdims=True)
  w = np.where(mask, np.exp(scores - np.where(np.isfinite(top), top, 0)), 0)
  w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)
  return np.einsum('bhqk,bkhd->bqhd', w, v)


def local_mask(segments, window, causal, global_tokens=0):
  """``[b, 1, n, n]``: the sliding-window rule written out pair by pair."""
  b, n = segments.shape
  out = np.zeros((b, 1, n, n), bool)
  for r in range(b):
    for i in range(n):
      for j in range(n):
        if segments[r, i] == 0 or segments[r, i] != segments[r, j]:
          continue
        if causal and j > i:
          continue
        out[r, 0, i, j] = (abs(i - j) <= window or i < global_tokens or
                           j < global_tokens)
  return out


def segment_mask(segments, causal):
  """``[b, 1, n, n]``: same nonzero segment (and j <= i when causal)."""
  s = np.asarray(segments)
  m = (s[:, :, None] == s[:, None, :]) & (s[:, :, None] > 0)
  if causal:
    m &= np.tri(s.shape[1], dtype=bool)
  return m[:, None]


def linear_attention(qf, kf, v, mask):
  """``phi(q_i) sum_j phi(k_j) v_j / phi(q_i) sum_j phi(k_j)`` over the keys
  ``mask`` ``[b, 1, q, k]`` allows, from features; 0 where none."""
  qf, kf, v = (np.asarray(a, np.float64) for a in (qf, kf, v))
  group = qf.shape[2] // kf.shape[2]
  kf, v = np.repeat(kf, group, axis=2), np.repeat(v, group, axis=2)
  a = np.einsum('bqhm,bkhm->bhqk', qf, kf) * mask
  den = a.sum(-1, keepdims=True)
  return np.einsum('bhqk,bkhd->bqhd', a / np.where(den > 0, den, 1), v)


def elu_plus_one(x):
  x = np.asarray(x, np.float64)
  return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def favor(x, w, is_query):
  """Performer's positive random features of ``x`` ``[..., d]`` for rows
  ``w`` ``[m, d]``: ``exp(w.x' - |x'|^2 / 2) / sqrt(m)``, ``x' = x / d^(1/4)``.
  The per-query shift of the library cancels in the ratio, so none here."""
  del is_query
  x = np.asarray(x, np.float64) / x.shape[-1] ** 0.25
  return np.exp(x @ np.asarray(w, np.float64).T -
                0.5 * (x ** 2).sum(-1, keepdims=True)) / np.sqrt(w.shape[0])
