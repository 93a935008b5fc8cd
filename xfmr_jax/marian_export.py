"""Export a workdir's model as a Hugging Face Marian directory.

The inverse of :mod:`xfmr_jax.marian`: ``config.json``,
``generation_config.json``, ``model.safetensors``, ``source.spm``,
``target.spm``, ``vocab.json`` and ``tokenizer_config.json``, which
``transformers.MarianMTModel.from_pretrained`` and ``MarianTokenizer`` load,
and which CTranslate2's converter (``ct2-transformers-converter``) turns into
a CTranslate2 model.

Marian fixes what :class:`~xfmr_jax.config.ModelConfig` leaves open: an
encoder-decoder with Post-LN LayerNorms (epsilon 1e-5), no final stack norm,
sinusoids laid out sines-then-cosines (``sinusoid_layout='halves'``), one
embedding matrix shared by encoder, decoder and output layer, biases in every
linear layer, full multi-head attention with as many key/value heads as query
heads, and an activation of its list. :func:`check_exportable` names the first
field of a model that differs (``experiments/configs/toy_marian.py`` is the
toy recipe with a model that passes).

Ids go back the way the importer brings them in: Marian's EOS is 0, unknown 1
and pad (its decoder start symbol) the last id, the other pieces keep their
order. The embedding rows and the logits bias are permuted accordingly, so
``marian.read_hf_dir(export)`` returns this model's parameters bit for bit.

CTranslate2 starts Marian decoders from a zero vector where transformers (and
this library) embed PAD: their outputs agree when the PAD row is zero, as in
models trained with ``pad_embedding='zero'`` or imported from Marian.

    info = write_hf_dir('workdir/toy_marian', 'toy-marian-hf')
"""
from __future__ import annotations

import json
import os
import shutil

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from xfmr_jax import marian_tokenizer, run_config
from xfmr_jax.config import ModelConfig
from xfmr_jax.marian_tokenizer import MarianTokenizer, id_permutation
from xfmr_jax.token_ids import EOS, PAD, UNK
from xfmr_jax.tokenizer import Tokenizer
from xfmr_jax.workdir import Workdir

# ModelConfig.activation -> the Hugging Face name (the importer's inverse).
ACTIVATIONS = {'silu': 'swish', 'relu': 'relu', 'gelu_exact': 'gelu',
               'gelu': 'gelu_new'}
# Fields whose value Marian fixes, and that value.
_FIXED = dict(model_kind='encoder_decoder', positional='sinusoidal',
              sinusoid_layout='halves', norm_position='post',
              norm_type='layernorm', layer_norm_epsilon=1e-5,
              share_embeddings=True, use_bias=True, attention_kind='full')


class MarianExportError(ValueError):
  """A model or output folder the Marian export cannot write."""


def check_exportable(cfg: ModelConfig) -> None:
  """Raise MarianExportError naming the first field Marian cannot represent."""
  for field, wanted in _FIXED.items():
    if getattr(cfg, field) != wanted:
      raise MarianExportError(
          f'model.{field}={getattr(cfg, field)!r} cannot be exported to '
          f'Marian, which has only {field}={wanted!r}')
  if cfg.num_kv_heads not in (0, cfg.num_heads):
    raise MarianExportError(
        f'model.num_kv_heads={cfg.num_kv_heads} cannot be exported to Marian, '
        'which has as many key/value heads as query heads (num_kv_heads=0)')
  if cfg.activation not in ACTIVATIONS:
    raise MarianExportError(
        f'model.activation={cfg.activation!r} cannot be exported to Marian, '
        f'which has {", ".join(map(repr, ACTIVATIONS))}')


def marian_ids(tokenizer) -> np.ndarray:
  """``ours_to_marian`` ``[vocab]``, the Marian id of each of our ids: an
  imported model's own (its ``vocab.json``), else our PAD, EOS, UNK as
  Marian's last id, 0 and 1 and our id ``i >= 3`` as Marian's ``i - 1``."""
  if isinstance(tokenizer, MarianTokenizer):
    return tokenizer.ours_to_marian
  v = tokenizer.vocab_size
  return id_permutation(v - 1, 0, 1, v)


