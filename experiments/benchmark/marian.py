"""Translation speed of an imported opus-mt-sized Marian model: this library's
jitted beam search against ``transformers``' ``generate``, in one run.

    python -m experiments.benchmark.marian [--sentences 256] [--json PATH]

One random ``MarianMTModel`` of opus-mt's shape (d_model 512, 6+6 layers, 8
heads, FFN 2048, vocabulary 58,101; ``--quick``: a tiny one) is built, converted with
:mod:`xfmr_jax.marian`, and both sides translate the same sentences (random
token ids, 20-40 words of about 1.3 pieces each) with beam 4 under the same
rules (:mod:`xfmr_jax.hf_beam`), in batches of the same sentences sorted by
length, up to the same number of new tokens. A random model seldom emits EOS,
so nearly every hypothesis runs to that length: both sides do the same
number of decoder steps. Needs torch and transformers.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from experiments import benchmark as package
from experiments.benchmark.report import write_json


def _user_omp_policy() -> str:
  """Give transformers the OpenMP wait policy its users run it with.

  The package sets passive waiting for the train-step rounds, where
  contenders share the machine (see ``experiments/benchmark/__init__.py``).
  Here ``generate`` runs alone, after our side, and passive waiting made it
  8-15% slower than OpenMP's default policy (the whole benchmark on the
  2-core Intel Xeon: 90.2 s against 78.3-83.3). OpenMP reads the policy when
  torch loads it, so the user's setting (usually none) is put back before
  torch is imported. Returns the policy in force, as the JSON records it.
  """
  if 'torch' in sys.modules:
    return 'as set when torch was first imported in this process'
  os.environ.pop('OMP_WAIT_POLICY', None)
  if package.USER_OMP_WAIT_POLICY is not None:
    os.environ['OMP_WAIT_POLICY'] = package.USER_OMP_WAIT_POLICY
  return package.USER_OMP_WAIT_POLICY or "OpenMP's default"


def _hf_model(args):
  import torch
  from transformers import MarianConfig, MarianMTModel
  torch.manual_seed(0)
  vocab, d, layers = args.vocab, args.d_model, args.layers
  config = MarianConfig(
      vocab_size=vocab, d_model=d, encoder_layers=layers,
      decoder_layers=layers, encoder_attention_heads=8,
      decoder_attention_heads=8, encoder_ffn_dim=4 * d,
      decoder_ffn_dim=4 * d, max_position_embeddings=512,
      activation_function='swish', scale_embedding=True,
      pad_token_id=vocab - 1, eos_token_id=0, decoder_start_token_id=vocab - 1,
      forced_eos_token_id=0)
  model = MarianMTModel(config).eval()
  model.generation_config.bad_words_ids = [[vocab - 1]]
  return model


def _sentences(n: int, vocab: int, seed: int = 0):
  """Marian ids: 20-40 words of ~1.3 pieces, then EOS (0)."""
  rng = np.random.default_rng(seed)
  lengths = (rng.integers(20, 41, n) * 1.3).astype(int)
  return [list(rng.integers(2, vocab - 1, k)) + [0] for k in lengths]


def _batches(sentences, batch_size):
  order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
  return [[sentences[i] for i in order[s:s + batch_size]]
          for s in range(0, len(order), batch_size)]


def _generated(rows, eos) -> int:
  """Tokens produced: up to and including the first EOS, per row."""
  total = 0
  for row in rows:
    row = list(row)
    total += row.index(eos) + 1 if eos in row else len(row)
  return total


def run_hf(model, batches, args) -> dict:
  import torch
  torch.set_num_threads(os.cpu_count())
  pad = model.config.pad_token_id
  tokens, start = 0, time.perf_counter()
  first = None
  with torch.no_grad():
    for batch in batches:
      width = max(map(len, batch))
      ids = torch.full((len(batch), width), pad, dtype=torch.long)
      for r, s in enumerate(batch):
        ids[r, :len(s)] = torch.tensor(s)
      t0 = time.perf_counter()
      out = model.generate(input_ids=ids, attention_mask=ids != pad,
                           num_beams=args.beam, max_new_tokens=args.max_new,
                           length_penalty=1.0, do_sample=False)
      first = first or time.perf_counter() - t0
      tokens += _generated(out[:, 1:].tolist(), 0)
  seconds = time.perf_counter() - start
  return dict(seconds=seconds, tokens=tokens, first_batch_seconds=first)


def run_ours(model, params, batches, perm_back, args) -> dict:
  import jax
  from xfmr_jax import hf_beam
  from xfmr_jax.token_ids import EOS
  from xfmr_jax.translate import Translator
  to_ours = np.argsort(perm_back)
  shaped = []
  for batch in batches:
    width = Translator.bucket(max(map(len, batch)), model.config.max_len)
    ids = np.zeros((args.batch_size, width), np.int32)
    for r, s in enumerate(batch):
      ids[r, :len(s)] = to_ours[np.asarray(s)]
    shaped.append((ids, len(batch)))
  compile_s = 0.0
  for width in sorted({ids.shape[1] for ids, _ in shaped}):
    ids = next(i for i, _ in shaped if i.shape[1] == width)
    # Compile time on its own (ahead of time: a difference of two timed
    # calls drowns in the noise of a shared machine), then a warm-up call.
    t0 = time.perf_counter()
    hf_beam.beam_search.lower(model, params, ids, beam_size=args.beam,
                              max_decode_len=args.max_new).compile()
    compile_s += time.perf_counter() - t0
    jax.block_until_ready(hf_beam.beam_search(
        model, params, ids, beam_size=args.beam, max_decode_len=args.max_new))
  tokens, start = 0, time.perf_counter()
  for ids, n in shaped:
    out, _ = hf_beam.beam_search(model, params, ids, beam_size=args.beam,
                                 max_decode_len=args.max_new)
    tokens += _generated(np.asarray(out)[:n].tolist(), EOS)
  seconds = time.perf_counter() - start
  return dict(seconds=seconds, tokens=tokens, compile_seconds=compile_s,
              buckets=sorted({ids.shape[1] for ids, _ in shaped}))


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog='python -m experiments.benchmark.marian')
  p.add_argument('--sentences', type=int, default=256)
  p.add_argument('--batch_size', type=int, default=64)
  p.add_argument('--beam', type=int, default=4)
  p.add_argument('--max_new', type=int, default=64,
                 help='new tokens per sentence (generate max_new_tokens)')
  p.add_argument('--vocab', type=int, default=58_101)
  p.add_argument('--d_model', type=int, default=512)
  p.add_argument('--layers', type=int, default=6)
  p.add_argument('--json', default=None)
  p.add_argument('--quick', action='store_true',
                 help='a tiny model and a few sentences (for tests)')
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  if args.quick:
    args.vocab, args.d_model, args.layers = 300, 32, 1
    args.sentences, args.batch_size, args.max_new = 8, 4, 4
  import jax
  from xfmr_jax import config as config_lib, marian, model as model_lib
  from xfmr_jax.marian_tokenizer import id_permutation
  omp_policy = _user_omp_policy()
  hf = _hf_model(args)
  cfg = hf.config
  fields = marian.model_fields(cfg.to_dict())
  perm = id_permutation(cfg.pad_token_id, 0, 1, cfg.vocab_size)
  tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
  params = jax.tree.map(jax.numpy.asarray, marian.convert_params(
      tensors, fields, cfg.vocab_size, perm))
  ours = model_lib.build(config_lib.ModelConfig(vocab_size=cfg.vocab_size,
                                                **fields))
  batches = _batches(_sentences(args.sentences, cfg.vocab_size),
                     args.batch_size)
  res = dict(command='python -m experiments.benchmark.marian ' +
             ' '.join(sys.argv[1:] if argv is None else argv),
             sentences=args.sentences, beam=args.beam, max_new=args.max_new,
             batch_size=args.batch_size, cpu_count=os.cpu_count())
  res['ours'] = run_ours(ours, params, batches, perm, args)
  res['hf'] = run_hf(hf, batches, args)
  res['hf']['omp_wait_policy'] = omp_policy
  for side in ('ours', 'hf'):
    r = res[side]
    r['sentences_per_sec'] = args.sentences / r['seconds']
    r['tokens_per_sec'] = r['tokens'] / r['seconds']
  res['speedup'] = res['ours']['sentences_per_sec'] / res['hf'][
      'sentences_per_sec']
  print(f"| | sentences/s | tokens/s | seconds | first call |\n|---|---|---|---|---|\n"
        f"| xfmr_jax (jit, hf_beam) | {res['ours']['sentences_per_sec']:.2f} | "
        f"{res['ours']['tokens_per_sec']:.0f} | {res['ours']['seconds']:.1f} | "
        f"compile {res['ours']['compile_seconds']:.1f} s for buckets "
        f"{res['ours']['buckets']} |\n"
        f"| transformers generate | {res['hf']['sentences_per_sec']:.2f} | "
        f"{res['hf']['tokens_per_sec']:.0f} | {res['hf']['seconds']:.1f} | "
        f"first batch {res['hf']['first_batch_seconds']:.1f} s |\n"
        f"\nspeedup (sentences/s): {res['speedup']:.2f}x; torch's OpenMP wait "
        f"policy: {omp_policy}")
  if args.json:
    write_json(res, args.json)
  return res


if __name__ == '__main__':
  package.no_compilation_cache()
  main()
