"""The benchmark and the GPU check run end to end in a tiny quick mode."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmark import cli, common, flax_wmt, flax_wmt_beam
from experiments.benchmark import torch_reference
from experiments.benchmark import train as train_bench
from xfmr_jax import config as config_lib
from xfmr_jax.token_ids import EOS, PAD, UNK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_train(row, with_torch):
  assert row['model_flops_per_step'] > 0 and row['matmul_peak_flops'] > 0
  main = row['runs']['main']
  for key in ('step_s', 'tokens_per_s', 'mfu', 'compile_s', 'first_step_s'):
    assert main[key] > 0, key
  assert main['mfu'] < 2.0   # sane: the step cannot beat the matmul peak by 2x
  assert main['tokens_per_s'] == pytest.approx(
      row['tokens_per_step'] / main['step_s'])
  assert main['memory']['xla_step_bytes'] > 0
  assert ('torch' in row['runs']) == with_torch
  assert ('torch_default' in row['runs']) == with_torch
  # PyTorch also with OpenMP's default wait policy, in a process of its own.
  assert ('torch_active' in row['runs']) == with_torch
  if with_torch:
    assert row['ratio_vs_torch']['main'] > 0
    assert row['ratio_vs_torch_default']['main'] > 0
    assert row['ratio_vs_torch_active']['main'] > 0
    assert row['runs']['torch']['omp_wait_policy'] == 'PASSIVE'
    assert row['runs']['torch_active']['step_s'] > 0
  # Every run: foreign load of its kept rounds, calls per timed window.
  for run in row['runs'].values():
    assert run['calls_per_round'] >= 1
    load = run['foreign_load']
    assert load is None or load['median'] <= load['max']
  assert row['load']['rounds'] == row['rounds']
  assert 0 <= row['load']['disturbed_kept'] <= row['rounds']


def test_benchmark_quick(tmp_path, capsys):
  path = tmp_path / 'bench.json'
  res = cli.main(['--quick', '--json', str(path)])
  printed = capsys.readouterr().out
  on_disk = json.loads(path.read_text())
  assert on_disk['train'][0]['size'] == 'tiny'
  with_torch = torch_reference.torch_available()
  assert ('torch_skipped' in on_disk) != with_torch
  _check_train(on_disk['train'][0], with_torch)
  dec = on_disk['decode'][0]
  for name in ('greedy_cached', 'beam4_cached', 'greedy_naive'):
    run = dec['runs'][name]
    assert run['tokens_per_s'] > 0
    assert 0 < run['generated_tokens'] <= dec['batch'] * dec['output_length']
  assert dec['cached_vs_naive'] > 0
  # Batch-1 greedy against reading the weights once, from the same rounds.
  b1 = dec['batch1']
  assert b1['generated_tokens'] == dec['output_length']
  for key in ('ms_per_token', 'bandwidth_bytes_per_s', 'weights_once_ms',
              'latency_vs_weights_once', 'param_bytes'):
    assert b1[key] > 0, key
  assert b1['bandwidth_read_bytes'] >= 256 * 2 ** 20
  assert b1['weights_once_ms'] == pytest.approx(
      b1['param_bytes'] / b1['bandwidth_bytes_per_s'] * 1e3, rel=0.5)
  assert 'batch-1 greedy' in printed and 'ms/token' in printed
  # The yardstick: the flax example's step and beam search, same rounds.
  flax_row = on_disk['train'][0]['runs']['flax_wmt']
  assert flax_row['tokens_per_s'] > 0 and flax_row['compile_s'] > 0
  assert flax_row['mfu'] > 0 and flax_row['memory']['xla_step_bytes'] > 0
  assert on_disk['train'][0]['ratio_vs_flax_wmt']['main'] > 0
  yard = dec['runs']['flax_wmt_beam4']
  # The zeroed EOS embedding: every row emits all of its tokens.
  assert yard['generated_tokens'] == dec['batch'] * dec['output_length']
  assert yard['tokens_per_s'] > 0 and yard['first_call_s'] > 0
  assert dec['beam4_vs_flax_wmt'] == pytest.approx(
      dec['runs']['beam4_cached']['tokens_per_s'] / yard['tokens_per_s'])
  for line in ('main vs flax_wmt', 'flax_wmt_beam4', 'vs flax_wmt', 'fgn') + (
      ('main vs torch_active',) if with_torch else ()):
    assert line in printed, line
  assert 'machine' in res and 'memory_method' in res
  # No variants unless asked for (the test below runs two).
  assert not set(train_bench.VARIANTS) & set(on_disk['train'][0]['runs'])


def test_variants_are_the_main_model_with_their_changes():
  # The CLI picks the variants per size; each runs in the same rounds.
  assert cli.parse_args(['--quick', '--variants', 'tiny']).variants == [
      'tiny']
  assert cli.parse_args(['--model_variants', 'toy']).model_variants == [
      'toy']
  picked = {'scan': train_bench.VARIANTS['scan'],
            'swiglu': train_bench.MODEL_VARIANTS['swiglu']}
  row = train_bench.bench_train('tiny', rounds=1, variants=picked,
                                use_torch=False, peak_n=64,
                                timing=dict(min_round_s=0.05, retries=0))
  d_ff = common.SIZES['tiny']['model']['d_ff']
  assert row['runs']['main']['model_changes'] == {}
  assert row['runs']['scan']['model_changes'] == dict(scan_layers=True)
  assert row['runs']['swiglu']['model_changes'] == dict(
      activation='swiglu', d_ff=config_lib.swiglu_d_ff(d_ff))
  assert all(row['runs'][k]['step_s'] > 0 for k in ('scan', 'swiglu'))
  assert not row['unavailable']


def test_without_torch_it_says_so(monkeypatch):
  monkeypatch.setattr(cli, 'torch_available', lambda: False)
  res = cli.main(['--sizes', '', '--variants', 'none'])
  assert 'not installed' in res['torch_skipped']
  assert res['train'] == [] and res['decode'] == []
  with pytest.raises(SystemExit):
    cli.parse_args(['--sizes', 'huge'])


def test_flops_count():
  cfg = config_lib.ModelConfig(**common.SIZES['base']['model'])
  flops = common.train_flops(cfg, 16, 64, 64)
  # 6 * (matmul parameters) * tokens dominates: ~44M decoder+encoder weights
  # seen by 1024 tokens each side, plus the 16.4M-weight output projection.
  assert 3.0e11 < flops < 4.5e11


@pytest.mark.slow
def test_gpu_check_falls_back_on_cpu(tmp_path):
  path = tmp_path / 'gpu.json'
  env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS='cpu')
  proc = subprocess.run(
      ['bash', os.path.join(ROOT, 'experiments', 'gpu_check.sh'), '--quick',
       '--json', str(path)], env=env, capture_output=True, text=True,
      timeout=240)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert 'fell back' in proc.stdout
  res = json.loads(path.read_text())
  assert res['mode'] == 'gpu_check' and res['backend'] == 'cpu'
  assert 'fell_back' in res
  train = res['train'][0]
  assert train['runs']['main']['mfu'] > 0
  impls = res['attention']['impls']
  assert impls['reference_einsum']['available']
  assert impls['jax_nn_xla']['available']
  assert impls['jax_nn_xla']['max_abs_grad_diff_vs_reference'] < 1e-3
  assert not impls['jax_nn_cudnn']['available']   # no cuDNN on a CPU
  assert res['decode'][0]['runs']['greedy_cached']['tokens_per_s'] > 0


def _paper_sites_off(model):
  """Zero the dropout of the paper's sites: embeddings and sublayer outputs."""
  model.drop.p = 0.0
  for layer in [*model.core.encoder.layers, *model.core.decoder.layers]:
    for name in ('dropout1', 'dropout2', 'dropout3'):
      if hasattr(layer, name):
        getattr(layer, name).p = 0.0


