"""Would int8 weights pay on this backend? One product three ways.

    python -m experiments.benchmark.int8_matmul [--rows 256] [--calls 20]

For the shapes of an opus-mt-sized beam-4 step (``--rows`` rows of d_model
512 times the FFN's ``[512, 2048]`` and the output projection's
``[512, 58101]``), times in alternating rounds: the float32 product; int8
weights with per-output-channel scales, converted to float32 inside the jitted
product (float32 accumulation); and int8 activations (per-row scales) times
int8 weights accumulated in int32. The median milliseconds per call of each.
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmark.common import machine

SHAPES = ((512, 2048), (512, 58_101))


def _quantize(x, axis):
  """Symmetric int8 along ``axis`` and its float32 scales."""
  scale = jnp.maximum(jnp.max(jnp.abs(x), axis, keepdims=True), 1e-12) / 127
  return jnp.round(x / scale).astype(jnp.int8), scale


@jax.jit
def float32(x, w, q, w_scale):
  return x @ w


@jax.jit
def int8_weights(x, w, q, w_scale):
  return (x @ q.astype(jnp.float32)) * w_scale


@jax.jit
def int8_both(x, w, q, w_scale):
  xq, x_scale = _quantize(x, 1)
  acc = jax.lax.dot_general(xq, q, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.int32)
  return acc.astype(jnp.float32) * x_scale * w_scale


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog='python -m experiments.benchmark.int8_matmul')
  p.add_argument('--rows', type=int, default=256)
  p.add_argument('--calls', type=int, default=20)
  p.add_argument('--rounds', type=int, default=3)
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  rng = np.random.default_rng(0)
  res = dict(machine=machine(), rows=args.rows, shapes={})
  print(f'{res["machine"]}; [{args.rows} x k] x [k x n], median ms a call\n'
        '| k x n | float32 | int8 weights, float32 accumulation | '
        'int8 x int8, int32 accumulation |\n|---|---:|---:|---:|')
  for k, n in SHAPES:
    x = jnp.asarray(rng.standard_normal((args.rows, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
    q, w_scale = _quantize(w, 0)
    fns = dict(float32=float32, int8_weights=int8_weights, int8_both=int8_both)
    times = {name: [] for name in fns}
    for fn in fns.values():
      jax.block_until_ready(fn(x, w, q, w_scale))
    for r in range(args.rounds):
      for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
        for _ in range(args.calls):
          t0 = time.perf_counter()
          jax.block_until_ready(fns[name](x, w, q, w_scale))
          times[name].append(1e3 * (time.perf_counter() - t0))
    ms = {name: float(np.median(v)) for name, v in times.items()}
    res['shapes'][f'{k}x{n}'] = ms
    print(f"| {k} x {n} | {ms['float32']:.2f} | {ms['int8_weights']:.2f} | "
          f"{ms['int8_both']:.2f} |")
  return res


if __name__ == '__main__':
  main()
