"""A tiny random Hugging Face Marian model, built offline, for the import tests.

``make_hf_dir(path)`` writes what a downloaded opus-mt directory holds:
``config.json`` and ``model.safetensors`` (``save_pretrained`` of a random
``MarianMTModel``), ``source.spm`` and ``target.spm`` (SentencePiece models
trained on a few hundred generated lines of two made-up languages) and
``vocab.json`` (Marian's layout: ``</s>`` 0, ``<unk>`` 1, the pieces of both
models, ``<pad>`` last). Every LayerNorm and bias is moved away from 0 and 1
and ``final_logits_bias`` is random, so that a weight dropped or misplaced by
the importer shows in the logits. The model is then trained for a few
steps on the generated pairs (a random model repeats one token forever), so
that greedy and beam outputs end with EOS at varied lengths.
"""
from __future__ import annotations

import io
import json
import os
import random

import sentencepiece as spm

SOURCE_WORDS = ('the cat dog sees a big small red house tree runs sleeps '
                'under over near blue bird eats green apple').split()
TARGET_WORDS = ('le chat chien voit un grand petit rouge maison arbre court '
                'dort sous sur pres bleu oiseau mange vert pomme').split()


def sentences(n: int = 300, seed: int = 0):
  """``n`` (source, target) pairs of 3-9 words; word i translates to word i."""
  rng = random.Random(seed)
  pairs = []
  for _ in range(n):
    idx = [rng.randrange(len(SOURCE_WORDS)) for _ in range(rng.randint(3, 9))]
    pairs.append((' '.join(SOURCE_WORDS[i] for i in idx).capitalize() + '.',
                  ' '.join(TARGET_WORDS[i] for i in idx).capitalize() + '.'))
  return pairs


def _train_spm(lines, path: str, vocab_size: int) -> None:
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
      model_type='unigram', hard_vocab_limit=False, character_coverage=1.0,
      minloglevel=2, num_threads=1)
  with open(path, 'wb') as f:
    f.write(model.getvalue())


def _train(model, path, pairs, steps: int) -> None:
  """A few Adam steps on the pairs, so that the model ends its outputs with
  EOS at varied lengths (a random model repeats one token forever)."""
  import torch
  from transformers import MarianTokenizer
  tok = MarianTokenizer.from_pretrained(path)
  model.train()
  opt = torch.optim.Adam(model.parameters(), lr=3e-3)
  rng = random.Random(1)
  for _ in range(steps):
    chunk = rng.sample(pairs, 32)
    batch = tok([s for s, _ in chunk], text_target=[t for _, t in chunk],
                padding=True, return_tensors='pt')
    batch['labels'][batch['labels'] == tok.pad_token_id] = -100
    loss = model(**batch).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def make_hf_dir(path: str, *, d_model: int = 16, layers: int = 2,
                seed: int = 0, train_steps: int = 150) -> dict:
  """Write the model directory; returns ``{'pairs', 'pad', 'vocab'}``."""
  import torch
  from transformers import MarianConfig, MarianMTModel
  os.makedirs(path, exist_ok=True)
  pairs = sentences()
  _train_spm([s for s, _ in pairs], os.path.join(path, 'source.spm'), 60)
  _train_spm([t for _, t in pairs], os.path.join(path, 'target.spm'), 60)
  pieces = []
  for name in ('source.spm', 'target.spm'):
    sp = spm.SentencePieceProcessor(model_file=os.path.join(path, name))
    pieces += [sp.id_to_piece(i) for i in range(sp.get_piece_size())
               if not (sp.is_control(i) or sp.is_unknown(i))]
  vocab = {'</s>': 0, '<unk>': 1}
  for p in ['>>fr<<'] + pieces:
    vocab.setdefault(p, len(vocab))
  pad = vocab.setdefault('<pad>', len(vocab))
  with open(os.path.join(path, 'vocab.json'), 'w', encoding='utf-8') as f:
    json.dump(vocab, f, ensure_ascii=False, indent=2)
  config = MarianConfig(
      vocab_size=len(vocab), d_model=d_model, encoder_layers=layers,
      decoder_layers=layers, encoder_attention_heads=2,
      decoder_attention_heads=2, encoder_ffn_dim=2 * d_model,
      decoder_ffn_dim=2 * d_model, max_position_embeddings=128,
      activation_function='swish', scale_embedding=True, pad_token_id=pad,
      eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=0,
      init_std=0.15, dropout=0.1)
  torch.manual_seed(seed)
  model = MarianMTModel(config).eval()
  with torch.no_grad():
    for module in model.modules():
      if isinstance(module, torch.nn.LayerNorm):
        module.weight.copy_(1 + 0.3 * torch.randn_like(module.weight))
        module.bias.copy_(0.2 * torch.randn_like(module.bias))
      elif isinstance(module, torch.nn.Linear) and module.bias is not None:
        module.bias.copy_(0.2 * torch.randn_like(module.bias))
    model.final_logits_bias.copy_(
        0.5 * torch.randn_like(model.final_logits_bias))
  if train_steps:
    _train(model, path, pairs, train_steps)
  model.eval()
  # What opus-mt checkpoints ship: the pad id is never generated.
  model.generation_config.bad_words_ids = [[pad]]
  model.save_pretrained(path)
  return {'pairs': pairs, 'pad': pad, 'vocab': vocab}