@pytest.mark.parametrize('sites', torch_reference.TORCH_DROPOUT_SITES)
def test_torch_model_drops_out_where_ours_does(sites):
  """The PyTorch model compared with ours drops out only at the paper's sites
  ('paper'); nn.Transformer's defaults ('torch') drop out elsewhere too."""
  torch = pytest.importorskip('torch')
  cfg = config_lib.ModelConfig(**common.SIZES['tiny']['model'],
                               dropout_rate=0.3)
  batch = common.random_batch(cfg.vocab_size, 4, 16)
  src, tgt = (torch.from_numpy(batch[k]).long() for k in ('inputs', 'targets'))
  torch.manual_seed(0)
  model = torch_reference._torch_model(cfg, 0.3, sites)
  run = lambda train: model.train(train)(src, tgt)
  assert not torch.allclose(run(True), run(False))   # the paper's sites drop
  _paper_sites_off(model)
  same = torch.allclose(run(True), run(False), atol=1e-5)
  assert same == (sites == 'paper')
  with pytest.raises(ValueError, match='dropout sites'):
    torch_reference._torch_model(cfg, 0.3, 'everywhere')


def test_data_pipeline_benchmark_quick(tmp_path):
  from experiments.benchmark import data_pipeline
  out = data_pipeline.main([
      '--pairs', '3000', '--dir', str(tmp_path / 'corpus'), '--vocab_size',
      '500', '--tokenizer_sentences', '2000', '--batch_size', '8',
      '--max_length', '64', '--batches', '3', '--resume_after', '2',
      '--json', str(tmp_path / 'data.json')])
  assert json.load(open(tmp_path / 'data.json'))['pairs'] == 3000
  lines = (tmp_path / 'corpus' / 'train.tsv').read_text().splitlines()
  assert len(lines) == 3000 and all(l.count('\t') == 1 for l in lines)
  for kind in ('array_record', 'tsv'):
    for packer in ('ours', 'grain_first_fit'):
      r = out[kind][packer]
      assert r['exact'], (kind, packer)  # resumed mid-epoch, same batches
      assert 0.5 < r['packing_efficiency'] <= 1 and r['tokens_per_s'] > 0


