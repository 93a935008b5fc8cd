"""Autoregressive decoding: greedy, beam search and sampling (paper section 6.1).

Each public function is one ``jax.jit``: the encoder runs once per batch and
fills the key/value cache (:meth:`Transformer.decode_step`, which also projects
the encoder output to cross-attention keys/values once), then one
``lax.while_loop`` runs one cached decoder step per token and stops when every
sequence has emitted EOS or the maximum length is reached.

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

import flax.linen as nn
import jax
import jax.numpy as jnp

from xfmr_jax import beam_cache
from xfmr_jax import top_k as topk
from xfmr_jax.blocks import shift_right
from xfmr_jax.token_ids import EOS, PAD

DECODE_EXTRA = 50  # tokens decoded beyond the input length (paper section 6.1)
NEG_INF = -1.0e7  # finite "impossible" score: keeps beam arithmetic NaN-free
TRACE_COUNTS: collections.Counter = collections.Counter()


# ----------------------------------------------------------------- helpers --

def _split_rows(inputs):
  """``[batch, s]``: rows over the data axes when a mesh and rules are active."""
  return nn.with_logical_constraint(inputs, ('batch', 'length'))


def _replicated(x):
  """Outputs whole on every device (no-op without a mesh and rules)."""
  return nn.with_logical_constraint(x, (None,) * x.ndim)


def _variables(params):
  """Accept a params tree or a full ``{'params': ...}`` variables dict."""
  return nn.unbox(params if 'params' in params else {'params': params})


def decode_length(config, input_length: int, max_decode_len=None, *,
                  extra: int = DECODE_EXTRA) -> int:
  """Output length: ``max_decode_len`` if given, else input length + ``extra``
  (the paper decodes up to 50 tokens past the input), capped by ``max_len``
  (a decoder-only model's positions count the source too)."""
  length = input_length + extra if max_decode_len is None else max_decode_len
  room = config.max_len
  if config.model_kind == 'decoder_only':
    room -= input_length
    if room <= 0:
      raise ValueError(f'inputs of length {input_length} leave no room to '
                       f'decode within max_len={config.max_len}')
  return min(length, room)


def _no_pad(logits):
  """Forbid the pad id (see the module docstring). logits: ``[..., vocab]``."""
  return logits.at[..., PAD].set(-jnp.inf)


def logsumexp(x, maximum=None):
  """``logsumexp`` over the last axis in float32, ``[..., v] -> [..., 1]``
  (an all ``-inf`` row gives ``-inf``). ``maximum`` ``[..., 1]``, if given,
  is ``x``'s row maximum, known already (it saves a pass over ``x``).

  The exponentials are an elementwise pass and their sum a matrix-vector
  product: XLA's CPU backend runs ``exp`` inside a reduction on one core,
  and this form took 27 ms against 41 for ``jax.nn.logsumexp`` over 256 x
  58,101 logits (a Marian beam step's).
  """
  m = jnp.max(x, axis=-1, keepdims=True) if maximum is None else maximum
  m = m.astype(jnp.float32)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  total = jnp.dot(jnp.exp(x - m), jnp.ones((x.shape[-1],), jnp.float32),
                  preferred_element_type=jnp.float32)
  return m + jnp.log(total)[..., None]


def _init_cache(model, variables, inputs, cache_len):
  """Run the model's ``init_cache`` (encoder and cross-attention K/V, or the
  decoder-only prefill) and return the ``cache`` collection."""
  if model.config.model_kind == 'encoder_only':
    raise ValueError('an encoder_only model tags tokens; it does not decode')
  _, state = model.apply(variables, inputs, cache_len,
                         method=model.init_cache, mutable=['cache'])
  return state['cache']


def _step(model, variables, cache, inputs, out, t, cache_len):
  """Logits ``[batch, vocab]`` for position t and the updated cache.

  The decoder input at t is the output at t - 1 (the start symbol at 0):
  ``shift_right``, as in training. out: ``[batch, cache_len]``.
  """
  tokens = jax.lax.dynamic_slice_in_dim(shift_right(out), t, 1, axis=1)
  logits, state = model.apply({**variables, 'cache': cache}, inputs, tokens,
                              t, cache_len=cache_len,
                              method=model.decode_step, mutable=['cache'])
  return logits[:, 0], state['cache']


def _autoregress(batch, length, carry, next_logits, pick):
  """Shared loop of greedy decoding and sampling.

  Args:
    carry: loop state of ``next_logits`` (the cache).
    next_logits: ``(carry, out, t) -> (logits [batch, vocab], carry)`` for
      position t, given the tokens ``out [batch, length]`` emitted before t.
    pick: ``(logits [batch, vocab], t) -> tokens [batch]``.

  Returns:
    ``[batch, length]`` int32 tokens, 0 after EOS.
  """
  def cond(state):
    t, _, done, _ = state
    return (t < length) & ~jnp.all(done)

  def body(state):
    t, out, done, carry = state
    logits, carry = next_logits(carry, out, t)
    token = jnp.where(done, PAD, pick(_no_pad(logits), t))
    return t + 1, out.at[:, t].set(token), done | (token == EOS), carry

  init = (0, jnp.zeros((batch, length), jnp.int32), jnp.zeros((batch,), bool),
          carry)
  return jax.lax.while_loop(cond, body, init)[1]


def _cached_loop(model, params, inputs, max_decode_len, pick):
  variables = _variables(params)
  inputs = _split_rows(inputs)
  length = decode_length(model.config, inputs.shape[1], max_decode_len)
  cache = _init_cache(model, variables, inputs, length)
  next_logits = lambda cache, out, t: _step(model, variables, cache, inputs,
                                            out, t, length)
  return _replicated(_autoregress(inputs.shape[0], length, cache, next_logits,
                                  pick))


def _argmax(logits, t):
  del t
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


# ------------------------------------------------------------------ greedy --

@functools.partial(jax.jit, static_argnames=('model', 'max_decode_len'))
def greedy_decode(model, params, inputs, *, max_decode_len=None):
  """Greedy decoding with the KV cache.

  Args:
    model: a :class:`~xfmr_jax.model.SequenceModel` (static).
    params: its params (or ``{'params': ...}``).
    inputs: ``[batch, s]`` int32 source ids, 0-padded.
    max_decode_len: static; default ``s + 50`` capped by ``config.max_len``.

  Returns:
    int32 ``[batch, max_decode_len]`` tokens.
  """
  TRACE_COUNTS['greedy_decode'] += 1
  return _cached_loop(model, params, inputs, max_decode_len, _argmax)


@functools.partial(jax.jit, static_argnames=('model', 'max_decode_len'))
def naive_greedy_decode(model, params, inputs, *, max_decode_len=None):
  """Reference greedy decoding without a cache: the full teacher-forced
  decoder runs over all ``max_decode_len`` positions at every step. Same
  arguments and result as :func:`greedy_decode`."""
  TRACE_COUNTS['naive_greedy_decode'] += 1
  variables = _variables(params)
  length = decode_length(model.config, inputs.shape[1], max_decode_len)
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
    'model', 'temperature', 'top_k', 'top_p', 'max_decode_len'))
