"""Translation engines on one opus-mt-shaped model: this library, CTranslate2
(float32 and int8) and transformers' ``generate``, side by side in one run.

    python -m experiments.benchmark.engines [--size opus_mt|toy] \\
        [--sentences 128] [--rounds 2] [--json PATH]

One random ``MarianMTModel`` of opus-mt's shape (d_model 512, 6+6 layers,
vocabulary 58,101; ``--size toy``: the toy recipe's shape; ``--quick``: a
tiny one) is saved, converted with
CTranslate2's ``TransformersConverter`` to float32 and int8 (its converter
asks for a tokenizer; a random model has none, so a stand-in names token ``i``
``t{i}``), and imported here (:mod:`xfmr_jax.marian`). Every engine
translates the same sentences (random token ids, 20-40 words of about 1.3 pieces each), in
the same batches sorted by length, with beam 4 up to the same number of new
tokens; a random model seldom emits EOS, so every engine does about the same
number of decoder steps. The rounds alternate the engines' order; each
engine's compile or load happens before the rounds and its first batch runs
once untimed. transformers runs ``--hf_rounds`` rounds (it is the slowest).

Reported per engine: tokens/s and sentences/s per round, the bytes of its
model (parameters in memory; CTranslate2's ``model.bin``), the peak resident
memory of a process that loads that engine alone and translates one batch
(VmHWM, a child process per engine), and the token agreement with
this library's float32 output and, for CTranslate2's int8, with its float32
(positions equal up to the longer of the two, in the same ids). CTranslate2 and torch get the user's OpenMP wait
policy (:func:`user_omp_policy`); CTranslate2 runs one translator with
all cores (``intra_threads``). Needs torch, transformers and ctranslate2.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from experiments import benchmark as package
from experiments.benchmark.common import machine
from experiments.benchmark.report import write_json

ENGINES = ('xfmr_jax', 'ct2_float32', 'ct2_int8', 'transformers')
# (vocabulary, d_model, layers each side, heads); FFN 4 * d_model. The toy
# recipe's model cannot leave as a Marian model (its interleaved sinusoids),
# so ``toy`` is a random model of its shape, with Marian's conventions.
SIZES = {'opus_mt': (58_101, 512, 6, 8), 'toy': (1000, 192, 2, 4)}


def user_omp_policy() -> str:
  """Give torch and CTranslate2 the OpenMP wait policy their users run with.

  The package sets passive waiting for the train-step rounds, where
  contenders share the machine (see ``experiments/benchmark/__init__.py``).
  Here each engine runs alone, and passive waiting made ``generate`` 8-15%
  slower than OpenMP's default policy. OpenMP reads the policy when it
  loads, so the user's setting (usually none) is put back before torch or
  CTranslate2 is imported. Returns the policy in force, as the JSON records.
  """
  if 'torch' in sys.modules or 'ctranslate2' in sys.modules:
    return 'as set when OpenMP was first loaded in this process'
  os.environ.pop('OMP_WAIT_POLICY', None)
  if package.USER_OMP_WAIT_POLICY is not None:
    os.environ['OMP_WAIT_POLICY'] = package.USER_OMP_WAIT_POLICY
  return package.USER_OMP_WAIT_POLICY or "OpenMP's default"


def hf_model(args):
  """A random ``MarianMTModel`` of ``args.vocab``, ``args.d_model``,
  ``args.layers``, ``args.heads``, FFN ``4 * d_model`` (opus-mt's
  conventions: EOS 0, pad = decoder start = the last id, which ``generate``
  may not emit)."""
  import torch
  from transformers import MarianConfig, MarianMTModel
  torch.manual_seed(0)
  vocab, d, layers, heads = args.vocab, args.d_model, args.layers, args.heads
  config = MarianConfig(
      vocab_size=vocab, d_model=d, encoder_layers=layers,
      decoder_layers=layers, encoder_attention_heads=heads,
      decoder_attention_heads=heads, encoder_ffn_dim=4 * d,
      decoder_ffn_dim=4 * d, max_position_embeddings=512,
      activation_function='swish', scale_embedding=True,
      pad_token_id=vocab - 1, eos_token_id=0, decoder_start_token_id=vocab - 1,
      forced_eos_token_id=0)
  model = MarianMTModel(config).eval()
  model.generation_config.bad_words_ids = [[vocab - 1]]
  return model


def sentences(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
  """Marian ids: 20-40 words of ~1.3 pieces, then EOS (0)."""
  rng = np.random.default_rng(seed)
  lengths = (rng.integers(20, 41, n) * 1.3).astype(int)
  return [[int(i) for i in rng.integers(2, vocab - 1, k)] + [0]
          for k in lengths]


def batches_by_length(rows, batch_size):
  order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
  return [[rows[i] for i in order[s:s + batch_size]]
          for s in range(0, len(order), batch_size)]


def _token(i: int) -> str:
  return f't{i}'


class _Vocabulary:
  """What CTranslate2's Marian converter reads from a tokenizer."""
  eos_token, unk_token = '</s>', '<unk>'

  def __init__(self, size: int):
    names = [self.eos_token, self.unk_token] + [
        _token(i) for i in range(2, size - 1)] + ['<pad>']
    self._vocab = {name: i for i, name in enumerate(names)}

  def get_vocab(self):
    return dict(self._vocab)