@pytest.mark.slow
def test_long_attention_benchmark_writes_its_table_plot_and_json(tmp_path):
  from experiments.benchmark import long_attention
  out = str(tmp_path / 'la')
  report = long_attention.main(['--ns', '64,128', '--reps', '1',
                                '--max_fit_n', '256', '--out', out])
  layer = report['results']['layer']
  assert set(layer) == set(long_attention.KINDS)
  for row in layer.values():
    assert row['n'] == [64, 128] and all(t > 0 for t in row['seconds'])
    assert row['largest_n_that_fits'] == 256
  assert all(b > 0 for row in layer.values() for b in row['bytes'])
  assert json.loads(open(out + '.json').read())['results'].keys() == {
      'layer', 'model'}
  assert '| full |' in open(out + '.table.md').read()
  assert os.path.getsize(out + '.png') > 10_000


# ------------------------------------------------- the flax_wmt yardstick --

@pytest.fixture(scope='module')
def flax_wmt_tiny():
  """The yardstick at the 'tiny' size: config, decode params (EOS embedding
  zeroed) and inputs [2, 12]. The embedding is scaled down: at full scale a
  random model's residual stream is mostly the previous token's embedding,
  and it repeats one token whatever the rest computes."""
  cfg = config_lib.ModelConfig(**common.SIZES['tiny']['model'])
  wcfg = flax_wmt.WmtConfig.from_model_config(cfg)
  params = flax_wmt_beam.decode_params(wcfg, 16)
  params['shared_embedding']['embedding'] *= 0.3
  inputs = common.random_batch(wcfg.vocab_size, 2, 12, seed=1)['inputs']
  return wcfg, params, jnp.asarray(inputs)


_full_logits = jax.jit(flax_wmt.full_logits, static_argnums=0)


def test_flax_wmt_cached_decoder_matches_its_full_decoder(flax_wmt_tiny):
  wcfg, params, inputs = flax_wmt_tiny
  targets = jnp.asarray(common.random_batch(wcfg.vocab_size, 2, 10,
                                            seed=2)['targets'])
  targets = targets.at[:, -1].set(EOS)
  full = _full_logits(wcfg, params, inputs, targets)
  dcfg = dataclasses.replace(wcfg, decode=True)
  cache = flax_wmt_beam.init_cache(dcfg, 2, inputs.shape[1], targets.shape[1])
  step = jax.jit(flax_wmt_beam.token_logits_fn(dcfg, params, inputs, 1))
  previous = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]   # start symbol 0
  cached = []
  for t in range(targets.shape[1]):
    logits, cache = step(previous[:, t:t + 1], cache)
    cached.append(logits)
  np.testing.assert_allclose(np.stack(cached, axis=1), full, atol=1e-5)