def hf_config(cfg: ModelConfig, ours_to_marian: np.ndarray) -> dict:
  """``config.json`` of the model (ids in Marian's order)."""
  v = cfg.vocab_size
  pad, eos = int(ours_to_marian[PAD]), int(ours_to_marian[EOS])
  return dict(
      model_type='marian', architectures=['MarianMTModel'], vocab_size=v,
      decoder_vocab_size=v, d_model=cfg.d_model,
      encoder_layers=cfg.num_encoder_layers,
      decoder_layers=cfg.num_decoder_layers,
      encoder_attention_heads=cfg.num_heads,
      decoder_attention_heads=cfg.num_heads, encoder_ffn_dim=cfg.d_ff,
      decoder_ffn_dim=cfg.d_ff, max_position_embeddings=cfg.max_len,
      activation_function=ACTIVATIONS[cfg.activation],
      dropout=cfg.dropout_rate, attention_dropout=cfg.attention_dropout_rate,
      activation_dropout=0.0, scale_embedding=True,
      share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
      static_position_embeddings=True, normalize_embedding=False,
      is_encoder_decoder=True, pad_token_id=pad, eos_token_id=eos,
      decoder_start_token_id=pad, forced_eos_token_id=None)


def generation_config(cfg: ModelConfig, ours_to_marian: np.ndarray,
                      beam_size: int, beam_alpha: float) -> dict:
  """``generation_config.json``: the workdir's beam size and length penalty
  (under generate's rules, which ``beam_rules='hf'`` reproduces here), up to
  ``max_len`` tokens, and the pad id never generated (as this library's
  decoders never emit PAD)."""
  pad, eos = int(ours_to_marian[PAD]), int(ours_to_marian[EOS])
  gen = dict(num_beams=int(beam_size), max_length=cfg.max_len,
             bad_words_ids=[[pad]], pad_token_id=pad, eos_token_id=eos,
             decoder_start_token_id=pad, forced_eos_token_id=None)
  if beam_size > 1:  # generate warns about a length penalty without beams
    gen['length_penalty'] = float(beam_alpha)
  return gen


def _unscanned(params: dict, cfg: ModelConfig) -> dict:
  """``encoder_i`` / ``decoder_i`` subtrees, from a scanned stack too."""
  params = dict(params)
  for side, n in (('encoder', cfg.num_encoder_layers),
                  ('decoder', cfg.num_decoder_layers)):
    if side in params:  # scan_layers: one subtree with a leading layer axis
      stacked = params.pop(side)
      for i in range(n):
        params[f'{side}_{i}'] = jax.tree.map(lambda x, i=i: x[i], stacked)
  return params


def hf_tensors(params, cfg: ModelConfig, ours_to_marian: np.ndarray) -> dict:
  """``{safetensors name: float32 array}`` of the model's parameters, the
  vocabulary in Marian's id order."""
  p = _unscanned(jax.tree.map(np.asarray, nn.meta.unbox(params)), cfg)
  order = np.argsort(ours_to_marian)   # Marian id -> our id
  embedding = p['source_embed']['embedding'][order]
  bias = (p['logits']['bias'][order] if 'logits' in p
          else np.zeros(cfg.vocab_size, np.float32))
  out = {'model.shared.weight': embedding,
         'final_logits_bias': bias[None, :]}

  def attention(prefix, tree):
    for ours, theirs in (('query', 'q'), ('key', 'k'), ('value', 'v'),
                         ('out', 'out')):
      out[f'{prefix}.{theirs}_proj.weight'] = tree[ours]['kernel'].T
      out[f'{prefix}.{theirs}_proj.bias'] = tree[ours]['bias']

  def norm(prefix, tree):
    out[f'{prefix}.weight'] = tree['norm']['scale']
    out[f'{prefix}.bias'] = tree['norm']['bias']

  def ffn(prefix, tree):
    out[f'{prefix}.fc1.weight'] = tree['wi'].T
    out[f'{prefix}.fc1.bias'] = tree['bi']
    out[f'{prefix}.fc2.weight'] = tree['wo'].T
    out[f'{prefix}.fc2.bias'] = tree['bo']

  for i in range(cfg.num_encoder_layers):
    layer, prefix = p[f'encoder_{i}'], f'model.encoder.layers.{i}'
    attention(f'{prefix}.self_attn', layer['self_attention'])
    norm(f'{prefix}.self_attn_layer_norm', layer['attention_block'])
    ffn(prefix, layer['ffn'])
    norm(f'{prefix}.final_layer_norm', layer['ffn_block'])
  for i in range(cfg.num_decoder_layers):
    layer, prefix = p[f'decoder_{i}'], f'model.decoder.layers.{i}'
    attention(f'{prefix}.self_attn', layer['self_attention'])
    norm(f'{prefix}.self_attn_layer_norm', layer['self_attention_block'])
    attention(f'{prefix}.encoder_attn', layer['cross_attention'])
    norm(f'{prefix}.encoder_attn_layer_norm', layer['cross_attention_block'])
    ffn(prefix, layer['ffn'])
    norm(f'{prefix}.final_layer_norm', layer['ffn_block'])
  # safetensors wants contiguous arrays (a transpose is a view).
  return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def write_tokenizer(tokenizer, out: str) -> None:
  """``source.spm``, ``target.spm`` and ``vocab.json`` in ``out``.

  A workdir's SentencePiece model serves both sides; its piece of our id
  ``i`` gets Marian id ``marian_ids[i]``. An imported model's Marian files
  are copied as they are (their ids map back to the original ones).
  """
  if isinstance(tokenizer, MarianTokenizer):
    for name in marian_tokenizer.FILES:
      shutil.copyfile(os.path.join(tokenizer.directory, name),
                      os.path.join(out, name))
    return
  assert isinstance(tokenizer, Tokenizer), type(tokenizer)
  for name in ('source.spm', 'target.spm'):
    with open(os.path.join(out, name), 'wb') as f:
      f.write(tokenizer.model_proto)
  ids = marian_ids(tokenizer)
  vocab = {tokenizer.id_to_piece(i): int(ids[i])
           for i in range(tokenizer.vocab_size)}
  if len(vocab) != tokenizer.vocab_size:
    raise MarianExportError('the tokenizer has repeated pieces; vocab.json '
                            'needs one id per piece')
  for piece, want in ((marian_tokenizer.PAD_PIECE, PAD),
                      (marian_tokenizer.EOS_PIECE, EOS),
                      (marian_tokenizer.UNK_PIECE, UNK)):
    if tokenizer.id_to_piece(want) != piece:
      raise MarianExportError(
          f'the tokenizer names id {want} {tokenizer.id_to_piece(want)!r}; '
          f"Marian's tokenizer looks it up as {piece!r}")
  with open(os.path.join(out, 'vocab.json'), 'w', encoding='utf-8') as f:
    json.dump(vocab, f, ensure_ascii=False, indent=1)