def _name(hf_id: int) -> str:
  return '</s>' if hf_id == 0 else '<unk>' if hf_id == 1 else _token(hf_id)


def convert_ct2(hf_dir: str, out_dir: str, quantization: str, vocab: int):
  """CTranslate2's conversion of the saved model, with the stand-in
  vocabulary as its tokenizer."""
  from ctranslate2.converters import TransformersConverter

  class Converter(TransformersConverter):
    def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
      return _Vocabulary(vocab)

  Converter(hf_dir).convert(out_dir, quantization=quantization, force=True)
  return out_dir


class Ours:
  """This library's jitted beam search under ``generate``'s rules."""

  def __init__(self, hf_dir, args):
    import jax
    from safetensors.numpy import load_file
    from xfmr_jax import config as config_lib, marian, model as model_lib
    from xfmr_jax.marian_tokenizer import id_permutation
    with open(os.path.join(hf_dir, 'config.json')) as f:
      hf_config = json.load(f)
    vocab = hf_config['vocab_size']
    fields = marian.model_fields(hf_config)
    self.perm = np.asarray(id_permutation(hf_config['pad_token_id'], 0, 1,
                                          vocab))
    tensors = load_file(os.path.join(hf_dir, 'model.safetensors'))
    self.params = jax.tree.map(jax.numpy.asarray, marian.convert_params(
        tensors, fields, vocab, self.perm))
    self.model = model_lib.build(config_lib.ModelConfig(vocab_size=vocab,
                                                        **fields))
    self.args = args
    self.model_bytes = sum(x.nbytes for x in jax.tree.leaves(self.params))

  def _ids(self, batch):
    from xfmr_jax.translate import Translator
    to_ours = np.argsort(self.perm)
    width = Translator.bucket(max(map(len, batch)), self.model.config.max_len)
    ids = np.zeros((self.args.batch_size, width), np.int32)
    for r, s in enumerate(batch):
      ids[r, :len(s)] = to_ours[np.asarray(s)]
    return ids

  def translate(self, batch):
    """HF ids of each sentence's output, up to and including EOS."""
    from xfmr_jax import hf_beam
    from xfmr_jax.token_ids import EOS
    out, _ = hf_beam.beam_search(self.model, self.params, self._ids(batch),
                                 beam_size=self.args.beam,
                                 max_decode_len=self.args.max_new)
    rows = []
    for row in np.asarray(out)[:len(batch)].tolist():
      row = row[:row.index(EOS) + 1] if EOS in row else row
      rows.append([int(self.perm[i]) for i in row])
    return rows


class CTranslate2:
  def __init__(self, ct2_dir, compute_type, args):
    import ctranslate2
    self.translator = ctranslate2.Translator(
        ct2_dir, device='cpu', compute_type=compute_type, inter_threads=1,
        intra_threads=os.cpu_count())
    self.args = args
    self.model_bytes = os.path.getsize(os.path.join(ct2_dir, 'model.bin'))
    self.ids = {_name(i): i for i in range(args.vocab - 1)}

  def translate(self, batch):
    results = self.translator.translate_batch(
        [[_name(i) for i in s] for s in batch], beam_size=self.args.beam,
        max_decoding_length=self.args.max_new, length_penalty=1.0,
        max_batch_size=self.args.batch_size)
    rows = []
    for r in results:
      row = [self.ids[tok] for tok in r.hypotheses[0]]
      rows.append(row + [0] if len(row) < self.args.max_new else row)
    return rows