def sample(model, params, inputs, rng, *, temperature=1.0, top_k=0,
           top_p=1.0, max_decode_len=None):
  """Ancestral sampling with the KV cache.

  Args:
    rng: PRNG key; the token at position t uses ``fold_in(rng, t)``, so a key
      reproduces its samples.
    temperature: static; 0 means greedy.
    top_k: static; sample among the k most likely tokens (0: all).
    top_p: static; sample in the smallest set of mass >= top_p (1: all).
    Other arguments and the result as in :func:`greedy_decode`.
  """
  TRACE_COUNTS['sample'] += 1
  if temperature == 0:
    return _cached_loop(model, params, inputs, max_decode_len, _argmax)

  def pick(logits, t):
    logits = _filter_logits(logits, temperature, top_k, top_p)
    return jax.random.categorical(jax.random.fold_in(rng, t), logits,
                                  axis=-1).astype(jnp.int32)
  return _cached_loop(model, params, inputs, max_decode_len, pick)


# ------------------------------------------------------------- beam search --

def length_penalty(length, alpha):
  """GNMT length penalty ``((5 + length) / 6) ** alpha`` (Wu et al., 2016)."""
  return ((5.0 + length) / 6.0) ** alpha


def _beam_update(beams, log_probs, t, alpha):
  """Extend every alive beam by one token at position t.

  The new beam is the ``k`` best extensions by log-probability; those ending in
  EOS move to the finished set (scored ``logp / length_penalty(t + 1)``, merged
  keeping the k best), the others stay alive. With k = 1 this is greedy.

  Args:
    beams: dict of ``alive_seqs``, ``fin_seqs`` ``[batch, k, length]``,
      ``alive_logp``, ``fin_scores`` ``[batch, k]``.
    log_probs: ``[batch, k, vocab]`` next-token log-probabilities.

  Returns:
    the new beams and ``parent [batch, k]``, the alive beam each new alive
    beam extends (to reorder the cache).
  """
  batch, k, vocab = log_probs.shape
  candidates = (beams['alive_logp'][..., None] + log_probs).reshape(batch, -1)
  logp, index = topk.top_k(candidates, k)
  parent, token = index // vocab, index % vocab
  seqs = jnp.take_along_axis(beams['alive_seqs'], parent[..., None], axis=1)
  seqs = seqs.at[:, :, t].set(token)
  # Extensions of NEG_INF placeholders (or of a forbidden token) are not real.
  real = logp > NEG_INF / 2
  ended = token == EOS
  new_scores = jnp.where(real & ended, logp / length_penalty(t + 1, alpha),
                         NEG_INF)
  fin_scores, pick = jax.lax.top_k(
      jnp.concatenate([beams['fin_scores'], new_scores], axis=1), k)
  fin_seqs = jnp.take_along_axis(
      jnp.concatenate([beams['fin_seqs'], seqs], axis=1), pick[..., None],
      axis=1)
  return dict(alive_seqs=seqs,
              alive_logp=jnp.where(real & ~ended, logp, NEG_INF),
              fin_seqs=fin_seqs, fin_scores=fin_scores), parent


