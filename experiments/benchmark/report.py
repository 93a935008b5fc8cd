"""The results as text tables (printed) and as JSON (``--json PATH``).

The tables show, per size, each train run's step time, tokens/s, ratio to
PyTorch, MFU, compile time, model GFLOP, matmul peak and memory, and our
step's ratio to the flax example's (``flax_wmt``) and to PyTorch with
OpenMP's default wait policy (``torch_active``); each decode run's tokens/s,
its speed-up over the uncached loops and, for beam 4, over the flax example's
beam search (``flax_wmt_beam4``), and a line on batch-1 greedy latency
against reading the weights once; and, in the GPU check, each attention
implementation's forward + backward time and TFLOP/s. The ``fgn`` column is
the median foreign CPU load (busy cores of other jobs) during a run's timed
windows; a warning follows a table whose kept rounds were still disturbed.
"""
from __future__ import annotations

import json


def _mb(b):
  return '-' if b is None else f'{b / 2 ** 20:.0f}'


def _fgn(row) -> str:
  load = row.get('foreign_load')
  return '-' if not load else f"{load['median']:.2f}"


def _load_lines(r: dict, what: str) -> list:
  """Retries and, when kept rounds were still disturbed, a warning."""
  info = r.get('load') or {}
  if not info.get('measured'):
    return []
  lines = []
  if info['retried']:
    lines.append(f"{r['size']:6} {what}: {info['retried']} disturbed round(s) "
                 f"run again (foreign load > {info['threshold']} core)")
  if info['disturbed_kept']:
    lines.append(f"{r['size']:6} WARNING {what}: {info['disturbed_kept']} of "
                 f"{info['rounds']} kept rounds still disturbed (foreign load "
                 f"up to {info['max_foreign_load']:.2f} cores > "
                 f"{info['threshold']}); its timings are not trustworthy")
  return lines


def format_tables(res: dict) -> str:
  lines = [f"machine: {res['machine']}", '']
  if res.get('train'):
    isolated = any(r.get('isolated') for r in res['train'])
    lines.append('train step (median of alternating rounds; dropout 0.1 '
                 'unless noted' + ('; each contender in a process of its '
                                   'own, one at a time)' if isolated else ')'))
    hdr = (f"{'size':6} {'run':19} {'step ms':>9} {'tok/s':>8} "
           f"{'vs torch':>8} {'MFU':>6} {'compile s':>9} {'GFLOP':>7} "
           f"{'peak GF/s':>9} {'xla MB':>7} {'rss MB':>7} {'fgn':>5}")
    lines += [hdr, '-' * len(hdr)]
    for r in res['train']:
      ratios = r.get('ratio_vs_torch', {})
      for name, row in r['runs'].items():
        mem = row['memory']
        ratio = f"{ratios[name]:.2f}x" if name in ratios else '-'
        comp = f"{row['compile_s']:.1f}" if 'compile_s' in row else '-'
        lines.append(
            f"{r['size']:6} {name:19} {row['step_s'] * 1e3:9.1f} "
            f"{row['tokens_per_s']:8.0f} {ratio:>8} {row['mfu']:6.1%} "
            f"{comp:>9} {r['model_flops_per_step'] / 1e9:7.1f} "
            f"{r['matmul_peak_flops'] / 1e9:9.1f} "
            f"{_mb(mem.get('xla_step_bytes')):>7} "
            f"{_mb(mem.get('rss_delta_bytes')):>7} {_fgn(row):>5}")
      for name, why in r.get('unavailable', {}).items():
        lines.append(f"{r['size']:6} {name:19} unavailable: {why[:80]}")
      if 'ratio_vs_torch_default' in r:
        lines.append(f"{r['size']:6} main vs torch_default (nn.Transformer's "
                     f"own dropout sites): "
                     f"{r['ratio_vs_torch_default']['main']:.2f}x")
      if 'ratio_vs_torch_active' in r:
        policy = r['runs']['torch_active'].get('omp_wait_policy') or 'unset'
        lines.append(f"{r['size']:6} main vs torch_active (PyTorch in its own "
                     f"process, OMP_WAIT_POLICY {policy}; torch above: "
                     f"PASSIVE): {r['ratio_vs_torch_active']['main']:.2f}x")
      if 'ratio_vs_flax_wmt' in r:
        lines.append(f"{r['size']:6} main vs flax_wmt (flax examples/wmt "
                     f"step, same rounds): "
                     f"{r['ratio_vs_flax_wmt']['main']:.2f}x")
      lines += _load_lines(r, 'train')
    lines.append('')
  if res.get('decode'):
    lines.append('decoding (generated tokens/s; output length '
                 f"{res['decode'][0]['output_length']})")
    hdr = (f"{'size':6} {'batch':>5} {'run':20} {'tok/s':>9} {'s':>8} "
           f"{'cached/naive':>12} {'cached/torch':>12} {'vs flax_wmt':>11} "
           f"{'fgn':>5}")
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
                     f"{a:>12} {b:>12} {c:>11} {_fgn(row):>5}")
      if 'batch1' in r:
        b1 = r['batch1']
        lines.append(
            f"{r['size']:6} batch-1 greedy: {b1['ms_per_token']:.3f} ms/token;"
            f" params {b1['param_bytes'] / 1e6:.1f} MB at "
            f"{b1['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (jnp.sum of "
            f"{b1['bandwidth_read_bytes'] / 2 ** 20:.0f} MB) = "
            f"{b1['weights_once_ms']:.3f} ms read once; latency / that "
            f"{b1['latency_vs_weights_once']:.2f}x (target <= "
            f"{b1['target']}x)")
      lines += _load_lines(r, 'decode')
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