class Transformers:
  def __init__(self, hf_dir, args):
    import torch
    from transformers import MarianMTModel
    torch.set_num_threads(os.cpu_count())
    self.model = MarianMTModel.from_pretrained(hf_dir).eval()
    self.model.generation_config.bad_words_ids = [[args.vocab - 1]]
    self.args = args
    self.model_bytes = sum(p.numel() * p.element_size()
                           for p in self.model.parameters())

  def translate(self, batch):
    import torch
    pad = self.model.config.pad_token_id
    ids = torch.full((len(batch), max(map(len, batch))), pad,
                     dtype=torch.long)
    for r, s in enumerate(batch):
      ids[r, :len(s)] = torch.tensor(s)
    with torch.no_grad():
      out = self.model.generate(
          input_ids=ids, attention_mask=ids != pad, num_beams=self.args.beam,
          max_new_tokens=self.args.max_new, length_penalty=1.0,
          do_sample=False)
    rows = []
    for row in out[:, 1:].tolist():
      row = row[:row.index(0) + 1] if 0 in row else row
      rows.append([i for i in row if i != pad])
    return rows


def load_engine(name, dirs, args):
  if name == 'xfmr_jax':
    return Ours(dirs['hf'], args)
  if name.startswith('ct2_'):
    return CTranslate2(dirs[name], name[4:], args)
  return Transformers(dirs['hf'], args)


def agreement(rows, reference) -> float:
  """Share of positions where two outputs agree, over the longer of each
  pair (a missing position disagrees)."""
  same = total = 0
  for a, b in zip(rows, reference):
    n = max(len(a), len(b))
    same += sum(x == y for x, y in zip(a, b))
    total += n
  return same / max(total, 1)


def _high_water_bytes() -> int:
  """This process's peak resident memory. ``/proc/self/status``'s VmHWM
  starts afresh at ``exec``; ``ru_maxrss`` would keep the peak of the parent
  that forked it."""
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmHWM:'):
        return int(line.split()[1]) * 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_memory(name, dirs, args) -> int:
  """Peak RSS (bytes) of a fresh process that loads ``name`` alone and
  translates the first batch."""
  cmd = [sys.executable, '-m', 'experiments.benchmark.engines',
         '--memory_of', name, '--dirs', json.dumps(dirs)] + args.passthrough
  out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                       env=package.cold_env())
  return int(out.stdout.strip().splitlines()[-1])


