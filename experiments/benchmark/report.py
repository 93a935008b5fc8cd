"""The results as text tables (printed) and as JSON (``--json PATH``).

The tables show, per size, each train run's step time, tokens/s, ratio to
PyTorch, MFU, compile time, model GFLOP, matmul peak and memory, and our
step's ratio to the flax example's (``flax_wmt``); each decode run's tokens/s,
its speed-up over the uncached loops and, for beam 4, over the flax example's
beam search (``flax_wmt_beam4``); and, in the GPU
check, each attention implementation's forward + backward time and TFLOP/s.
"""
from __future__ import annotations

import json


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
      if 'ratio_vs_flax_wmt' in r:
        lines.append(f"{r['size']:6} main vs flax_wmt (flax examples/wmt "
                     f"step, same rounds): "
                     f"{r['ratio_vs_flax_wmt']['main']:.2f}x")
    lines.append('')
  if res.get('decode'):
    lines.append('decoding (generated tokens/s; output length '
                 f"{res['decode'][0]['output_length']})")
    hdr = (f"{'size':6} {'batch':>5} {'run':20} {'tok/s':>9} {'s':>8} "
           f"{'cached/naive':>12} {'cached/torch':>12} {'vs flax_wmt':>11}")
    lines += [hdr, '-' * len(hdr)]
    for r in res['decode']:
      for name, row in r['runs'].items():
        a = (f"{r['cached_vs_naive']:.1f}x" if name == 'greedy_cached' and
             'cached_vs_naive' in r else '')
        b = (f"{r['cached_vs_torch_naive']:.1f}x" if name == 'greedy_cached'
             and 'cached_vs_torch_naive' in r else '')
        c = (f"{r['beam4_vs_flax_wmt']:.2f}x" if name == 'beam4_cached' and
             'beam4_vs_flax_wmt' in r else '')
        lines.append(f"{r['size']:6} {r['batch']:5} {name:20} "
                     f"{row['tokens_per_s']:9.1f} {row['seconds']:8.2f} "
                     f"{a:>12} {b:>12} {c:>11}")
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


def write_json(res: dict, path: str) -> None:
  with open(path, 'w') as f:
    json.dump(res, f, indent=1)
