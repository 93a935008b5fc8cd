"""The yardstick's decoding: google/flax ``examples/wmt``'s beam search.

The algorithm and the work per step of the example's ``decode.beam_search``
and ``train.predict_step`` (see :mod:`experiments.benchmark.flax_wmt` for the
model and the differences in ids). Shapes: ``b`` sentences, ``k`` beams,
``L = max_decode_len + 1`` buffer slots (slot 0 holds the start symbol).

Per step the decoder runs one token for all ``b * k`` rows against the
``[b * k, s, d]`` tiled encoder output (cross-attention projects its keys and
values from it again), then: log-probs plus the live prefix log-probs, the
top ``2k`` of the ``k x vocab`` candidates, the live top ``k`` of those not
ending in EOS, the whole cache gathered by (batch, beam) for them, and the
finished set merged with the newly finished candidates by penalised score.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from experiments.benchmark.flax_wmt import (NEG_INF, Seq2Seq, WmtConfig,
                                            init_params)
from xfmr_jax.token_ids import EOS, PAD


def brevity_penalty(length, alpha):
  """``((5 + length) / 6) ** alpha``."""
  return jnp.power((5.0 + length) / 6.0, alpha)


def _add_beams(x, k):
  """``[b, ...] -> [b, k, ...]`` copies; scalars (cache indices) unchanged."""
  if x.ndim == 0:
    return x
  return jnp.tile(x[:, None], (1, k) + (1,) * (x.ndim - 1))


def _merge(x):
  """``[b, k, ...] -> [b * k, ...]``; scalars unchanged."""
  return x if x.ndim == 0 else x.reshape((-1,) + x.shape[2:])


def _split(x, b, k):
  """``[b * k, ...] -> [b, k, ...]``; scalars unchanged."""
  return x if x.ndim == 0 else x.reshape((b, k) + x.shape[1:])


def tile_rows(x, k):
  """``[b, ...] -> [b * k, ...]``, each row repeated k times in place."""
  return _merge(_add_beams(x, k))


def gather(tree, beams, b, k):
  """Every non-scalar leaf ``[b, old_k, ...] -> [b, k, ...]`` at ``beams``
  ``[b, k]`` (indices into old_k)."""
  rows = jnp.arange(b * k).reshape(b, k) // k
  return jax.tree.map(lambda x: x if x.ndim == 0 else x[rows, beams], tree)


def gather_best(tree, scores, b, k):
  """The k best of ``scores [b, old_k]``, in increasing order (best last)."""
  _, top = jax.lax.top_k(scores, k)
  return gather(tree, jnp.flip(top, axis=1), b, k)


def beam_search(cache, token_logits, *, batch, beam_size, slots, alpha=0.6):
  """Args: ``cache`` of b rows; ``token_logits(ids [b*k, 1], cache) ->
  (logits [b*k, vocab], cache)``. Returns ``seqs [b, k, slots]`` (slot 0
  the start symbol) and ``scores [b, k]``, both with the best beam last."""
  b, k = batch, beam_size
  state = dict(
      index=jnp.array(0),
      live_logp=jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1)), (b, 1)),
      fin_scores=jnp.full((b, k), NEG_INF),
      live_seqs=jnp.zeros((b, k, slots), jnp.int32),
      fin_seqs=jnp.zeros((b, k, slots), jnp.int32),
      fin_flags=jnp.zeros((b, k), jnp.bool_),
      cache=jax.tree.map(lambda x: _add_beams(x, k), cache))

  def go_on(s):
    best_live = s['live_logp'][:, -1:] / brevity_penalty(slots, alpha)
    worst_fin = jnp.min(s['fin_scores'], axis=1, keepdims=True)
    worst_fin = jnp.where(s['fin_flags'], worst_fin, NEG_INF)
    return (s['index'] < slots - 1) & ~jnp.all(worst_fin > best_live)

  def step(s):
    i = s['index']
    ids = _merge(jax.lax.dynamic_slice(s['live_seqs'], (0, 0, i), (b, k, 1)))
    logits, cache = token_logits(ids, jax.tree.map(_merge, s['cache']))
    cache = jax.tree.map(lambda x: _split(x, b, k), cache)
    logp = jax.nn.log_softmax(_split(logits, b, k)) + s['live_logp'][..., None]
    vocab = logp.shape[-1]
    top_logp, top = jax.lax.top_k(logp.reshape(b, k * vocab), 2 * k)
    parents = top // vocab
    seqs = gather(s['live_seqs'], parents, b, 2 * k)
    seqs = jax.lax.dynamic_update_slice(seqs, (top % vocab)[..., None],
                                        (0, 0, i + 1))
    ended = seqs[:, :, i + 1] == EOS
    # Live: the k best candidates that did not just end; their caches.
    live_logp = top_logp + ended * NEG_INF
    _, keep = jax.lax.top_k(live_logp, k)
    keep = jnp.flip(keep, axis=1)
    live_seqs, live_logp = gather([seqs, live_logp], keep, b, k)
    cache = gather(cache, gather(parents, keep, b, k), b, k)
    # Finished: merge the newly ended candidates, keep the k best.
    scores = top_logp / brevity_penalty(i + 1, alpha) + ~ended * NEG_INF
    fin_seqs, fin_scores, fin_flags = gather_best(
        [jnp.concatenate([s['fin_seqs'], seqs], 1),
         jnp.concatenate([s['fin_scores'], scores], 1),
         jnp.concatenate([s['fin_flags'], ended], 1)],
        jnp.concatenate([s['fin_scores'], scores], 1), b, k)
    return dict(index=i + 1, live_logp=live_logp, fin_scores=fin_scores,
                live_seqs=live_seqs, fin_seqs=fin_seqs, fin_flags=fin_flags,
                cache=cache)

  s = jax.lax.while_loop(go_on, step, state)
  # Rows with no finished beam fall back to their live beams.
  some = jnp.any(s['fin_flags'], axis=1)
  return (jnp.where(some[:, None, None], s['fin_seqs'], s['live_seqs']),
          jnp.where(some[:, None], s['fin_scores'], s['live_logp']))


def init_cache(cfg: WmtConfig, batch: int, source: int, slots: int):
  """The decoder's zero cache for ``batch`` rows and ``slots`` positions (the
  example builds it from ``init``; under jit all but the zeros is dropped)."""
  ones = lambda n: jnp.ones((batch, n), jnp.int32)
  return Seq2Seq(cfg).init(jax.random.key(0), ones(source), ones(slots))[
      'cache']


def token_logits_fn(cfg: WmtConfig, params, inputs, beam_size: int):
  """The example's ``tokens_ids_to_logits``: encodes ``inputs [b, s]`` once,
  tiles encoded output and inputs (for the mask) to ``b * k`` rows; returns
  ``(ids [b*k, 1], cache) -> (logits [b*k, vocab], cache)``."""
  model = Seq2Seq(cfg)
  encoded = tile_rows(model.apply({'params': params}, inputs,
                                  method=Seq2Seq.encode), beam_size)
  rows = tile_rows(inputs, beam_size)

  def token_logits(ids, cache):
    logits, new = model.apply({'params': params, 'cache': cache}, encoded,
                              rows, ids, mutable=['cache'],
                              method=Seq2Seq.decode)
    return logits[:, 0], new['cache']
  return token_logits


@functools.partial(jax.jit, static_argnames=('cfg', 'beam_size',
                                             'max_decode_len', 'alpha'))
def beam_decode(cfg: WmtConfig, params, inputs, *, beam_size=4,
                max_decode_len=64, alpha=0.6):
  """``inputs [b, s]`` -> ``(tokens [b, max_decode_len], scores [b])``: the
  best beam without its start slot (EOS included, 0 after it) and its score
  (``logp / brevity_penalty(len)`` if finished, else the raw log-prob)."""
  b, slots = inputs.shape[0], max_decode_len + 1
  # The table must cover the start slot too (the last slot is never read).
  cfg = dataclasses.replace(cfg, decode=True, deterministic=True,
                            max_len=max(cfg.max_len, slots))
  step = token_logits_fn(cfg, params, inputs, beam_size)

  def no_pad(ids, cache):   # the start symbol is never emitted
    logits, cache = step(ids, cache)
    return logits.at[:, PAD].set(-jnp.inf), cache

  seqs, scores = beam_search(init_cache(cfg, b, inputs.shape[1], slots), no_pad,
                             batch=b, beam_size=beam_size, slots=slots,
                             alpha=alpha)
  return seqs[:, -1, 1:], scores[:, -1]


def decode_params(cfg: WmtConfig, length: int, seed: int = 0):
  """Fresh parameters with the shared EOS embedding zeroed (its logit is then
  0, never among the best of a random model), as ``decode.decode_params``
  does for ours: every run emits ``max_decode_len`` tokens."""
  params = jax.tree.map(lambda x: x, init_params(cfg, length, seed))
  emb = params['shared_embedding']['embedding']
  params['shared_embedding']['embedding'] = emb.at[EOS].set(0.0)
  return params
