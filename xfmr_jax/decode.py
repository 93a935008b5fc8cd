"""Autoregressive decoding: greedy, beam search and sampling (paper section 6.1).

Each public function is one ``jax.jit``: the encoder runs once per batch and
fills the key/value cache (:meth:`Transformer.decode_step`, which also projects
the encoder output to cross-attention keys/values once), then one
``lax.while_loop`` runs one cached decoder step per token and stops when every
sequence has emitted EOS or the maximum length is reached. Greedy decoding and
sampling share one loop here; beam search is :mod:`xfmr_jax.beam_search`'s
loop, under GNMT's rules (:func:`beam_search`) or Hugging Face ``generate``'s
(:func:`xfmr_jax.hf_beam.beam_search`). The steps they are all made of (cache
set-up, one cached step, output length) are :mod:`xfmr_jax.decode_steps`.

Conventions: the decoder starts from the pad id 0 (as ``shift_right`` does in
training), EOS is id 1, outputs are ``[batch, max_decode_len]`` int32 with EOS
included where produced and 0 after it. The pad id is never emitted: in the
teacher-forced model a 0 target is padding (masked out), so emitting it would
make the cached decoder and the full model disagree.

Under a mesh (``with sharding.use(mesh, rules):`` around the call, or
:func:`xfmr_jax.sharding.jit_decode` for explicit shardings) the batch is
split over the mesh's data axes, the parameters stay as they are laid out, and
the outputs come back replicated, so every process can read them.

Sizes (``max_decode_len``, ``beam_size``, sampling settings) are static, so a
batch of a given padded shape compiles once; ``TRACE_COUNTS[name]`` counts the
traces (= compilations) of each function, cheaply, for callers that bucket.
"""
from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp

from xfmr_jax import beam_search as beam_lib
from xfmr_jax import decode_steps as steps
from xfmr_jax import repetition, target_prefix
from xfmr_jax import top_k as topk
from xfmr_jax.token_ids import EOS, PAD

# Kept importable from here, where callers have always found them.
# pylint: disable=unused-import
from xfmr_jax.beam_search import length_penalty  # noqa: F401
from xfmr_jax.decode_steps import (  # noqa: F401
    DECODE_EXTRA, decode_length, logsumexp)
# pylint: enable=unused-import

TRACE_COUNTS: collections.Counter = collections.Counter()


def _autoregress(batch, length, carry, next_logits, pick, prefix=None):
  """Shared loop of greedy decoding and sampling.

  Args:
    carry: loop state of ``next_logits`` (the cache).
    next_logits: ``(carry, out, t) -> (logits [batch, vocab], carry)`` for
      position t, given the tokens ``out [batch, length]`` emitted before t.
    pick: ``(logits [batch, vocab], out, t) -> tokens [batch]``.
    prefix: None, or ``[batch, p]`` target prefixes
      (:mod:`xfmr_jax.target_prefix`), emitted in place of ``pick``'s tokens.

  Returns:
    ``[batch, length]`` int32 tokens, 0 after EOS.
  """
  def cond(state):
    t, _, done, _ = state
    return (t < length) & ~jnp.all(done)

  def body(state):
    t, out, done, carry = state
    logits, carry = next_logits(carry, out, t)
    token = pick(steps.no_pad(logits), out, t)
    if prefix is not None:
      inside, prefix_token = target_prefix.forced(prefix, t)
      token = jnp.where(inside, prefix_token, token)
    token = jnp.where(done, PAD, token)
    return t + 1, out.at[:, t].set(token), done | (token == EOS), carry

  init = (0, jnp.zeros((batch, length), jnp.int32), jnp.zeros((batch,), bool),
          carry)
  return jax.lax.while_loop(cond, body, init)[1]


