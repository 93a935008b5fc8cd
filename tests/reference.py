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