def _beams_done(beams, length, alpha):
  """``[batch]``: no alive beam left, or none can beat the worst finished.

  Log-probabilities only fall and (alpha >= 0) the penalty only grows, so an
  alive beam's best reachable score is ``logp / length_penalty(length)``.
  """
  best_alive = jnp.max(beams['alive_logp'], axis=1)
  worst_finished = jnp.min(beams['fin_scores'], axis=1)  # NEG_INF until k
  return ((best_alive <= NEG_INF / 2) |
          (worst_finished > best_alive / length_penalty(length, alpha)))


@functools.partial(jax.jit, static_argnames=(
    'model', 'beam_size', 'alpha', 'max_decode_len'))
def beam_search(model, params, inputs, *, beam_size=4, alpha=0.6,
                max_decode_len=None):
  """Beam search with the GNMT length penalty (paper: beam 4, alpha 0.6).

  Args:
    beam_size, alpha: static; alpha >= 0.
    Other arguments as in :func:`greedy_decode`.

  Returns:
    ``(tokens [batch, max_decode_len] int32, scores [batch] float32)``: the
    best finished hypothesis and its ``log p / length_penalty(len)`` (len
    counts the EOS). A row with no finished hypothesis falls back to its best
    unfinished one, scored at the full length.
  """
  TRACE_COUNTS['beam_search'] += 1
  variables = _variables(params)
  inputs = _split_rows(inputs)
  length = decode_length(model.config, inputs.shape[1], max_decode_len)
  batch, k = inputs.shape[0], beam_size
  # The encoder and the cross-attention K/V run once per sentence, and stay
  # so; the self-attention cache gets one row per beam (see beam_cache).
  cache = beam_cache.expand(model, _init_cache(model, variables, inputs,
                                               length), k)
  beam_inputs = jnp.repeat(inputs, k, axis=0)
  # Beam 0 is the real start; the others are placeholders that never win.
  beams = dict(
      alive_seqs=jnp.zeros((batch, k, length), jnp.int32),
      alive_logp=jnp.tile(jnp.asarray([0.0] + [NEG_INF] * (k - 1)), (batch, 1)),
      fin_seqs=jnp.zeros((batch, k, length), jnp.int32),
      fin_scores=jnp.full((batch, k), NEG_INF))

  def cond(state):
    t, beams, _ = state
    return (t < length) & ~jnp.all(_beams_done(beams, length, alpha))

  def body(state):
    t, beams, cache = state
    logits, cache = _step(model, variables, cache, beam_inputs,
                          beams['alive_seqs'].reshape(batch * k, length), t,
                          length)
    logits = _no_pad(logits)
    log_probs = logits - logsumexp(logits)
    beams, parent = _beam_update(beams, log_probs.reshape(batch, k, -1), t,
                                 alpha)
    rows = (jnp.arange(batch)[:, None] * k + parent).reshape(-1)
    return t + 1, beams, beam_cache.reorder(model, cache, rows)

  _, beams, _ = jax.lax.while_loop(cond, body, (0, beams, cache))
  best = jnp.argmax(beams['alive_logp'], axis=1)
  alive_seqs = jnp.take_along_axis(beams['alive_seqs'], best[:, None, None],
                                   axis=1)[:, 0]
  alive_scores = (jnp.take_along_axis(beams['alive_logp'], best[:, None],
                                      axis=1)[:, 0] /
                  length_penalty(length, alpha))
  finished = beams['fin_scores'][:, 0] > NEG_INF / 2
  tokens = jnp.where(finished[:, None], beams['fin_seqs'][:, 0], alive_seqs)
  return (_replicated(tokens),
          _replicated(jnp.where(finished, beams['fin_scores'][:, 0],
                                alive_scores)))