def _cached_loop(model, params, inputs, max_decode_len, pick, prefix):
  variables = steps.as_variables(params)
  inputs = steps.split_rows(inputs)
  if prefix is not None:
    prefix = steps.split_rows(prefix)
  length = steps.decode_length(model.config, inputs.shape[1], max_decode_len)
  cache = steps.init_cache(model, variables, inputs, length)
  next_logits = lambda cache, out, t: steps.step(model, variables, cache,
                                                 inputs, out, t, length)
  return steps.replicated(_autoregress(inputs.shape[0], length, cache,
                                       next_logits, pick, prefix))


def _argmax(logits, out, t):
  del out, t
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _after_repetition(pick, no_repeat_ngram_size, repetition_penalty):
  """``pick`` of the logits with :func:`xfmr_jax.repetition.process`
  applied (``pick`` itself at the defaults)."""
  if not no_repeat_ngram_size and repetition_penalty == 1.0:
    return pick

  def picked(logits, out, t):
    return pick(repetition.process(
        logits, out, t, no_repeat_ngram_size=no_repeat_ngram_size,
        repetition_penalty=repetition_penalty), out, t)
  return picked


# ------------------------------------------------------------------ greedy --

@functools.partial(jax.jit, static_argnames=(
    'model', 'max_decode_len', 'no_repeat_ngram_size', 'repetition_penalty'))
def greedy_decode(model, params, inputs, *, max_decode_len=None,
                  no_repeat_ngram_size=0, repetition_penalty=1.0,
                  prefix=None):
  """Greedy decoding with the KV cache.

  Args:
    model: a :class:`~xfmr_jax.model.SequenceModel` (static).
    params: its params (or ``{'params': ...}``).
    inputs: ``[batch, s]`` int32 source ids, 0-padded.
    max_decode_len: static; default ``s + 50`` capped by ``config.max_len``.
    no_repeat_ngram_size, repetition_penalty: static; anti-repetition
      (:mod:`xfmr_jax.repetition`; 0 and 1.0: off).
    prefix: None, or ``[batch, p]`` int32 target prefixes, 0-padded: each
      output starts with its prefix (:mod:`xfmr_jax.target_prefix`).

  Returns:
    int32 ``[batch, max_decode_len]`` tokens.
  """
  TRACE_COUNTS['greedy_decode'] += 1
  return _cached_loop(model, params, inputs, max_decode_len, _after_repetition(
      _argmax, no_repeat_ngram_size, repetition_penalty), prefix)


@functools.partial(jax.jit, static_argnames=('model', 'max_decode_len'))
def naive_greedy_decode(model, params, inputs, *, max_decode_len=None):
  """Reference greedy decoding without a cache: the full teacher-forced
  decoder runs over all ``max_decode_len`` positions at every step. Same
  arguments and result as :func:`greedy_decode`."""
  TRACE_COUNTS['naive_greedy_decode'] += 1
  variables = steps.as_variables(params)
  length = steps.decode_length(model.config, inputs.shape[1], max_decode_len)
  if model.config.model_kind == 'encoder_decoder':
    encoded = model.apply(variables, inputs, method=model.encode)
    run = lambda targets: model.apply(variables, encoded, inputs, targets,
                                      method=model.decode)
  else:  # decoder-only: the whole sequence, source included, every step
    encoded = None
    run = lambda targets: model.apply(variables, inputs, targets)

  def next_logits(encoded, out, t):
    # Targets up to t-1 are the emitted tokens; the one at t is unknown but
    # must be non-pad so its query is not masked; later ones are not seen.
    targets = jnp.where(jnp.arange(length) < t, out, EOS)
    return run(targets)[:, t], encoded

  return _autoregress(inputs.shape[0], length, encoded, next_logits, _argmax)


# ---------------------------------------------------------------- sampling --

def _filter_logits(logits, temperature, top_k, top_p):
  """Temperature, then keep the top-k tokens, then the top-p nucleus.

  logits: ``[batch, vocab]``; removed tokens get ``-inf``.
  """
  logits = logits / temperature
  if top_k:
    kth = topk.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token while the mass of the strictly better ones is < top_p, so
    # the most likely token always survives.
    keep = jnp.cumsum(probs, axis=-1) - probs < top_p
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1,
                     keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return logits