def _prepare_out(out: str) -> str:
  """A fresh ``out.tmp`` folder; ``out`` must not exist or be empty."""
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise MarianExportError(f'{out} exists and is not an empty folder; '
                            'export into a new folder')
  tmp = out.rstrip('/') + '.tmp'
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  return tmp


def _write_json(path: str, value: dict) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(value, f, indent=2)


def write_hf_dir(workdir: str, out: str, step: int | None = None) -> dict:
  """Export the workdir's model (its newest or given checkpoint) to ``out``.

  The model is checked before any checkpoint is read; the files are written
  to ``out.tmp`` and renamed, so ``out`` is complete or absent. Returns
  ``{'parameters', 'vocab_size', 'pad_row_norm'}`` (the norm of the PAD
  embedding row: 0 when CTranslate2 decodes as transformers does).
  """
  wd = Workdir(workdir)
  if wd.has_config():  # (load builds the model of this same config.json)
    check_exportable(run_config.model_config(
        ml_collections.ConfigDict(wd.read_config()), vocab_size=1))
  trained = wd.load(step)
  cfg = trained.model.config
  ids = marian_ids(trained.tokenizer)
  tensors = hf_tensors(trained.params, cfg, ids)
  tmp = _prepare_out(out)
  try:
    from safetensors.numpy import save_file
    weights = os.path.join(tmp, 'model.safetensors')
    save_file(tensors, weights, metadata={'format': 'pt'})
    os.chmod(weights, 0o644)  # safetensors creates it readable by its owner only
    _write_json(os.path.join(tmp, 'config.json'), hf_config(cfg, ids))
    _write_json(os.path.join(tmp, 'generation_config.json'),
                generation_config(cfg, ids, trained.config.get('beam_size', 4),
                                  trained.config.get('beam_alpha', 1.0)))
    _write_json(os.path.join(tmp, 'tokenizer_config.json'),
                dict(model_max_length=cfg.max_len,
                     tokenizer_class='MarianTokenizer'))
    write_tokenizer(trained.tokenizer, tmp)
    if os.path.isdir(out):
      os.rmdir(out)  # empty, checked above
    os.replace(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  embedding = tensors['model.shared.weight']
  return dict(parameters=int(sum(v.size for v in tensors.values())),
              vocab_size=cfg.vocab_size,
              pad_row_norm=float(np.linalg.norm(embedding[ids[PAD]])))