# ------------------------------------------------------ scoring and maps --

@functools.partial(jax.jit, static_argnames=('model',))
def cached_logits(model, params, inputs, targets):
  """Teacher forcing through the cached step decoder, one position per step.

  Args:
    inputs: ``[batch, s]``; targets: ``[batch, t]`` (EOS-terminated, 0-padded).

  Returns:
    float32 logits ``[batch, t, vocab]``; at non-pad target positions they
    equal ``model.apply(variables, inputs, targets)`` (a check of the cache).
  """
  variables = _variables(params)
  length = targets.shape[1]
  cache = _init_cache(model, variables, inputs, length)

  def body(cache, t):
    logits, cache = _step(model, variables, cache, inputs, targets, t, length)
    return cache, logits

  _, logits = jax.lax.scan(body, cache, jnp.arange(length))
  return logits.swapaxes(0, 1)


def _layer_weights(tree, prefix, num_layers, scanned, attention):
  """Sown attention weights of one stack as ``[layers, batch, heads, q, k]``."""
  if scanned:
    return tree[prefix][attention]['attention_weights'][0]
  return jnp.stack([tree[f'{prefix}_{i}'][attention]['attention_weights'][0]
                    for i in range(num_layers)])


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
  if cfg.model_kind != 'encoder_decoder' or cfg.attention_impl not in (
      'auto', 'reference') or cfg.attention_kind != 'full':
    raise ValueError('attention maps are drawn for an encoder_decoder model '
                     "with full attention and attention_impl 'reference' (or "
                     "'auto' on CPU)")
  _, state = model.apply(_variables(variables), inputs, outputs,
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