@functools.partial(jax.jit, static_argnames=(
    'model', 'temperature', 'top_k', 'top_p', 'max_decode_len',
    'no_repeat_ngram_size', 'repetition_penalty'))
def sample(model, params, inputs, rng, *, temperature=1.0, top_k=0,
           top_p=1.0, max_decode_len=None, no_repeat_ngram_size=0,
           repetition_penalty=1.0, prefix=None):
  """Ancestral sampling with the KV cache.

  Args:
    rng: PRNG key; the token at position t uses ``fold_in(rng, t)``, so a key
      reproduces its samples.
    temperature: static; 0 means greedy.
    top_k: static; sample among the k most likely tokens (0: all).
    top_p: static; sample in the smallest set of mass >= top_p (1: all).
    Other arguments and the result as in :func:`greedy_decode`; the
    anti-repetition rules act on the logits before the temperature.
  """
  TRACE_COUNTS['sample'] += 1
  if temperature == 0:
    pick = _argmax
  else:
    def pick(logits, out, t):
      del out
      logits = _filter_logits(logits, temperature, top_k, top_p)
      return jax.random.categorical(jax.random.fold_in(rng, t), logits,
                                    axis=-1).astype(jnp.int32)
  return _cached_loop(model, params, inputs, max_decode_len, _after_repetition(
      pick, no_repeat_ngram_size, repetition_penalty), prefix)


# ------------------------------------------------------------- beam search --

@functools.partial(jax.jit, static_argnames=(
    'model', 'beam_size', 'alpha', 'max_decode_len', 'compact',
    'num_hypotheses', 'no_repeat_ngram_size', 'repetition_penalty'))
def beam_search(model, params, inputs, *, beam_size=4, alpha=0.6,
                max_decode_len=None, compact=True, num_hypotheses=None,
                no_repeat_ngram_size=0, repetition_penalty=1.0, prefix=None,
                constraints=None, word_starts=None):
  """Beam search with the GNMT length penalty (paper: beam 4, alpha 0.6):
  :func:`xfmr_jax.beam_search.loop` under :class:`xfmr_jax.beam_search.GNMT`.

  Args:
    beam_size, alpha: static; alpha >= 0.
    compact: static; as in :func:`xfmr_jax.beam_search.search` (the tokens
      are the same either way).
    num_hypotheses: static; None, or ``n <= beam_size`` for the n best.
    Other arguments as in :func:`greedy_decode`; the anti-repetition rules
    act on each beam's logits before the log-softmax, and a prefix's tokens
    count in ``log p`` (:func:`xfmr_jax.target_prefix.force`).
    constraints: None, or ``[batch, C]`` terminology constraints
      (:mod:`xfmr_jax.constraints`): every finished hypothesis holds them;
      with ``word_starts`` (``[vocab]`` bool), with its last word whole.

  Returns:
    ``(tokens [batch, max_decode_len] int32, scores [batch] float32)``: the
    best finished hypothesis and its ``log p / length_penalty(len)`` (len
    counts the EOS). A row with no finished hypothesis falls back to its best
    unfinished one, scored at the full length. With ``num_hypotheses=n``:
    ``(tokens [batch, n, max_decode_len], scores [batch, n], log_probs
    [batch, n])``, the n best finished (then unfinished) hypotheses, best
    first, with their plain ``log p``; an empty slot scores
    ``<= beam_search.NEG_INF / 2``.
  """
  TRACE_COUNTS['beam_search'] += 1
  rules = beam_lib.GNMT(alpha, no_repeat_ngram_size, repetition_penalty)
  return beam_lib.loop(model, params, inputs, rules, beam_size=beam_size,
                       max_decode_len=max_decode_len, compact=compact,
                       num_hypotheses=num_hypotheses, prefix=prefix,
                       constraints=constraints, word_starts=word_starts)


