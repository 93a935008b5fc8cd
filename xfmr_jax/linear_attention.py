"""Linear (kernelised) attention: ``softmax(Q K^T) V ~ phi(Q) (phi(K)^T V)``.

With a positive feature map phi, query i's output is
``phi(q_i) S / phi(q_i) z`` where ``S = sum_j phi(k_j) v_j^T`` and
``z = sum_j phi(k_j)`` run over the keys it sees: O(n) time and memory instead
of O(n^2) (Katharopoulos et al., 2020). Two feature maps:

* ``'elu'``: ``phi(x) = elu(x) + 1`` (Katharopoulos et al.);
* ``'favor'``: Performer's positive orthogonal random features (FAVOR+,
  Choromanski et al., 2021), ``phi(x) = exp(w_r . x - |x|^2 / 2) / sqrt(m)``
  for ``x = q / d^(1/4)``, so that ``E[phi(q) . phi(k)] = exp(q . k /
  sqrt(d))``: an unbiased estimate of the softmax kernel. The ``m``
  projections ``w_r`` come from a key (:func:`favor_projection`); drawing them
  again with another key redraws the features.

The sums run chunk by chunk (:func:`linear_attention`): inside a chunk of
``chunk`` slots the masked ``c x c`` products are formed directly, and a scan
over chunks carries ``(S, z)`` of the segment in progress, so packed segments
and padding are respected (segments must be contiguous runs, as packing makes
them) and memory stays O(n * chunk). Causal attention uses the carry from the
left; bidirectional adds the one from the right. Cached decoding keeps only
``(S, z)`` per key/value head: O(1) memory per generated token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64


# ------------------------------------------------------------ feature maps --

def elu_features(x):
  """``elu(x) + 1 > 0``, elementwise: ``[..., d] -> [..., d]``."""
  return jax.nn.elu(x.astype(jnp.float32)) + 1.0


def favor_projection(key, num_features: int, dim: int) -> jnp.ndarray:
  """Orthogonal random features ``[num_features, dim]``.

  Blocks of ``dim`` mutually orthogonal directions (QR of a Gaussian matrix),
  each row rescaled to the norm of a Gaussian vector, so every row is still
  ``N(0, I)``-distributed but rows in a block are orthogonal, which lowers
  the estimator's variance.
  """
  blocks = -(-num_features // dim)
  keys = jax.random.split(key, blocks + 1)
  rows = [jnp.linalg.qr(jax.random.normal(k, (dim, dim)))[0].T
          for k in keys[:blocks]]
  norms = jnp.linalg.norm(jax.random.normal(keys[-1], (num_features, dim)),
                          axis=-1)
  return jnp.concatenate(rows)[:num_features] * norms[:, None]


def favor_features(x, projection, *, is_query: bool):
  """FAVOR+ positive features ``[..., d] -> [..., m]`` (see the module).

  A query's features are divided by their own largest term, which cancels
  in ``phi(q) S / phi(q) z`` and keeps them from underflowing. Keys get no
  such data-dependent shift (it would have to be the same for every key a
  query sees, also while decoding); their exponent ``w . x - |x|^2 / 2`` is
  at most ``|w|^2 / 2`` whatever x is, so they cannot overflow.
  """
  x = x.astype(jnp.float32) * x.shape[-1] ** -0.25
  proj = jnp.einsum('...d,md->...m', x, projection)
  logits = proj - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)
  if is_query:
    logits = logits - jax.lax.stop_gradient(
        jnp.max(proj, axis=-1, keepdims=True))
  return jnp.exp(logits) * projection.shape[0] ** -0.5


# --------------------------------------------------------------- attention --

def _carry_in(kf, v, seg, init):
  """The ``(S, z, segment)`` each chunk starts from, carried from the left.

  Args:
    kf: ``[b, nc, c, g, m]`` key features; v ``[b, nc, c, g, e]``;
    seg: ``[b, nc, c]`` segment ids; init: ``(S [b, g, m, e], z [b, g, m],
    segment [b])`` before the first chunk.

  Returns:
    per chunk ``(S [nc, b, g, m, e], z [nc, b, g, m], segment [nc, b])`` and
    the state after the last chunk. Only keys of the segment a chunk ends in
    are carried out of it.
  """
  c = seg.shape[-1]
  last = jnp.max(jnp.where(seg > 0, jnp.arange(c), -1), axis=-1)  # [b, nc]
  has_real = last >= 0
  seg_last = jnp.take_along_axis(seg, jnp.maximum(last, 0)[..., None],
                                 axis=-1)[..., 0]
  keep = (seg == seg_last[..., None]) & (seg > 0)
  kf_kept = kf * keep[..., None, None]
  s_chunk = jnp.einsum('bncgm,bncge->bngme', kf_kept, v)
  z_chunk = kf_kept.sum(axis=2)

  def step(carry, xs):
    s, z, sid = carry
    s_c, z_c, seg_c, real_c = xs
    cont = (seg_c == sid)[:, None, None]
    new_s = jnp.where(real_c[:, None, None, None],
                      jnp.where(cont[..., None], s, 0) + s_c, s)
    new_z = jnp.where(real_c[:, None, None], jnp.where(cont, z, 0) + z_c, z)
    return (new_s, new_z, jnp.where(real_c, seg_c, sid)), (s, z, sid)

  xs = tuple(jnp.moveaxis(a, 1, 0) for a in (s_chunk, z_chunk, seg_last,
                                              has_real))
  final, per_chunk = jax.lax.scan(step, init, xs)
  return per_chunk, final


def linear_attention(qf, kf, v, segments, *, causal: bool,
                     chunk: int = CHUNK, state=None):
  """``phi(Q) (phi(K)^T V)``, normalised, within segments.

  Args:
    qf: ``[batch, n, heads, m]`` query features (positive).
    kf: ``[batch, n, kv_heads, m]`` key features; query head h reads key/value
      head ``h // (heads / kv_heads)``.
    v: ``[batch, n, kv_heads, e]`` values.
    segments: ``[batch, n]`` contiguous segment ids (0 = padding).
    causal: query i sees keys ``j <= i`` only.
    chunk: slots per chunk (memory O(n * chunk)).
    state: causal only: ``(S [batch, kv_heads, m, e], z [batch, kv_heads, m])``
      of keys before slot 0, seen by the queries of segment 1 (decoding).

  Returns:
    float32 ``[batch, n, heads, e]`` (0 for queries that see no key) and,
    when causal, the state ``(S, z)`` of the last segment after slot n - 1.
  """
  b, n, h, m = qf.shape
  g, e = kf.shape[2], v.shape[-1]
  c = max(1, min(chunk, n))
  padded = -(-n // c) * c
  nc = padded // c
  pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - n)] +
                          [(0, 0)] * (x.ndim - 2))
  blocks = lambda x: pad(x).reshape(b, nc, c, *x.shape[2:])
  qb = blocks(qf.astype(jnp.float32)).reshape(b, nc, c, g, h // g, m)
  kb, vb = blocks(kf.astype(jnp.float32)), blocks(v.astype(jnp.float32))
  seg = blocks(segments)
  # Inside a chunk: the masked c x c products, as in softmax attention.
  same = (seg[..., :, None] == seg[..., None, :]) & (seg > 0)[..., :, None]
  if causal:
    same = same & jnp.tri(c, dtype=bool)
  scores = jnp.einsum('bnigrm,bnjgm->bngrij', qb, kb) * same[:, :, None, None]
  num = jnp.einsum('bngrij,bnjge->bnigre', scores, vb)
  den = jnp.einsum('bngrij->bnigr', scores)

  def add_carry(num, den, carried, seg):
    s, z, sid = carried  # [nc, b, ...]
    use = (seg == jnp.moveaxis(sid, 0, 1)[..., None]) & (seg > 0)
    use = use[..., None, None]
    num = num + use[..., None] * jnp.einsum('bnigrm,nbgme->bnigre', qb, s)
    return num, den + use * jnp.einsum('bnigrm,nbgm->bnigr', qb, z)

  zeros = (jnp.zeros((b, g, m, e)), jnp.zeros((b, g, m)),
           jnp.zeros((b,), segments.dtype))
  init = zeros if state is None else (state[0].astype(jnp.float32),
                                      state[1].astype(jnp.float32),
                                      jnp.ones((b,), segments.dtype))
  carried, final = _carry_in(kb, vb, seg, init)
  num, den = add_carry(num, den, carried, seg)
  if not causal:  # the keys to the right: the same carry on the reversed row
    flip = lambda x: x[:, ::-1, ::-1]
    carried, _ = _carry_in(flip(kb), flip(vb), flip(seg), zeros)
    carried = tuple(x[::-1] for x in carried)  # back to chunk order
    num, den = add_carry(num, den, carried, seg)
  out = num / jnp.where(den > 0, den, 1.0)[..., None]
  out = out.reshape(b, padded, h, e)[:, :n]
  return (out, final[:2]) if causal else out


def init_state(batch: int, kv_heads: int, num_features: int, head_dim: int):
  """The empty decoding state ``(S [batch, kv_heads, m, e], z [batch,
  kv_heads, m])``."""
  return (jnp.zeros((batch, kv_heads, num_features, head_dim), jnp.float32),
          jnp.zeros((batch, kv_heads, num_features), jnp.float32))
