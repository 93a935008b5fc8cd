"""The one-shot accelerator check (``--gpu_check``, or gpu_check.sh).

On a GPU: bf16 train MFU at the base and big sizes against the GPU's measured
bf16 matmul peak (with the fused attention kernels as variants), the library's
einsum attention vs ``jax.nn.dot_product_attention`` ('xla', 'cudnn'), and
cached decode throughput. Without a GPU, or with ``--quick``, the same at tiny
sizes in float32, and the result says it fell back.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmark.common import interleave
from experiments.benchmark.decode import bench_decode
from experiments.benchmark.train import bench_train


def bench_attention(*, batch: int, length: int, heads: int, head_dim: int,
                    dtype, reps: int, timing: dict | None = None) -> dict:
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
  times = interleave(runners, reps, **(timing or {}))
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
    timing = None   # interleave's defaults
  else:
    res['fell_back'] = (f'no GPU ({backend}): tiny sizes, float32' if not on_gpu
                        else 'quick mode: tiny sizes')
    sizes, dtype, peak_n, rounds = ('tiny',), 'float32', 256, 2
    train_shape = dict(tiny=(4, 16))
    attn = dict(batch=2, length=32, heads=2, head_dim=16,
                dtype=jnp.float32, reps=2)
    dec = dict(size='tiny', batch_size=2, reps=1, length=8)
    timing = dict(min_round_s=0.1, retries=1)   # as the CLI's --quick
  res['train'] = []
  for size in sizes:
    b, length = train_shape[size]
    # The main run uses the einsum attention; the fused kernels side by side.
    r = bench_train(size, rounds=rounds, use_torch=False,
                    variants=dict(xla_attention=dict(attention_impl='xla'),
                                  cudnn_attention=dict(
                                      attention_impl='cudnn')) if on_gpu
                    else dict(xla_attention=dict(attention_impl='xla')),
                    peak_n=peak_n, dtype=dtype, batch_size=b, length=length,
                    timing=timing)
    res['train'].append(r)
  res['attention'] = bench_attention(**attn, timing=timing)
  res['decode'] = [bench_decode(dec['size'], reps=dec['reps'],
                                use_torch=False, dtype=dtype,
                                batch_size=dec['batch_size'], naive=False,
                                length=dec.get('length', 64), timing=timing)]
  return res