# ------------------------------------------------------ scoring and maps --

@functools.partial(jax.jit, static_argnames=('model',))
def token_log_probs(model, params, inputs, targets):
  """Teacher-forced log-probabilities of given targets, one forward pass.

  Args:
    inputs: ``[batch, s]``; targets: ``[batch, t]`` (EOS-terminated, 0-padded).

  Returns:
    float32 ``[batch, t]``: ``log p(targets[b, i] | inputs[b], targets[b, :i])``,
    0 at padding (sum a row for the sentence's log-probability).
  """
  TRACE_COUNTS['token_log_probs'] += 1
  logits = model.apply(steps.as_variables(params), inputs, targets)
  log_p = jax.nn.log_softmax(logits.astype(jnp.float32))
  picked = jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
  return jnp.where(targets != PAD, picked, 0.0)


@functools.partial(jax.jit, static_argnames=('model',))
def cached_logits(model, params, inputs, targets):
  """Teacher forcing through the cached step decoder, one position per step.

  Args:
    inputs: ``[batch, s]``; targets: ``[batch, t]`` (EOS-terminated, 0-padded).

  Returns:
    float32 logits ``[batch, t, vocab]``; at non-pad target positions they
    equal ``model.apply(variables, inputs, targets)`` (a check of the cache).
  """
  variables = steps.as_variables(params)
  length = targets.shape[1]
  cache = steps.init_cache(model, variables, inputs, length)

  def body(cache, t):
    logits, cache = steps.step(model, variables, cache, inputs, targets, t,
                               length)
    return cache, logits

  _, logits = jax.lax.scan(body, cache, jnp.arange(length))
  return logits.swapaxes(0, 1)


def _layer_weights(tree, prefix, num_layers, scanned, attention):
  """Sown attention weights of one stack as ``[layers, batch, heads, q, k]``."""
  if scanned:
    return tree[prefix][attention]['attention_weights'][0]
  return jnp.stack([tree[f'{prefix}_{i}'][attention]['attention_weights'][0]
                    for i in range(num_layers)])


def check_attention_maps(cfg) -> None:
  """The ValueError of :func:`attention_maps` for a model config whose
  attention weights it cannot draw."""
  if cfg.model_kind != 'encoder_decoder' or cfg.attention_impl not in (
      'auto', 'reference') or cfg.attention_kind != 'full':
    raise ValueError('attention maps are drawn for an encoder_decoder model '
                     "with full attention and attention_impl 'reference' (or "
                     "'auto' on CPU)")


@functools.partial(jax.jit, static_argnames=('model',))
def attention_maps(model, variables, inputs, outputs):
  """Attention weights of one teacher-forced pass over decoded ``outputs``.

  Args:
    variables: params or ``{'params': ...}``.
    inputs: ``[batch, s]``; outputs: ``[batch, t]`` decoded tokens.

  Returns:
    dict of float32 arrays: ``encoder_self`` ``[enc_layers, batch, heads, s,
    s]``, ``decoder_self`` ``[dec_layers, batch, heads, t, t]`` and
    ``decoder_cross`` ``[dec_layers, batch, heads, t, s]``. Row ``i`` of the
    decoder maps is the query that predicts ``outputs[:, i]``; rows of padding
    (after EOS) are zero.
  """
  cfg = model.config
  check_attention_maps(cfg)
  _, state = model.apply(steps.as_variables(variables), inputs, outputs,
                         mutable=['intermediates'])
  tree = state['intermediates']
  scanned = cfg.scan_layers
  return dict(
      encoder_self=_layer_weights(tree, 'encoder', cfg.num_encoder_layers,
                                  scanned, 'self_attention'),
      decoder_self=_layer_weights(tree, 'decoder', cfg.num_decoder_layers,
                                  scanned, 'self_attention'),
      decoder_cross=_layer_weights(tree, 'decoder', cfg.num_decoder_layers,
                                   scanned, 'cross_attention'))
