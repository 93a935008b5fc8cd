"""Our jitted train step, timed beside its variants, PyTorch and a matmul peak.

For one size: median step time, tokens/s, compile time and first step, memory
(XLA's compiled estimate, the device peak, resident-set growth), model FLOPs
per step and MFU per round against the ``jnp.dot`` peak of the same round,
the ratio to the PyTorch step where torch runs (with the package's passive
OpenMP waiting, ``torch``, and in a child process with OpenMP's default,
``torch_active``), the foreign CPU load of each run's rounds, and the ratio
to the yardstick ``flax_wmt``: google/flax ``examples/wmt``'s step on the
same sizes (:mod:`experiments.benchmark.flax_wmt`), timed in the same
rounds.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmark.common import (DROPOUT, LABEL_SMOOTHING, SIZES,
                                          CompiledStep, MatmulPeak, interleave,
                                          log, random_batch, ratios_vs,
                                          train_flops)
from experiments.benchmark.flax_wmt import FlaxWmtTrain
from experiments.benchmark.torch_reference import TorchTrain
from experiments.benchmark.torch_worker import TorchTrainWorker
from xfmr_jax import config as config_lib
from xfmr_jax import optim, train_state, train_steps
from xfmr_jax.model import Transformer

# Variants measured beside the main configuration (dropout 0.1, unrolled layers).
VARIANTS = {'no_dropout': dict(dropout_rate=0.0),
            'scan': dict(scan_layers=True),
            'remat': dict(remat=True)}
# The model variants (ModelConfig changes, or functions of the config):
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


class JaxTrain(CompiledStep):
  """Our jitted, state-donating train step on one fixed batch."""

  def __init__(self, cfg: config_lib.ModelConfig, batch: dict):
    self.cfg = cfg
    model = Transformer(cfg)
    tx = optim.make_optimizer(d_model=cfg.d_model, warmup_steps=4000)
    step, _ = train_steps.jit_steps(model, tx, LABEL_SMOOTHING)
    self.batch = jax.device_put(batch)
    self._compile(
        jax.jit(lambda: train_state.init_state(model, tx, seed=0)),
        lambda state: step.lower(state, self.batch))

  def __call__(self):
    self.state, metrics = self.compiled(self.state, self.batch)
    jax.block_until_ready(metrics)
    return metrics



def bench_train(size: str, *, rounds: int, variants, use_torch: bool,
                peak_n: int, dtype: str = 'float32',
                batch_size: int | None = None,
                length: int | None = None, flax_wmt: bool = True,
                timing: dict | None = None) -> dict:
  """One size's train step, timed side by side with its variants (True:
  VARIANTS; or a dict name -> ModelConfig changes or a function of the config
  returning them), the flax example's step (``flax_wmt``), torch and the
  matmul peak. A variant that cannot be built here is reported, not fatal.
  ``timing``: keyword arguments of ``interleave`` (``min_round_s``,
  ``retries``)."""
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
  if flax_wmt:
    log(f'[{size}] compiling flax_wmt (flax examples/wmt) ...')
    runners['flax_wmt'] = FlaxWmtTrain(cfg, batch)
  if use_torch:
    log(f'[{size}] building torch ...')
    runners['torch'] = TorchTrain(cfg, batch, sites='paper')
    runners['torch_default'] = TorchTrain(cfg, batch, sites='torch')
    log(f'[{size}] starting torch_active (OpenMP default wait, own process)')
    try:
      runners['torch_active'] = TorchTrainWorker(cfg, batch, sites='paper')
    except Exception as e:  # pylint: disable=broad-except
      unavailable['torch_active'] = f'{type(e).__name__}: {str(e)[-200:]}'
      log(f'[{size}] torch_active unavailable: {unavailable["torch_active"]}')
  runners['matmul'] = peak
  log(f'[{size}] timing {rounds} rounds ...')
  try:
    times = interleave(runners, rounds, **(timing or {}))
  finally:
    if 'torch_active' in runners:
      runners['torch_active'].close()
  peak_flops = peak.flops / np.array(times.pop('matmul'))
  flops = train_flops(cfg, batch_size, length, length)
  tokens = batch_size * length * 2   # source + target tokens per step
  out = dict(size=size, batch=batch_size, length=length, tokens_per_step=tokens,
             model=dataclasses.asdict(cfg), model_flops_per_step=flops,
             matmul_n=peak_n, matmul_peak_flops=float(np.median(peak_flops)),
             rounds=rounds, runs={}, unavailable=unavailable,
             load=times.rounds_info())
  for name, ts in times.items():
    ts = np.array(ts)
    run = runners[name]
    row = dict(step_s=float(np.median(ts)), step_s_all=ts.tolist(),
               tokens_per_s=float(tokens / np.median(ts)),
               first_step_s=run.first_step_s,
               foreign_load=times.load_summary(name),
               calls_per_round=times.calls[name])
    # MFU per round against the peak measured in the same round.
    row['mfu'] = float(np.median(flops / ts / peak_flops))
    if isinstance(run, (JaxTrain, FlaxWmtTrain)):
      row.update(compile_s=run.compile_s, memory=run.memory())
    else:
      row.update(memory=dict(rss_delta_bytes=run.rss_delta),
                 omp_wait_policy=getattr(run, 'omp_wait_policy',
                                         os.environ.get('OMP_WAIT_POLICY')))
    if isinstance(run, JaxTrain):
      row['model_changes'] = {k: v for k, v in dataclasses.asdict(
          configs[name]).items() if getattr(cfg, k) != v}
    out['runs'][name] = row
  out.update(ratios_vs(times))
  return out
