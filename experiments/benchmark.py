r"""Train-step, decoding and PyTorch-comparison benchmarks, and a one-shot GPU check.

    python -m experiments.benchmark [--sizes toy,small,base] [--json PATH]
    python -m experiments.benchmark --gpu_check [--json PATH]   # or gpu_check.sh

For every size it measures, in ONE process and alternating round by round (so
a machine shared with other jobs slows every contender alike):

* our jitted train step (``xfmr_jax.train``: model, label-smoothed loss, Adam
  with the paper schedule, dropout 0.1) and its variants without dropout, with
  ``scan_layers`` and with ``remat``: median step time, tokens/s, compile time
  of the first step, memory, model FLOPs per step and MFU against a float32
  ``jnp.dot`` peak measured in the same rounds;
* the same model in PyTorch (``torch.nn.Transformer`` with shared, scaled
  embeddings, sinusoidal positions, tied output projection, label-smoothed
  cross-entropy, ``torch.optim.Adam``), if torch is installed, with dropout
  where ours has it (``torch``: embeddings and sublayer outputs, the paper's
  sites) and, as a second row, with ``nn.Transformer``'s own sites
  (``torch_default``: also the attention weights and the FFN's hidden layer,
  extra work that made its steps 10-28% slower on a 2-core CPU). Ratios are
  against ``torch``, the same computation;
* decoding: generated tokens/s for cached greedy and beam-4 search, the
  uncached recompute (``decode.naive_greedy_decode``) and a PyTorch naive
  greedy loop on the same model size.

Timings are wall-clock medians after warm-up. Model FLOPs are counted
analytically (matmuls and attention, backward = 2 x forward, remat's
recomputation not counted). MFU = model FLOP/s / measured matmul FLOP/s.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import resource
import sys
import threading
import time

# PyTorch's OpenMP threads busy-wait between parallel regions by default; on
# a machine shared with other jobs that spinning makes its steps several times
# slower (measured: 146 ms vs 18 ms for the tiny step). Passive waiting is the
# fair setting there; export OMP_WAIT_POLICY=ACTIVE to override.
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # noqa: E402  pylint: disable=g-import-not-at-top
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top

from xfmr_jax import config as config_lib
from xfmr_jax import decode, optim, train
from xfmr_jax.model import Transformer

# name: model config, batch, length (source = target), decode batch.
SIZES = {
    'tiny': dict(model=dict(vocab_size=64, d_model=32, num_heads=2,
                            num_encoder_layers=1, num_decoder_layers=1,
                            d_ff=64, max_len=64),
                 batch=4, length=16, decode_batch=2),
    'toy': dict(model=dict(vocab_size=1000, d_model=192, num_heads=4,
                           num_encoder_layers=2, num_decoder_layers=2,
                           d_ff=768, max_len=256),
                batch=64, length=64, decode_batch=8),
    'small': dict(model=dict(vocab_size=8000, d_model=256, num_heads=4,
                             num_encoder_layers=3, num_decoder_layers=3,
                             d_ff=1024, max_len=256),
                  batch=32, length=64, decode_batch=4),
    'base': dict(model=dict(vocab_size=32000, max_len=256),
                 batch=16, length=64, decode_batch=2),
    'big': dict(model=dict(vocab_size=32000, d_model=1024, num_heads=16,
                           d_ff=4096, max_len=256),
                batch=16, length=64, decode_batch=2),
}
# Variants measured beside the main configuration (dropout 0.1, unrolled layers).
VARIANTS = {'no_dropout': dict(dropout_rate=0.0),
            'scan': dict(scan_layers=True),
            'remat': dict(remat=True)}
# The seed's model variants (ModelConfig changes, or functions of the config):
# what each costs per step, beside the paper's model in the same rounds.
MODEL_VARIANTS = {
    'rope': dict(positional='rope'),
    'alibi': dict(positional='alibi'),
    'gqa': lambda c: dict(num_kv_heads=max(1, c.num_heads // 2)),
    'mqa': dict(num_kv_heads=1),
    'swiglu': lambda c: dict(activation='swiglu',
                             d_ff=config_lib.swiglu_d_ff(c.d_ff)),
    'pre_rmsnorm': dict(norm_position='pre', norm_type='rmsnorm'),
    'no_bias': dict(use_bias=False),
}
DROPOUT = 0.1
LABEL_SMOOTHING = 0.1


def log(*args):
  print(*args, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ counting --

def train_flops(cfg: config_lib.ModelConfig, batch: int, src: int,
                tgt: int) -> float:
  """Model FLOPs of one train step (forward + backward = 3 x forward)."""
  d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
  enc = 8 * src * d * d + 4 * src * src * d + 4 * src * d * f
  dec = (8 * tgt * d * d + 4 * tgt * tgt * d          # self-attention
         + 4 * tgt * d * d + 4 * src * d * d          # cross: q, out; k, v
         + 4 * tgt * src * d + 4 * tgt * d * f)       # cross scores; FFN
  forward = (cfg.num_encoder_layers * enc + cfg.num_decoder_layers * dec
             + 2 * tgt * d * v)                       # output projection
  return 3.0 * batch * forward


def rss_bytes() -> int:
  try:
    import psutil  # pylint: disable=g-import-not-at-top
    return psutil.Process().memory_info().rss
  except ImportError:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


class PeakRSS:
  """Peak resident-set growth over a block, sampled every 2 ms."""

  def __enter__(self):
    self.start = self.peak = rss_bytes()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def _sample(self):
    while not self._stop.wait(0.002):
      self.peak = max(self.peak, rss_bytes())

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, rss_bytes())
    self.delta = self.peak - self.start


def device_peak_bytes():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get('peak_bytes_in_use')


# ------------------------------------------------------------------- runners --

class MatmulPeak:
  """``jnp.dot`` of two n x n matrices: the FLOP/s ceiling for MFU."""

  def __init__(self, n: int, dtype=jnp.float32):
    self.n = n
    key_a, key_b = jax.random.split(jax.random.key(0))
    self.a = jax.random.normal(key_a, (n, n), dtype)
    self.b = jax.random.normal(key_b, (n, n), dtype)
    self.fn = jax.jit(jnp.dot)
    jax.block_until_ready(self.fn(self.a, self.b))
    self.flops = 2.0 * n ** 3

  def __call__(self):
    jax.block_until_ready(self.fn(self.a, self.b))


def random_batch(vocab: int, batch: int, length: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  # Ids >= 2: no padding (0) and no EOS (1), so every position is a real token.
  return {k: rng.integers(2, vocab, (batch, length)).astype(np.int32)
          for k in ('inputs', 'targets')}


class JaxTrain:
  """Our jitted, state-donating train step on one fixed batch."""

  def __init__(self, cfg: config_lib.ModelConfig, batch: dict):
    self.cfg = cfg
    model = Transformer(cfg)
    tx = optim.make_optimizer(d_model=cfg.d_model, warmup_steps=4000)
    step, _ = train.jit_steps(model, tx, LABEL_SMOOTHING)
    self.batch = jax.device_put(batch)
    with PeakRSS() as mem:
      self.state = jax.jit(lambda: train.init_state(model, tx, seed=0))()
      jax.block_until_ready(self.state)
      t0 = time.perf_counter()
      self.compiled = step.lower(self.state, self.batch).compile()
      self.compile_s = time.perf_counter() - t0
      t0 = time.perf_counter()
      self()
      self.first_step_s = time.perf_counter() - t0
      self()
    self.rss_delta = mem.delta
    self.xla_bytes = None
    try:
      m = self.compiled.memory_analysis()
      self.xla_bytes = int(m.argument_size_in_bytes + m.output_size_in_bytes
                           - m.alias_size_in_bytes + m.temp_size_in_bytes)
    except Exception:  # pylint: disable=broad-except
      pass
    self.device_peak = device_peak_bytes()

  def __call__(self):
    self.state, metrics = self.compiled(self.state, self.batch)
    jax.block_until_ready(metrics)
    return metrics

  def memory(self) -> dict:
    return dict(device_peak_bytes=self.device_peak,
                xla_step_bytes=self.xla_bytes, rss_delta_bytes=self.rss_delta)


def torch_available() -> bool:
  try:
    import torch  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    return True
  except ImportError:
    return False


# Where the PyTorch model drops out: 'paper' = where xfmr_jax does (the sums
# of embeddings and positions, and every sublayer's output before the
# residual add; paper section 5.4); 'torch' = nn.Transformer's defaults, which
# also drop out the attention weights and the FFN's hidden activations.
TORCH_DROPOUT_SITES = ('paper', 'torch')


def _torch_model(cfg: config_lib.ModelConfig, dropout: float,
                 sites: str = 'paper'):
  """``torch.nn.Transformer`` with our embeddings, positions and output layer,
  dropping out at ``sites`` (see TORCH_DROPOUT_SITES)."""
  if sites not in TORCH_DROPOUT_SITES:
    raise ValueError(f'dropout sites {sites!r} not in {TORCH_DROPOUT_SITES}')
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top

  class TorchTransformer(nn.Module):

    def __init__(self):
      super().__init__()
      d = cfg.d_model
      self.embed = nn.Embedding(cfg.vocab_size, d)
      nn.init.normal_(self.embed.weight, std=d ** -0.5)
      pos = torch.arange(cfg.max_len, dtype=torch.float32)[:, None]
      div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) *
                      (-math.log(10000.0) / d))
      pe = torch.zeros(cfg.max_len, d)
      pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
      self.register_buffer('pe', pe)
      self.drop = nn.Dropout(dropout)
      self.core = nn.Transformer(
          d, cfg.num_heads, cfg.num_encoder_layers, cfg.num_decoder_layers,
          cfg.d_ff, dropout, batch_first=True)
      if sites == 'paper':
        for layer in [*self.core.encoder.layers, *self.core.decoder.layers]:
          layer.dropout = nn.Identity()   # between the FFN's two linears
          for attn in (layer.self_attn, getattr(layer, 'multihead_attn', None)):
            if attn is not None:
              attn.dropout = 0.0          # on the attention weights

    def emb(self, tokens):
      x = self.embed(tokens) * math.sqrt(cfg.d_model)
      return self.drop(x + self.pe[:tokens.shape[1]])

    def encode(self, src):
      return self.core.encoder(self.emb(src))

    def decode(self, memory, tgt_in):
      mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
      out = self.core.decoder(self.emb(tgt_in), memory, tgt_mask=mask,
                              tgt_is_causal=True)
      return out @ self.embed.weight.T   # tied output projection

    def forward(self, src, tgt_in):
      return self.decode(self.encode(src), tgt_in)

  return TorchTransformer()


class TorchTrain:
  """PyTorch eager train step: forward, smoothed cross-entropy, Adam."""

  def __init__(self, cfg: config_lib.ModelConfig, batch: dict,
               dropout: float = DROPOUT, sites: str = 'paper'):
    import torch  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    self.torch = torch
    self.src = torch.from_numpy(batch['inputs']).long()
    self.tgt = torch.from_numpy(batch['targets']).long()
    self.tgt_in = torch.nn.functional.pad(self.tgt, (1, 0))[:, :-1]
    with PeakRSS() as mem:
      self.model = _torch_model(cfg, dropout, sites).train()
      self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4,
                                  betas=(0.9, 0.98), eps=1e-9)
      t0 = time.perf_counter()
      self()
      self.first_step_s = time.perf_counter() - t0
      self()
    self.rss_delta = mem.delta

  def __call__(self):
    torch = self.torch
    logits = self.model(self.src, self.tgt_in)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), self.tgt.reshape(-1),
        label_smoothing=LABEL_SMOOTHING)
    self.opt.zero_grad(set_to_none=True)
    loss.backward()
    self.opt.step()
    return loss.item()


# Pause before each timed run. XLA's worker threads keep spinning for some
# milliseconds after a computation; whatever ran next shared the cores with
# them (a 2048^3 jnp.dot timed right after a small train step ran at 146-169
# instead of 195-210 GFLOP/s; after 20 ms idle it ran at full speed).
SETTLE_S = 0.1


def interleave(runners: dict, rounds: int, settle_s: float = SETTLE_S) -> dict:
  """Run each runner once per round, in turn, each after ``settle_s`` idle;
  per-runner lists of seconds."""
  times = {name: [] for name in runners}
  for _ in range(rounds):
    for name, run in runners.items():
      time.sleep(settle_s)
      t0 = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - t0)
  return times


# -------------------------------------------------------------------- train --

def bench_train(size: str, *, rounds: int, variants, use_torch: bool,
                peak_n: int, dtype: str = 'float32',
                batch_size: int | None = None,
                length: int | None = None) -> dict:
  """One size's train step, timed side by side with its variants (True:
  VARIANTS; or a dict name -> ModelConfig changes or a function of the config
  returning them), torch and the matmul peak. A variant that cannot be built
  here is reported, not fatal."""
  spec = SIZES[size]
  batch_size = batch_size or spec['batch']
  length = length or spec['length']
  cfg = config_lib.ModelConfig(**spec['model'], dropout_rate=DROPOUT,
                               dtype=dtype, attention_impl='reference')
  batch = random_batch(cfg.vocab_size, batch_size, length)
  peak = MatmulPeak(peak_n, jnp.bfloat16 if dtype == 'bfloat16' else
                    jnp.float32)
  configs = {'main': cfg}
  if variants:
    chosen = VARIANTS if variants is True else variants
    configs.update({k: cfg.replace(**(v(cfg) if callable(v) else v))
                    for k, v in chosen.items()})
  runners, unavailable = {}, {}
  for name, c in configs.items():
    log(f'[{size}] compiling {name} ...')
    try:
      runners[name] = JaxTrain(c, batch)
    except Exception as e:  # pylint: disable=broad-except
      if name == 'main':
        raise
      unavailable[name] = f'{type(e).__name__}: {str(e)[:200]}'
      log(f'[{size}] {name} unavailable: {unavailable[name]}')
  if use_torch:
    log(f'[{size}] building torch ...')
    runners['torch'] = TorchTrain(cfg, batch, sites='paper')
    runners['torch_default'] = TorchTrain(cfg, batch, sites='torch')
  runners['matmul'] = peak
  log(f'[{size}] timing {rounds} rounds ...')
  times = interleave(runners, rounds)
  peak_flops = peak.flops / np.array(times.pop('matmul'))
  flops = train_flops(cfg, batch_size, length, length)
  tokens = batch_size * length * 2   # source + target tokens per step
  out = dict(size=size, batch=batch_size, length=length, tokens_per_step=tokens,
             model=dataclasses.asdict(cfg), model_flops_per_step=flops,
             matmul_n=peak_n, matmul_peak_flops=float(np.median(peak_flops)),
             rounds=rounds, runs={}, unavailable=unavailable)
  for name, ts in times.items():
    ts = np.array(ts)
    run = runners[name]
    row = dict(step_s=float(np.median(ts)), step_s_all=ts.tolist(),
               tokens_per_s=float(tokens / np.median(ts)),
               first_step_s=run.first_step_s)
    # MFU per round against the peak measured in the same round.
    row['mfu'] = float(np.median(flops / ts / peak_flops))
    if isinstance(run, JaxTrain):
      row.update(compile_s=run.compile_s, memory=run.memory())
      row['model_changes'] = {k: v for k, v in dataclasses.asdict(
          configs[name]).items() if getattr(cfg, k) != v}
    else:
      row.update(memory=dict(rss_delta_bytes=run.rss_delta))
    out['runs'][name] = row
  for ref in ('torch', 'torch_default'):
    if ref in out['runs']:
      # Per round, then the median: both sides of a ratio ran back to back.
      out[f'ratio_vs_{ref}'] = {
          name: float(np.median(np.array(times[ref]) / np.array(ts)))
          for name, ts in times.items() if name != ref}
  return out


# ------------------------------------------------------------------- decode --

def _decode_params(model, length: int):
  """Fresh parameters with the EOS embedding zeroed: a random model would
  otherwise stop at a random step; this way every run emits ``length`` tokens."""
  state = jax.jit(lambda: train.init_state(
      model, optim.make_optimizer(d_model=model.config.d_model,
                                  warmup_steps=1), seed=0, length=length))()
  params = jax.tree.map(lambda x: x, state.params)
  emb = params['source_embed']['embedding']
  params['source_embed']['embedding'] = emb.at[decode.EOS_ID].set(0.0)
  return params


class TorchNaiveGreedy:
  """The usual PyTorch loop: encode once, re-run the decoder on the whole
  prefix for every new token, no cache."""

  def __init__(self, cfg, inputs, length: int):
    import torch  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    self.torch = torch
    self.model = _torch_model(cfg, DROPOUT).eval()
    with torch.no_grad():
      self.model.embed.weight[decode.EOS_ID] = 0.0
    self.src = torch.from_numpy(np.array(inputs)).long()
    self.length = length

  def __call__(self, length=None):
    torch = self.torch
    with torch.no_grad():
      memory = self.model.encode(self.src)
      ys = torch.zeros(self.src.shape[0], 1, dtype=torch.long)
      for _ in range(length or self.length):
        logits = self.model.decode(memory, ys)[:, -1]
        logits[:, 0] = -float('inf')   # never the pad id, as ours
        ys = torch.cat([ys, logits.argmax(-1, keepdim=True)], dim=1)
    return ys[:, 1:].numpy()


def bench_decode(size: str, *, reps: int, use_torch: bool, length: int = 64,
                 dtype: str = 'float32', batch_size: int | None = None,
                 naive: bool = True) -> dict:
  spec = SIZES[size]
  batch_size = batch_size or spec['decode_batch']
  cfg = config_lib.ModelConfig(**spec['model'], dropout_rate=DROPOUT,
                               dtype=dtype)
  model = Transformer(cfg)
  params = _decode_params(model, spec['length'])
  inputs = jnp.asarray(random_batch(cfg.vocab_size, batch_size,
                                    spec['length'], seed=1)['inputs'])
  fns = {
      'greedy_cached': lambda: decode.greedy_decode(
          model, params, inputs, max_decode_len=length),
      'beam4_cached': lambda: decode.beam_search(
          model, params, inputs, beam_size=4, max_decode_len=length)[0],
  }
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
  log(f'[{size}] decode: timing {reps} rounds ...')
  times = interleave(runners, reps)
  out = dict(size=size, batch=batch_size, source_length=spec['length'],
             output_length=length, reps=reps, runs={})
  for name, ts in times.items():
    s = float(np.median(ts))
    out['runs'][name] = dict(seconds=s, generated_tokens=generated[name],
                             tokens_per_s=generated[name] / s,
                             first_call_s=first.get(name))
  runs = out['runs']
  if 'greedy_naive' in runs:
    out['cached_vs_naive'] = (runs['greedy_cached']['tokens_per_s'] /
                              runs['greedy_naive']['tokens_per_s'])
  if 'torch_greedy_naive' in runs:
    out['cached_vs_torch_naive'] = (runs['greedy_cached']['tokens_per_s'] /
                                    runs['torch_greedy_naive']['tokens_per_s'])
  return out


# ---------------------------------------------------------------- GPU check --

def bench_attention(*, batch: int, length: int, heads: int, head_dim: int,
                    dtype, reps: int) -> dict:
  """Causal self-attention forward + backward: the library's einsum path vs
  ``jax.nn.dot_product_attention`` ('xla', and 'cudnn' where it works)."""
  from xfmr_jax import attention, masks  # pylint: disable=g-import-not-at-top
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (batch, length, heads, head_dim), dtype)
             for kk in keys)
  mask = masks.causal_mask(length)
  impls = {
      'reference_einsum': lambda q, k, v: attention.dot_product_attention(
          q, k, v, mask),
      'jax_nn_xla': lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation='xla'),
      'jax_nn_cudnn': lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation='cudnn'),
  }
  # fwd 4*b*h*L^2*d (two matmuls), backward 2x; causal halves the useful part.
  flops = 3 * 4.0 * batch * heads * length ** 2 * head_dim
  runners, out, ref = {}, {}, None
  for name, fn in impls.items():
    loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    try:
      val, grads = jax.block_until_ready(step(q, k, v))
    except Exception as e:  # pylint: disable=broad-except
      out[name] = dict(available=False, reason=f'{type(e).__name__}: '
                       f'{str(e).splitlines()[0][:200] if str(e) else ""}')
      continue
    if ref is None:
      ref = grads[0]
    err = float(jnp.max(jnp.abs(grads[0].astype(jnp.float32) -
                                ref.astype(jnp.float32))))
    runners[name] = lambda step=step: jax.block_until_ready(step(q, k, v))
    out[name] = dict(available=True, max_abs_grad_diff_vs_reference=err)
  times = interleave(runners, reps)
  for name, ts in times.items():
    s = float(np.median(ts))
    out[name].update(fwd_bwd_s=s, tflops=flops / s / 1e12)
  return dict(batch=batch, length=length, heads=heads, head_dim=head_dim,
              dtype=jnp.dtype(dtype).name, impls=out)


def gpu_check(quick: bool = False) -> dict:
  """bf16 train MFU at base and big, attention backends, decode throughput."""
  backend = jax.default_backend()
  on_gpu = backend == 'gpu'
  res = dict(mode='gpu_check', backend=backend,
             devices=[str(d) for d in jax.devices()],
             device_kind=jax.devices()[0].device_kind)
  if on_gpu and not quick:
    sizes, dtype, peak_n, rounds = ('base', 'big'), 'bfloat16', 8192, 10
    train_shape = dict(base=(64, 128), big=(32, 128))
    attn = dict(batch=8, length=2048, heads=16, head_dim=64,
                dtype=jnp.bfloat16, reps=10)
    dec = dict(size='base', batch_size=64, reps=3)
  else:
    res['fell_back'] = (f'no GPU ({backend}): tiny sizes, float32' if not on_gpu
                        else 'quick mode: tiny sizes')
    sizes, dtype, peak_n, rounds = ('tiny',), 'float32', 256, 2
    train_shape = dict(tiny=(4, 16))
    attn = dict(batch=2, length=32, heads=2, head_dim=16,
                dtype=jnp.float32, reps=2)
    dec = dict(size='tiny', batch_size=2, reps=1, length=8)
  res['train'] = []
  for size in sizes:
    b, length = train_shape[size]
    # The main run uses the einsum attention; the fused kernels side by side.
    r = bench_train(size, rounds=rounds, use_torch=False,
                    variants=dict(xla_attention=dict(attention_impl='xla'),
                                  cudnn_attention=dict(
                                      attention_impl='cudnn')) if on_gpu
                    else dict(xla_attention=dict(attention_impl='xla')),
                    peak_n=peak_n, dtype=dtype, batch_size=b, length=length)
    res['train'].append(r)
  res['attention'] = bench_attention(**attn)
  res['decode'] = [bench_decode(dec['size'], reps=dec['reps'],
                                use_torch=False, dtype=dtype,
                                batch_size=dec['batch_size'], naive=False,
                                length=dec.get('length', 64))]
  return res


# -------------------------------------------------------------------- table --

def _mb(b):
  return '-' if b is None else f'{b / 2 ** 20:.0f}'


def format_tables(res: dict) -> str:
  lines = [f"machine: {res['machine']}", '']
  if res.get('train'):
    lines.append('train step (median of alternating rounds; dropout 0.1 '
                 'unless noted)')
    hdr = (f"{'size':6} {'run':15} {'step ms':>9} {'tok/s':>8} "
           f"{'vs torch':>8} {'MFU':>6} {'compile s':>9} {'GFLOP':>7} "
           f"{'peak GF/s':>9} {'xla MB':>7} {'rss MB':>7}")
    lines += [hdr, '-' * len(hdr)]
    for r in res['train']:
      ratios = r.get('ratio_vs_torch', {})
      for name, row in r['runs'].items():
        mem = row['memory']
        ratio = f"{ratios[name]:.2f}x" if name in ratios else '-'
        comp = f"{row['compile_s']:.1f}" if 'compile_s' in row else '-'
        lines.append(
            f"{r['size']:6} {name:15} {row['step_s'] * 1e3:9.1f} "
            f"{row['tokens_per_s']:8.0f} {ratio:>8} {row['mfu']:6.1%} "
            f"{comp:>9} {r['model_flops_per_step'] / 1e9:7.1f} "
            f"{r['matmul_peak_flops'] / 1e9:9.1f} "
            f"{_mb(mem.get('xla_step_bytes')):>7} "
            f"{_mb(mem.get('rss_delta_bytes')):>7}")
      for name, why in r.get('unavailable', {}).items():
        lines.append(f"{r['size']:6} {name:15} unavailable: {why[:80]}")
      if 'ratio_vs_torch_default' in r:
        lines.append(f"{r['size']:6} main vs torch_default (nn.Transformer's "
                     f"own dropout sites): "
                     f"{r['ratio_vs_torch_default']['main']:.2f}x")
    lines.append('')
  if res.get('decode'):
    lines.append('decoding (generated tokens/s; output length '
                 f"{res['decode'][0]['output_length']})")
    hdr = (f"{'size':6} {'batch':>5} {'run':20} {'tok/s':>9} {'s':>8} "
           f"{'cached/naive':>12} {'cached/torch':>12}")
    lines += [hdr, '-' * len(hdr)]
    for r in res['decode']:
      for name, row in r['runs'].items():
        a = (f"{r['cached_vs_naive']:.1f}x" if name == 'greedy_cached' and
             'cached_vs_naive' in r else '')
        b = (f"{r['cached_vs_torch_naive']:.1f}x" if name == 'greedy_cached'
             and 'cached_vs_torch_naive' in r else '')
        lines.append(f"{r['size']:6} {r['batch']:5} {name:20} "
                     f"{row['tokens_per_s']:9.1f} {row['seconds']:8.2f} "
                     f"{a:>12} {b:>12}")
    lines.append('')
  if res.get('attention'):
    a = res['attention']
    lines.append(f"attention fwd+bwd, causal, b={a['batch']} L={a['length']} "
                 f"h={a['heads']} d={a['head_dim']} {a['dtype']}")
    for name, row in a['impls'].items():
      if row.get('available'):
        lines.append(f"  {name:18} {row['fwd_bwd_s'] * 1e3:9.2f} ms "
                     f"{row['tflops']:8.3f} TFLOP/s")
      else:
        lines.append(f"  {name:18} unavailable: {row['reason']}")
    lines.append('')
  if res.get('torch_skipped'):
    lines.append(f"PyTorch comparison skipped: {res['torch_skipped']}")
  if res.get('fell_back'):
    lines.append(f"GPU check fell back: {res['fell_back']}")
  return '\n'.join(lines)


def machine() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          cpu = line.split(':', 1)[1].strip()
          break
  except OSError:
    pass
  dev = jax.devices()[0]
  return (f'{dev.platform}:{dev.device_kind}, {cpu}, {os.cpu_count()} cores, '
          f'jax {jax.__version__}')


# --------------------------------------------------------------------- main --

def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--sizes', default='toy,small,base',
                 help='comma-separated subset of ' + ','.join(SIZES))
  p.add_argument('--json', default=None, help='write the results here')
  p.add_argument('--rounds', type=int, default=5,
                 help='timed train rounds (after warm-up)')
  p.add_argument('--decode_reps', type=int, default=2)
  p.add_argument('--decode_len', type=int, default=64)
  p.add_argument('--decode_batch', type=int, default=None,
                 help='decode batch (default: per size, see SIZES)')
  p.add_argument('--decode_sizes', default=None,
                 help='sizes to decode (default: --sizes)')
  p.add_argument('--variants', default=None,
                 help='sizes that also run the no-dropout/scan/remat variants '
                 '(default: all of --sizes; "none" for none)')
  p.add_argument('--model_variants', default='',
                 help="sizes that also time the seed's model variants "
                 '(' + ', '.join(MODEL_VARIANTS) + ')')
  p.add_argument('--peak_n', type=int, default=2048,
                 help='matrix size of the matmul peak')
  p.add_argument('--no_torch', action='store_true')
  p.add_argument('--gpu_check', action='store_true',
                 help='the one-shot accelerator check (falls back on CPU)')
  p.add_argument('--quick', action='store_true',
                 help='tiny sizes and few rounds (for tests)')
  args = p.parse_args(argv)
  if args.quick:
    args.sizes, args.rounds, args.decode_reps = 'tiny', 2, 1
    args.variants = args.variants or 'none'
    args.decode_len, args.peak_n = min(args.decode_len, 8), 256
  sizes = [s for s in args.sizes.split(',') if s]
  bad = [s for s in sizes if s not in SIZES]
  if bad:
    p.error(f'unknown sizes {bad}; choose from {list(SIZES)}')
  args.sizes = sizes
  args.decode_sizes = (sizes if args.decode_sizes is None else
                       [s for s in args.decode_sizes.split(',') if s])
  args.variants = (sizes if args.variants is None else
                   [s for s in args.variants.split(',') if s not in ('', 'none')])
  args.model_variants = [s for s in args.model_variants.split(',') if s]
  return args


def main(argv=None) -> dict:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  res = dict(command='python -m experiments.benchmark ' +
             ' '.join(sys.argv[1:] if argv is None else argv),
             jax_version=jax.__version__, cpu_count=os.cpu_count(),
             memory_method=('device memory_stats peak_bytes_in_use'
                            if device_peak_bytes() is not None else
                            'xla_step_bytes: compiled memory_analysis '
                            '(arguments + outputs - donated + temporaries); '
                            'rss_delta_bytes: sampled process RSS growth '
                            'over build, compile and first two steps'),
             flops_method='analytic model FLOPs (3 x forward matmuls and '
             'attention); MFU vs float32 jnp.dot peak of the same rounds')
  res['machine'] = machine()
  if args.gpu_check:
    res.update(gpu_check(quick=args.quick))
  else:
    use_torch = not args.no_torch and torch_available()
    if not use_torch:
      res['torch_skipped'] = ('--no_torch' if args.no_torch else
                              'torch is not installed (pip install '
                              '".[bench]")')
    else:
      import torch  # pylint: disable=g-import-not-at-top
      res['torch_version'] = torch.__version__
      res['torch_threads'] = os.cpu_count()
    res['train'] = [bench_train(s, rounds=args.rounds,
                                variants={
                                    **(VARIANTS if s in args.variants else {}),
                                    **(MODEL_VARIANTS if s in
                                       args.model_variants else {})},
                                use_torch=use_torch, peak_n=args.peak_n)
                    for s in args.sizes]
    res['decode'] = [bench_decode(s, reps=args.decode_reps,
                                  use_torch=use_torch, length=args.decode_len,
                                  batch_size=args.decode_batch)
                     for s in args.decode_sizes]
  res['max_rss_bytes'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(format_tables(res))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(res, f, indent=1)
  return res


if __name__ == '__main__':
  main()
