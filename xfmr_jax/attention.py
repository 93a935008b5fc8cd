"""Scaled dot-product attention and head split/merge (paper sections 3.2.1-3.2.2).

Queries and outputs use the ``[batch, length, heads, head_dim]`` layout; keys
and values use it too (``kv_layout='bkhd'``) or, as a decoding cache keeps
them, ``[batch, heads, length, head_dim]`` (``'bhkd'``). Masks follow
:mod:`xfmr_jax.masks`: boolean, broadcastable to ``[batch, heads, q, k]``,
``True`` = may attend. Keys and values may have fewer heads than queries
(grouped-query attention): query head ``i`` reads key/value head
``i // (heads / kv_heads)``.

:func:`dot_product_attention` has several implementations with the same
meaning: the library's own einsum path ('reference', the only one that can
return the weights or drop them out), ``jax.nn.dot_product_attention`` ('xla';
'cudnn', its fused flash kernel on NVIDIA GPUs) and on TPU the Pallas flash
attention kernel jax ships ('pallas'). :func:`resolve_implementation` picks one
for 'auto'.
"""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from xfmr_jax import masks
from xfmr_jax.config import ATTENTION_IMPLEMENTATIONS as IMPLEMENTATIONS
from xfmr_jax.dropout import dropout


def split_heads(x: jnp.ndarray, num_heads: int) -> jnp.ndarray:
  """``[batch, length, heads * head_dim] -> [batch, length, heads, head_dim]``."""
  *lead, width = x.shape
  if width % num_heads:
    raise ValueError(f'width {width} is not divisible by {num_heads} heads')
  return x.reshape(*lead, num_heads, width // num_heads)


def merge_heads(x: jnp.ndarray) -> jnp.ndarray:
  """``[batch, length, heads, head_dim] -> [batch, length, heads * head_dim]``."""
  return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def repeat_kv_heads(x: jnp.ndarray, num_heads: int,
                    kv_layout: str = 'bkhd') -> jnp.ndarray:
  """``[batch, k, kv_heads, d] -> [batch, k, num_heads, d]`` (or the same in
  the ``'bhkd'`` layout), each KV head repeated for the ``num_heads /
  kv_heads`` query heads of its group."""
  axis = _head_axis(kv_layout)
  kv_heads = x.shape[axis]
  if num_heads % kv_heads:
    raise ValueError(f'{num_heads} query heads cannot share {kv_heads} key/'
                     'value heads evenly')
  return x if kv_heads == num_heads else jnp.repeat(x, num_heads // kv_heads,
                                                    axis=axis)


KV_LAYOUTS = ('bkhd', 'bhkd')


def _head_axis(kv_layout: str) -> int:
  if kv_layout not in KV_LAYOUTS:
    raise ValueError(f'kv_layout must be one of {KV_LAYOUTS}, got '
                     f'{kv_layout!r}')
  return 2 if kv_layout == 'bkhd' else 1


# Up to this many queries over 'bhkd' keys (a decoding step's beams, grouped
# by sentence), the attention is laid out keys first (see
# _few_query_attention); 0: never.
FEW_QUERIES = 8


def _scores(query, key, kv_layout):
  """``[batch, heads, q, k]`` float32 dot products of queries and keys."""
  spec = 'bqhd,bkhd->bhqk' if kv_layout == 'bkhd' else 'bqhd,bhkd->bhqk'
  return jnp.einsum(spec, query, key, preferred_element_type=jnp.float32)


def _four_d(x):
  """A mask or bias broadcastable to ``[batch, heads, q, k]``, as rank 4."""
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _few_query_attention(query, key, value, mask, bias, dropout_rate,
                         dropout_rng):
  """:func:`dot_product_attention` ('reference', 'bhkd' keys) for a few
  queries, with the scores laid out ``[batch, heads, k, q]``.

  XLA's CPU backend runs ``Q K^T`` for a few queries as many tiny matmuls of
  a few rows, which stream a large cache at a fraction of memory speed; as
  ``K Q^T`` (a few columns), with the softmax over the key axis of that
  layout, it streams the cache much faster (measured in
  ``docs/benchmarks.md``, "What made beam search faster"); the values are
  weighted and summed without a matmul (below).

  Returns ``(out [batch, q, heads, head_dim_v], weights [batch, heads, q,
  k])``.
  """
  heads = query.shape[-2]
  key = repeat_kv_heads(key, heads, 'bhkd')
  value = repeat_kv_heads(value, heads, 'bhkd')
  query = query / jnp.sqrt(jnp.asarray(query.shape[-1], query.dtype))
  scores = jnp.einsum('bhkd,bqhd->bhkq', key, query,
                      preferred_element_type=jnp.float32)
  keys_first = lambda x: None if x is None else jnp.swapaxes(_four_d(x), 2, 3)
  weights = _masked_softmax(scores, keys_first(mask), keys_first(bias), axis=2)
  probs = weights
  if dropout_rate > 0.0 and dropout_rng is not None:
    # Dropped out as [batch, heads, q, k]: the mask the other form draws.
    probs = keys_first(dropout(keys_first(weights), dropout_rate,
                               dropout_rng))
  # The values as a broadcast product summed over the keys rather than as a
  # matmul of a few columns: XLA's CPU backend streams a large cache faster
  # so (a small cache, as the toy model's, runs a little slower; the
  # measurements are in docs/benchmarks.md).
  # Heads-first out, then transposed, as the matmul's was (written as
  # [batch, q, heads, d] its output alone was a slower layout).
  out = jnp.sum(probs.astype(value.dtype)[..., None] * value[:, :, :, None],
                axis=2)
  return out.transpose(0, 2, 1, 3), keys_first(weights)


# A decoding cache is read up to a bound that is a multiple of its chunk:
# at most CACHE_BOUNDS bounds (each a branch of the compiled step), chunks of
# at least MIN_CACHE_CHUNK slots. A cache whose chunk of keys is under
# MIN_CHUNK_BYTES is read whole: choosing a branch costs more than reading
# it (the benchmark's toy and small models decode slower with branches, a
# Marian batch faster: docs/benchmarks.md, "A large cache read only up to
# its filled slots").
# Only on CPU, where it was measured: XLA's GPU runtime picks a branch by
# reading its index back to the host, a wait per layer and step, so other
# backends read the whole cache.
CACHE_BOUNDS = 8
MIN_CACHE_CHUNK = 16
MIN_CHUNK_BYTES = 1 << 20
FILLED_CACHE_BACKENDS = ('cpu',)


def _first_slots(x, axis, parts, bound):
  """Each part's first ``bound`` slots along ``axis`` of ``x`` (``parts *
  slots`` long, or a broadcast 1), the parts merged again."""
  if x is None or x.shape[axis] == 1:
    return x
  axis %= x.ndim
  lead, rest = x.shape[:axis], x.shape[axis + 1:]
  x = x.reshape(lead + (parts, x.shape[axis] // parts) + rest)
  x = jax.lax.slice_in_dim(x, 0, bound, axis=axis + 1)
  return x.reshape(lead + (parts * bound,) + rest)


def filled_cache_attention(query, key, value, mask=None, bias=None, *,
                           filled, parts: int = 1):
  """:func:`dot_product_attention` ('reference', 'bhkd') over a decoding
  cache, reading only the slots written so far.

  A cache of ``slots`` slots per part keeps its keys in ``[batch, kv_heads,
  parts * slots, head_dim]``, the ``parts`` parts in turn (one, or a beam
  search's beams: :mod:`xfmr_jax.kv_cache`), and at a decoding step only
  the first ``filled`` slots of each part hold keys; ``mask`` (and so the
  result) must already hide the others. Streaming the empty slots costs as
  much as the filled ones, so each step reads each part's first ``bound``
  slots, ``bound`` the smallest multiple of the chunk (``slots /
  CACHE_BOUNDS``, at least ``MIN_CACHE_CHUNK``) not below ``filled``:
  shapes are static, so there is one branch per bound (``lax.switch``).
  Over 64 steps of a 64-slot cache this reads 40 slots a step on average.
  A small cache (a chunk under ``MIN_CHUNK_BYTES``), one of a size not
  known when traced, or one on a backend not in ``FILLED_CACHE_BACKENDS``
  is read whole.

  Args:
    query: ``[batch, q, heads, head_dim]``; key, value: ``[batch, kv_heads,
      parts * slots, head_dim]``.
    mask, bias: broadcastable to ``[batch, heads, q, parts * slots]``.
    filled: int or traced int32 scalar, ``1 <= filled <= slots``.
    parts: static.

  Returns:
    ``[batch, q, heads, head_dim]``, as :func:`dot_product_attention`.
  """
  slots = key.shape[2] // parts
  chunk = max(MIN_CACHE_CHUNK, -(-slots // CACHE_BOUNDS))
  bounds = list(range(chunk, slots, chunk)) + [slots]
  chunk_bytes = key.size // slots * chunk * key.dtype.itemsize
  # (symbolic under jax.export, where the batch is left open: read whole)
  if (not isinstance(chunk_bytes, int) or chunk_bytes < MIN_CHUNK_BYTES or
      jax.default_backend() not in FILLED_CACHE_BACKENDS):
    bounds = [slots]

  def attend(bound):
    def branch(query, key, value, mask, bias):
      cut = lambda x, axis: _first_slots(x, axis, parts, bound)
      return dot_product_attention(
          query, cut(key, 2), cut(value, 2), cut(mask, -1), cut(bias, -1),
          kv_layout='bhkd')
    return branch

  operands = (query, key, value, mask, bias)
  if len(bounds) == 1:
    return attend(slots)(*operands)
  if isinstance(filled, int):  # known when traced: its branch alone
    return attend(bounds[min(max(filled - 1, 0) // chunk,
                             len(bounds) - 1)])(*operands)
  index = jnp.clip((filled - 1) // chunk, 0, len(bounds) - 1)
  return jax.lax.switch(index, [attend(b) for b in bounds], *operands)


def attention_weights(query: jnp.ndarray, key: jnp.ndarray,
                      mask: jnp.ndarray | None = None,
                      bias: jnp.ndarray | None = None, *,
                      kv_layout: str = 'bkhd') -> jnp.ndarray:
  """``softmax(Q K^T / sqrt(d_k) + bias)`` with masked keys removed.

  Args:
    query: ``[batch, q_length, heads, head_dim]``.
    key: ``[batch, k_length, heads, head_dim]`` (``'bhkd'``: ``[batch, heads,
      k_length, head_dim]``).
    mask: boolean, broadcastable to ``[batch, heads, q_length, k_length]``.
    bias: additive float bias broadcastable to the same shape (e.g. ALiBi).

  Returns:
    float32 ``[batch, heads, q_length, k_length]``; rows sum to 1, except rows
    whose keys are all masked, which are all zero (never NaN).
  """
  key = repeat_kv_heads(key, query.shape[-2], kv_layout)
  d_k = query.shape[-1]
  # Dividing by sqrt(d_k) keeps the logits' variance near 1 whatever d_k is,
  # so the softmax does not saturate (section 3.2.1).
  query = query / jnp.sqrt(jnp.asarray(d_k, query.dtype))
  return _masked_softmax(_scores(query, key, kv_layout), mask, bias, axis=-1)


def _masked_softmax(scores, mask, bias, axis):
  """The softmax of ``scores + bias`` over the key ``axis``, masked keys
  removed; a query with no visible key (e.g. a padding query) would
  otherwise spread its weight uniformly over masked keys: it gets 0."""
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  if mask is None:
    return jax.nn.softmax(scores, axis=axis)
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=axis)
  return jnp.where(jnp.any(mask, axis=axis, keepdims=True), weights, 0.0)


def resolve_implementation(name: str, backend: str | None = None) -> str:
  """The implementation to use for ``name`` ('auto' or one of IMPLEMENTATIONS).

  'auto' is 'reference' on CPU (the einsum path the benchmark measures) and
  'xla' (``jax.nn.dot_product_attention``, jax's own default) on GPU and TPU.
  The hardware kernels, 'cudnn' and 'pallas', are chosen explicitly: they
  accept fewer shapes and dtypes, and ``experiments/gpu_check.sh`` compares
  them side by side first. An explicit choice the backend cannot run is an
  error, never a silent fallback. Decoding steps that read a KV cache use
  'reference' whatever the choice (:mod:`xfmr_jax.multi_head_attention`):
  its einsums read the heads-first cache without transposing it.
  """
  backend = backend or jax.default_backend()
  if name == 'auto':
    return 'reference' if backend == 'cpu' else 'xla'
  if name not in IMPLEMENTATIONS:
    raise ValueError(f'attention implementation {name!r} is not one of '
                     f"{('auto',) + IMPLEMENTATIONS}")
  if name == 'cudnn' and backend != 'gpu':
    raise ValueError(f"attention_impl='cudnn' needs an NVIDIA GPU; the jax "
                     f"backend here is {backend!r} (use 'auto' or 'xla')")
  if name == 'pallas' and (backend != 'tpu' or _pallas_flash() is None):
    raise ValueError(f"attention_impl='pallas' needs a TPU and jax's Pallas "
                     f"flash attention kernel; the backend is {backend!r} "
                     "(use 'auto' or 'xla')")
  return name


def _pallas_flash():
  """jax's Pallas TPU flash attention function, or None if not shipped."""
  try:
    from jax.experimental.pallas.ops.tpu import flash_attention
  except ImportError:
    return None
  return getattr(flash_attention, 'flash_attention', None)


def _pallas_self_attention(query, key, value, self_mask: masks.SelfMask):
  """Self-attention through the Pallas kernel's own segment ids and causal
  flag, so no ``[n, n]`` bias is formed (the kernel's memory stays O(n))."""
  segment_ids = importlib.import_module(
      'jax.experimental.pallas.ops.tpu.flash_attention').SegmentIds
  heads = query.shape[-2]
  to_bhld = lambda x: repeat_kv_heads(x, heads).transpose(0, 2, 1, 3)
  seg = self_mask.segments.astype(jnp.int32)
  scaled = query * jnp.asarray(query.shape[-1] ** -0.5, query.dtype)
  out = _pallas_flash()(to_bhld(scaled), to_bhld(key), to_bhld(value),
                        segment_ids=segment_ids(seg, seg),
                        causal=self_mask.causal, sm_scale=1.0)
  # The kernel lets padding (segment 0) attend to padding; zero those rows.
  return jnp.where((seg > 0)[:, :, None, None], out.transpose(0, 2, 1, 3), 0)


def _fused(query, key, value, mask, bias, implementation, local_window=None):
  """The same attention through jax's fused paths (no weights returned)."""
  mask4 = None if mask is None else jnp.broadcast_to(
      mask, (mask.shape[0], mask.shape[1], query.shape[1], key.shape[1]))
  if implementation == 'pallas':
    if local_window is not None:
      raise ValueError("the Pallas kernel has no local window; use 'xla'")
    # The kernel takes [batch, heads, length, d] and one additive bias; a
    # boolean mask becomes a large negative bias.
    heads = query.shape[-2]
    to_bhld = lambda x: repeat_kv_heads(x, heads).transpose(0, 2, 1, 3)
    total = None if bias is None else bias.astype(jnp.float32)
    if mask4 is not None:
      blocked = jnp.where(mask4, 0.0, jnp.finfo(jnp.float32).min / 2)
      total = blocked if total is None else total + blocked
    if total is not None:
      total = jnp.broadcast_to(total, (query.shape[0], heads, query.shape[1],
                                       key.shape[1]))
    # The kernel adds ``ab`` before it multiplies by ``sm_scale``; scaling
    # the queries here instead leaves the bias unscaled, as in the reference.
    scaled = query * jnp.asarray(query.shape[-1] ** -0.5, query.dtype)
    out = _pallas_flash()(to_bhld(scaled), to_bhld(key), to_bhld(value),
                          ab=total, sm_scale=1.0)
    return out.transpose(0, 2, 1, 3)
  return jax.nn.dot_product_attention(
      query, key, value, bias=None if bias is None else bias.astype(
          query.dtype), mask=mask4, implementation=implementation,
      local_window_size=local_window)


def dot_product_attention(query: jnp.ndarray, key: jnp.ndarray,
                          value: jnp.ndarray,
                          mask: jnp.ndarray | None = None,
                          bias: jnp.ndarray | None = None,
                          *,
                          dropout_rate: float = 0.0,
                          dropout_rng: jax.Array | None = None,
                          return_weights: bool = False,
                          implementation: str = 'reference',
                          local_window: tuple[int, int] | None = None,
                          kv_layout: str = 'bkhd'):
  """``Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V`` (equation 1).

  Args:
    query: ``[batch, q_length, heads, head_dim]``.
    key: ``[batch, k_length, kv_heads, head_dim]``; kv_heads divides heads.
    value: ``[batch, k_length, kv_heads, head_dim_v]``.
    mask, bias: see :func:`attention_weights`; ``mask`` may also be a
      :class:`~xfmr_jax.masks.SelfMask`, which the Pallas kernel takes as
      segment ids (with no bias) and the others expand.
    dropout_rate: dropout on the attention weights (needs ``dropout_rng``).
    return_weights: also return the ``[batch, heads, q, k]`` weights.
    implementation: one of IMPLEMENTATIONS ('auto' goes through
      :func:`resolve_implementation`); only 'reference' returns or drops out
      weights.
    local_window: ``(before, after)``: query i sees only keys ``i - before ..
      i + after``, in the fused implementations ('xla', 'cudnn'; the
      blockwise form is :mod:`xfmr_jax.local_attention`).
    kv_layout: 'bkhd' (the layout above) or 'bhkd' (``key``, ``value``
      ``[batch, kv_heads, k_length, head_dim]``, a decoding cache's layout).

  Returns:
    ``[batch, q_length, heads, head_dim_v]`` in ``query.dtype`` (and the
    weights). Queries with no visible key get 0 in every implementation.
  """
  if implementation != 'reference':
    implementation = resolve_implementation(implementation)  # or a clear error
    if return_weights or (dropout_rate > 0.0 and dropout_rng is not None):
      raise ValueError(f'implementation {implementation!r} neither returns '
                       "nor drops out attention weights; use 'reference'")
    if _head_axis(kv_layout) == 1:  # the fused kernels take 'bkhd'
      key, value = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
  if isinstance(mask, masks.SelfMask):
    if implementation == 'pallas' and bias is None and local_window is None:
      return _pallas_self_attention(query, key, value,
                                    mask).astype(query.dtype)
    mask = mask.dense()
  if implementation != 'reference':
    out = _fused(query, key, value, mask, bias, implementation, local_window)
    if mask is not None:  # fused kernels average a fully masked row instead
      visible = jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]
      out = jnp.where(visible, out, 0)
    return out.astype(query.dtype)
  if local_window is not None:
    raise ValueError("local_window needs a fused implementation ('xla' or "
                     "'cudnn'); 'reference' is xfmr_jax.local_attention")
  if kv_layout == 'bhkd' and 1 < query.shape[1] <= FEW_QUERIES:
    out, weights = _few_query_attention(query, key, value, mask, bias,
                                        dropout_rate, dropout_rng)
    return (out, weights) if return_weights else out
  weights = attention_weights(query, key, mask, bias, kv_layout=kv_layout)
  probs = weights
  if dropout_rate > 0.0 and dropout_rng is not None:
    probs = dropout(probs, dropout_rate, dropout_rng)
  value = repeat_kv_heads(value, query.shape[-2], kv_layout)
  spec = 'bhqk,bkhd->bqhd' if kv_layout == 'bkhd' else 'bhqk,bhkd->bqhd'
  out = jnp.einsum(spec, probs.astype(value.dtype), value)
  return (out, weights) if return_weights else out
