"""Decoding throughput: generated tokens/s of our decoders, the flax example's
beam search and PyTorch's loop.

Cached greedy and beam-4 search, the uncached recompute
(``decode.naive_greedy_decode``), the yardstick ``flax_wmt_beam4`` (google/flax
``examples/wmt``'s model and beam search on the same size, see
:mod:`experiments.benchmark.flax_wmt_beam`) and, where torch runs, a PyTorch
naive greedy loop, on one model size with the EOS embedding zeroed so that
every run emits the full output length.

Beside them, in the same rounds, cached greedy decoding of ONE sentence
(``batch1``) against the memory-bandwidth limit: its latency per generated
token, the bytes of the model's parameters, the bandwidth of a jitted
``jnp.sum`` over 256 MB (``common.MemoryBandwidth``), the time to read the
parameters once at that bandwidth, and the ratio latency / that time (1.0
would be a decoder that reads every weight once per token and does nothing
else; the encoder's weights count too, though each step reads only the
decoder's and the output projection).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmark.common import (DROPOUT, SIZES, MemoryBandwidth,
                                          interleave, log, random_batch)
from experiments.benchmark import flax_wmt_beam
from experiments.benchmark.flax_wmt import WmtConfig
from experiments.benchmark.torch_reference import TorchNaiveGreedy
from xfmr_jax import config as config_lib
from xfmr_jax import decode, optim, train_state
from xfmr_jax.model import Transformer
from xfmr_jax.token_ids import EOS


def decode_params(model, length: int):
  """Fresh parameters with the EOS embedding zeroed: a random model would
  otherwise stop at a random step; this way every run emits ``length`` tokens."""
  state = jax.jit(lambda: train_state.init_state(
      model, optim.make_optimizer(d_model=model.config.d_model,
                                  warmup_steps=1), seed=0, length=length))()
  params = jax.tree.map(lambda x: x, state.params)
  emb = params['source_embed']['embedding']
  params['source_embed']['embedding'] = emb.at[EOS].set(0.0)
  return params


# The target for batch-1 greedy: latency per token at most this many
# times the time to read the parameters once.
BATCH1_TARGET = 1.5


def _batch1(params, tokens: int, seconds, read_bytes: int, read_seconds):
  """Batch-1 greedy latency per token against reading the parameters once;
  ``seconds`` and ``read_seconds`` per round, from the same rounds."""
  param_bytes = int(sum(x.nbytes for x in jax.tree.leaves(params)))
  per_token = seconds / tokens
  bandwidth = read_bytes / read_seconds
  weights_once = param_bytes / bandwidth
  return dict(generated_tokens=tokens, seconds=float(np.median(seconds)),
              ms_per_token=float(np.median(per_token)) * 1e3,
              param_bytes=param_bytes, bandwidth_read_bytes=read_bytes,
              bandwidth_bytes_per_s=float(np.median(bandwidth)),
              weights_once_ms=float(np.median(weights_once)) * 1e3,
              # Per round, then the median: both ran in the same round.
              latency_vs_weights_once=float(np.median(per_token /
                                                      weights_once)),
              target=BATCH1_TARGET)


def bench_decode(size: str, *, reps: int, use_torch: bool, length: int = 64,
                 dtype: str = 'float32', batch_size: int | None = None,
                 naive: bool = True, flax_wmt: bool = True,
                 timing: dict | None = None) -> dict:
  spec = SIZES[size]
  batch_size = batch_size or spec['decode_batch']
  cfg = config_lib.ModelConfig(**spec['model'], dropout_rate=DROPOUT,
                               dtype=dtype)
  model = Transformer(cfg)
  params = decode_params(model, spec['length'])
  inputs = jnp.asarray(random_batch(cfg.vocab_size, batch_size,
                                    spec['length'], seed=1)['inputs'])
  fns = {
      'greedy_cached': lambda: decode.greedy_decode(
          model, params, inputs, max_decode_len=length),
      'beam4_cached': lambda: decode.beam_search(
          model, params, inputs, beam_size=4, max_decode_len=length)[0],
  }
  if flax_wmt:
    wcfg = WmtConfig.from_model_config(cfg)
    wparams = flax_wmt_beam.decode_params(wcfg, spec['length'])
    fns['flax_wmt_beam4'] = lambda: flax_wmt_beam.beam_decode(
        wcfg, wparams, inputs, beam_size=4, max_decode_len=length)[0]
  one = inputs[:1]
  fns['greedy_b1'] = lambda: decode.greedy_decode(
      model, params, one, max_decode_len=length)
  if naive:
    fns['greedy_naive'] = lambda: decode.naive_greedy_decode(
        model, params, inputs, max_decode_len=length)
  runners, generated, first = {}, {}, {}
  for name, fn in fns.items():
    log(f'[{size}] decode: compiling {name} ...')
    t0 = time.perf_counter()
    tokens = np.asarray(jax.block_until_ready(fn()))
    first[name] = time.perf_counter() - t0
    # Tokens up to and including EOS (0 after it); all of them when no EOS.
    generated[name] = int((tokens != 0).sum())
    runners[name] = lambda fn=fn: jax.block_until_ready(fn())
  if use_torch:
    torch_greedy = TorchNaiveGreedy(cfg, inputs, length)
    torch_greedy(2)   # warm-up
    runners['torch_greedy_naive'] = torch_greedy
    generated['torch_greedy_naive'] = batch_size * length
  runners['bandwidth'] = bandwidth = MemoryBandwidth()
  log(f'[{size}] decode: timing {reps} rounds ...')
  times = interleave(runners, reps, **(timing or {}))
  out = dict(size=size, batch=batch_size, source_length=spec['length'],
             output_length=length, reps=reps, runs={},
             load=times.rounds_info())
  out['batch1'] = _batch1(params, generated['greedy_b1'],
                          np.array(times.pop('greedy_b1')), bandwidth.nbytes,
                          np.array(times.pop('bandwidth')))
  out['batch1']['foreign_load'] = times.load_summary('greedy_b1')
  del bandwidth, runners['bandwidth']
  for name, ts in times.items():
    s = float(np.median(ts))
    out['runs'][name] = dict(seconds=s, generated_tokens=generated[name],
                             tokens_per_s=generated[name] / s,
                             first_call_s=first.get(name),
                             foreign_load=times.load_summary(name),
                             calls_per_round=times.calls[name])
  runs = out['runs']
  if 'greedy_naive' in runs:
    out['cached_vs_naive'] = (runs['greedy_cached']['tokens_per_s'] /
                              runs['greedy_naive']['tokens_per_s'])
  if 'flax_wmt_beam4' in runs:
    out['beam4_vs_flax_wmt'] = (runs['beam4_cached']['tokens_per_s'] /
                                runs['flax_wmt_beam4']['tokens_per_s'])
  if 'torch_greedy_naive' in runs:
    out['cached_vs_torch_naive'] = (runs['greedy_cached']['tokens_per_s'] /
                                    runs['torch_greedy_naive']['tokens_per_s'])
  return out