def _log_prob_and_length(wcfg, params, inputs, tokens):
  """Per row: the full model's log-prob of ``tokens`` [b, n] up to and
  including EOS (the pad column masked, as in the search) and that length."""
  logits = np.array(_full_logits(wcfg, params, inputs, jnp.asarray(tokens)))
  logits[..., PAD] = -np.inf
  logp = np.asarray(jax.nn.log_softmax(logits))
  ends = [list(row).index(EOS) + 1 if EOS in row else len(row)
          for row in tokens]
  return [logp[i, np.arange(n), tokens[i, :n]].sum()
          for i, n in enumerate(ends)], ends


def test_flax_wmt_beam_search_is_greedy_at_one_beam_and_scores_its_pick(
    flax_wmt_tiny):
  wcfg, params, inputs = flax_wmt_tiny
  length = 10
  tokens, _ = flax_wmt_beam.beam_decode(wcfg, params, inputs, beam_size=1,
                                        max_decode_len=length)
  # Plain greedy over the uncached model; undecided slots hold a non-pad
  # placeholder (a pad target would mask its own position).
  out = np.full((inputs.shape[0], length), UNK, np.int32)
  for t in range(length):
    logits = np.array(_full_logits(wcfg, params, inputs, jnp.asarray(out)))
    logits[:, t, PAD] = -np.inf
    out[:, t] = logits[:, t].argmax(-1)
  np.testing.assert_array_equal(tokens, out)
  assert EOS not in out   # the zeroed EOS embedding is never picked

  # Beam 4: no row finishes, so each falls back to its live best, scored by
  # its raw log-prob. With EOS made likely near position 4 (its embedding a
  # position's), rows finish and score log-prob / ((5 + len) / 6) ** 0.6.
  table = params['shared_embedding']['embedding']
  eos_late = jax.tree.map(lambda x: x, params)
  eos_late['shared_embedding']['embedding'] = table.at[EOS].set(
      0.5 * flax_wmt.sinusoids(16, wcfg.d_model)[0, 4])
  batch = jnp.asarray(common.random_batch(wcfg.vocab_size, 4, 12,
                                          seed=1)['inputs'])
  finished, lengths = 0, []
  for p, src in ((params, inputs), (eos_late, batch)):
    tokens, scores = flax_wmt_beam.beam_decode(wcfg, p, src, beam_size=4,
                                               max_decode_len=length)
    tokens = np.asarray(tokens)
    log_probs, ends = _log_prob_and_length(wcfg, p, src, tokens)
    lengths += ends
    for row, logp, n, score in zip(tokens, log_probs, ends, scores):
      done = EOS in row
      finished += done
      want = logp / ((5.0 + n) / 6.0) ** 0.6 if done else logp
      assert float(score) == pytest.approx(want, abs=1e-4)
      assert not row[n:].any()   # 0 after EOS
  assert finished > 0 and 1 < min(lengths) < length


def test_int8_products_approximate_the_float32_one():
  """The int8 probe times products that compute the float32 one up to the
  rounding of symmetric int8 (a float64 reference)."""
  from experiments.benchmark import int8_matmul as probe
  rng = np.random.default_rng(3)
  x = rng.standard_normal((8, 64)).astype(np.float32)
  w = (rng.standard_normal((64, 96)) / 8).astype(np.float32)
  q, scale = probe._quantize(jnp.asarray(w), 0)
  assert q.dtype == jnp.int8 and int(jnp.max(jnp.abs(q))) == 127
  want = x.astype(np.float64) @ w.astype(np.float64)
  for fn, tol in ((probe.float32, 1e-4), (probe.int8_weights, 0.03),
                  (probe.int8_both, 0.05)):
    got = np.asarray(fn(jnp.asarray(x), jnp.asarray(w), q, scale))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < tol, (fn, err)
  # Rounding does cost something: the int8 paths are not exact.
  assert np.abs(np.asarray(probe.int8_both(jnp.asarray(x), jnp.asarray(w),
                                           q, scale)) - want).max() > 1e-4