def parse_args(argv):
  p = argparse.ArgumentParser(prog='python -m experiments.benchmark.engines')
  p.add_argument('--size', choices=sorted(SIZES), default='opus_mt',
                 help="the model's shape (vocabulary, d_model, layers, heads)")
  p.add_argument('--sentences', type=int, default=128)
  p.add_argument('--batch_size', type=int, default=64)
  p.add_argument('--beam', type=int, default=4)
  p.add_argument('--max_new', type=int, default=64)
  p.add_argument('--rounds', type=int, default=2)
  p.add_argument('--hf_rounds', type=int, default=1)
  p.add_argument('--engines', default=','.join(ENGINES))
  p.add_argument('--json', default=None)
  p.add_argument('--quick', action='store_true',
                 help='a tiny model and a few sentences (for tests)')
  p.add_argument('--memory_of', default=None, help=argparse.SUPPRESS)
  p.add_argument('--dirs', default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.passthrough = [a for a in argv if a == '--quick'] + [
      f'--{k}={getattr(args, k)}' for k in ('size', 'sentences', 'batch_size',
                                           'beam', 'max_new')]
  args.vocab, args.d_model, args.layers, args.heads = SIZES[args.size]
  if args.quick:
    args.vocab, args.d_model, args.layers, args.heads = 300, 32, 1, 8
    args.sentences, args.batch_size, args.max_new = 8, 4, 4
  return args


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  omp_policy = user_omp_policy()
  batches = batches_by_length(sentences(args.sentences, args.vocab),
                              args.batch_size)
  if args.memory_of:  # the child process of _peak_memory
    engine = load_engine(args.memory_of, json.loads(args.dirs), args)
    engine.translate(batches[0])
    print(_high_water_bytes())
    return {}
  names = [n for n in args.engines.split(',') if n]
  with tempfile.TemporaryDirectory() as tmp:
    dirs = dict(hf=os.path.join(tmp, 'hf'))
    hf_model(args).save_pretrained(dirs['hf'])
    for q in ('float32', 'int8'):
      if f'ct2_{q}' in names:
        dirs[f'ct2_{q}'] = convert_ct2(dirs['hf'], os.path.join(tmp, q), q,
                                       args.vocab)
    engines, res = {}, dict(
        command='python -m experiments.benchmark.engines ' + ' '.join(argv),
        machine=machine(), threads=os.cpu_count(), size=args.size,
        sentences=args.sentences,
        beam=args.beam, max_new=args.max_new, batch_size=args.batch_size,
        omp_wait_policy=omp_policy, engines={})
    outputs = {}
    for name in names:
      t0 = time.perf_counter()
      engines[name] = load_engine(name, dirs, args)
      for batch in batches:  # compiles (ours) and warms up every shape
        outputs[name] = outputs.get(name, []) + engines[name].translate(batch)
        if name != 'xfmr_jax':
          break
      res['engines'][name] = dict(
          load_and_warm_up_seconds=time.perf_counter() - t0,
          model_bytes=engines[name].model_bytes, tokens_per_sec=[],
          sentences_per_sec=[])
    for r in range(args.rounds):
      order = names if r % 2 == 0 else names[::-1]
      for name in order:
        if name == 'transformers' and r >= args.hf_rounds:
          continue
        rows, t0 = [], time.perf_counter()
        for batch in batches:
          rows += engines[name].translate(batch)
        seconds = time.perf_counter() - t0
        outputs[name] = rows
        entry = res['engines'][name]
        entry['tokens_per_sec'].append(sum(map(len, rows)) / seconds)
        entry['sentences_per_sec'].append(args.sentences / seconds)
        print(f'round {r + 1} {name}: {entry["tokens_per_sec"][-1]:.0f} '
              'tokens/s', flush=True)
    del engines
    for name in names:
      entry = res['engines'][name]
      entry['peak_rss_bytes'] = _peak_memory(name, dirs, args)
      if 'xfmr_jax' in outputs:
        entry['agreement_with_xfmr_jax'] = agreement(outputs[name],
                                                     outputs['xfmr_jax'])
      if name == 'ct2_int8' and 'ct2_float32' in outputs:
        entry['agreement_with_float32'] = agreement(outputs[name],
                                                    outputs['ct2_float32'])
  print(format_table(res))
  if args.json:
    write_json(res, args.json)
  return res


def format_table(res) -> str:
  ours = res['engines'].get('xfmr_jax')
  lines = [f"{res['size']} shape; {res['machine']}, {res['threads']} threads; "
           f"beam {res['beam']}, "
           f"{res['sentences']} sentences, batches of {res['batch_size']}, "
           f"{res['max_new']} new tokens",
           '| engine | tokens/s per round | sentences/s | ours / engine | '
           'model MB | peak RSS MB | token agreement with ours | with its '
           'float32 |', '|---|---:|---:|---:|---:|---:|---:|---:|']
  for name, e in res['engines'].items():
    ratio = ('–' if ours is None or name == 'xfmr_jax' else ' / '.join(
        f'{a / b:.2f}x' for a, b in zip(ours['tokens_per_sec'],
                                        e['tokens_per_sec'])))
    lines.append(
        f"| {name} | {' / '.join(f'{v:.0f}' for v in e['tokens_per_sec'])} | "
        f"{e['sentences_per_sec'][-1]:.2f} | {ratio} | "
        f"{e['model_bytes'] / 2**20:.0f} | {e['peak_rss_bytes'] / 2**20:.0f} | "
        f"{e.get('agreement_with_xfmr_jax', 1.0):.3f} | "
        f"{e.get('agreement_with_float32', 1.0):.3f} |")
  return '\n'.join(lines)


if __name__ == '__main__':
  package.no_compilation_cache()
  main()
