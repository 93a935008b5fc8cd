"""Import a Hugging Face Marian (opus-mt) translator as a normal workdir.

A Hugging Face Marian directory holds ``config.json``, the weights
(``model.safetensors``, or ``pytorch_model.bin`` which needs torch to read),
``source.spm``, ``target.spm`` and ``vocab.json``. Marian is the paper's model
with a few fixed choices, each a :class:`~xfmr_jax.config.ModelConfig` field
here: Post-LN without an embedding norm or a final stack norm, embeddings
scaled by sqrt(d_model) and shared by encoder, decoder and output layer,
sinusoids laid out sines-then-cosines (``sinusoid_layout='halves'``; they are
not weights), the FFN activation of its config (opus-mt: swish =
``activation='silu'``), LayerNorm epsilon 1e-5, and a ``final_logits_bias``
``[1, vocab]`` buffer (``logits_bias='fixed'``).

Ids: Marian's EOS is 0 and its pad (also its decoder start symbol) the last
id; this library's PAD is 0 (also the start symbol) and EOS 1. The embedding
rows and the logits bias are permuted (:func:`~xfmr_jax.marian_tokenizer.id_permutation`)
so that the imported model uses this library's ids everywhere: masks, losses,
packing, decoding and the trainer then need no Marian case, and the model
computes the same logits, reordered. Reading the weights needs only numpy and
``safetensors``.

    config_fields, params, tokenizer, generation = read_hf_dir('opus-mt-en-de')
    write_workdir('out', training_config, params, tokenizer)
"""
from __future__ import annotations

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from xfmr_jax import optim, positional, train_state
from xfmr_jax.marian_tokenizer import MarianTokenizer
from xfmr_jax.run_config import build_model
from xfmr_jax.tokenizer import TokenizerError
from xfmr_jax.workdir import Workdir

log = logging.getLogger('xfmr_jax')

WEIGHT_FILES = ('model.safetensors', 'pytorch_model.bin')
# Hugging Face activation names -> ModelConfig.activation.
ACTIVATIONS = {'swish': 'silu', 'silu': 'silu', 'relu': 'relu',
               'gelu': 'gelu_exact', 'gelu_new': 'gelu',
               'gelu_pytorch_tanh': 'gelu'}
# Options of older Marian configs that change the architecture: the value
# under which the architecture is the one imported here.
_FIXED_OPTIONS = {'normalize_embedding': False, 'add_final_layer_norm': False,
                  'normalize_before': False, 'add_bias_logits': False,
                  'static_position_embeddings': True, 'scale_embedding': True,
                  'share_encoder_decoder_embeddings': True,
                  'tie_word_embeddings': True, 'is_encoder_decoder': True}


_REQUIRED = ('vocab_size', 'd_model', 'encoder_layers', 'decoder_layers',
             'encoder_attention_heads', 'encoder_ffn_dim')


class MarianImportError(ValueError):
  """A Hugging Face directory this importer cannot convert."""


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except OSError as e:
    raise MarianImportError(f'{path} cannot be read: {e.strerror}') from None
  except ValueError as e:
    raise MarianImportError(f'{path} is not valid JSON: {e}') from None


def model_fields(hf: dict, path: str = 'config.json') -> dict:
  """``ModelConfig`` fields (without ``vocab_size``) of a Marian config.

  Raises MarianImportError naming the first field that this library's model
  cannot reproduce.
  """
  def bad(field, why):
    raise MarianImportError(f'{path}: {field}={hf.get(field)!r} is not '
                            f'supported ({why})')
  if hf.get('model_type') != 'marian':
    bad('model_type', "this importer reads 'marian' models")
  for field in _REQUIRED:
    if not isinstance(hf.get(field), int) or hf[field] <= 0:
      raise MarianImportError(f'{path}: {field} must be a positive integer, '
                              f'got {hf.get(field)!r}')
  for field, wanted in _FIXED_OPTIONS.items():
    if field in hf and bool(hf[field]) != wanted:
      bad(field, f'only {wanted} is')
  dec_vocab = hf.get('decoder_vocab_size')
  if dec_vocab not in (None, hf.get('vocab_size')):
    bad('decoder_vocab_size', 'source and target must share one vocabulary')
  for enc, dec in (('encoder_attention_heads', 'decoder_attention_heads'),
                   ('encoder_ffn_dim', 'decoder_ffn_dim')):
    if hf.get(enc) != hf.get(dec):
      bad(dec, f'it must equal {enc}={hf.get(enc)!r}')
  act = hf.get('activation_function', 'gelu')
  if act not in ACTIVATIONS:
    bad('activation_function', f'known: {", ".join(ACTIVATIONS)}')
  if hf.get('decoder_start_token_id') != hf.get('pad_token_id'):
    bad('decoder_start_token_id', 'the decoder must start from the pad id')
  if hf.get('activation_dropout', 0.0):
    log.warning('%s: activation_dropout=%s is not applied when fine-tuning',
                path, hf['activation_dropout'])
  return dict(
      d_model=hf['d_model'], num_heads=hf['encoder_attention_heads'],
      num_encoder_layers=hf['encoder_layers'],
      num_decoder_layers=hf['decoder_layers'], d_ff=hf['encoder_ffn_dim'],
      dropout_rate=float(hf.get('dropout', 0.1)),
      attention_dropout_rate=float(hf.get('attention_dropout', 0.0)),
      max_len=hf.get('max_position_embeddings', 512),
      positional='sinusoidal', sinusoid_layout='halves', norm_position='post',
      norm_type='layernorm', activation=ACTIVATIONS[act],
      share_embeddings=True, layer_norm_epsilon=1e-5, use_bias=True,
      logits_bias='fixed', model_kind='encoder_decoder')


def generation_settings(hf_dir: str, hf: dict) -> dict:
  """``beam_size`` and ``beam_alpha`` of the model's generation defaults
  (``generation_config.json`` over ``config.json``; 4 and 1.0 if unset)."""
  gen = dict(hf)
  path = os.path.join(hf_dir, 'generation_config.json')
  if os.path.exists(path):
    gen.update(_read_json(path))
  return dict(beam_size=int(gen.get('num_beams') or 4),
              beam_alpha=float(gen.get('length_penalty', 1.0)))


def read_weights(hf_dir: str) -> tuple[dict, str]:
  """``({name: float32 numpy array}, path)`` of ``model.safetensors`` (or,
  with torch installed, ``pytorch_model.bin``)."""
  path = os.path.join(hf_dir, WEIGHT_FILES[0])
  if os.path.exists(path):
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    try:
      tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
      raise MarianImportError(f'{path} cannot be read as safetensors: '
                              f'{e}') from None
  elif os.path.exists(os.path.join(hf_dir, WEIGHT_FILES[1])):
    path = os.path.join(hf_dir, WEIGHT_FILES[1])
    try:
      import torch
    except ImportError:
      raise MarianImportError(
          f'{hf_dir} has only {WEIGHT_FILES[1]}, which needs torch to read; '
          'install torch or save the model as model.safetensors') from None
    try:
      state = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # torch raises many kinds of errors here
      raise MarianImportError(f'{path} cannot be read: {e}') from None
    tensors = {k: v.float().numpy() for k, v in state.items()}
  else:
    raise MarianImportError(f'{hf_dir} has no weights: expected '
                            f'{" or ".join(WEIGHT_FILES)}')
  return {k: np.asarray(v, np.float32) for k, v in tensors.items()}, path


class _Weights:
  """Named tensors with shape checks that name the tensor and the file."""

  def __init__(self, tensors: dict, source: str):
    self.tensors, self.source = tensors, source

  def get(self, name: str, shape: tuple, *alternatives: str) -> np.ndarray:
    for key in (name, *alternatives):
      if key in self.tensors:
        value = self.tensors[key]
        if value.shape != shape:
          raise MarianImportError(f'{self.source}: {key} has shape '
                                  f'{value.shape}, expected {shape}')
        return value
    raise MarianImportError(f'{self.source} has no tensor {name!r}')


def _attention(w: _Weights, prefix: str, d: int) -> dict:
  """torch ``Linear`` weights ``[out, in]`` -> kernels ``[in, out]``."""
  return {ours: {'kernel': w.get(f'{prefix}.{theirs}_proj.weight', (d, d)).T,
                 'bias': w.get(f'{prefix}.{theirs}_proj.bias', (d,))}
          for ours, theirs in (('query', 'q'), ('key', 'k'), ('value', 'v'),
                               ('out', 'out'))}


def _norm(w: _Weights, prefix: str, d: int) -> dict:
  return {'norm': {'scale': w.get(f'{prefix}.weight', (d,)),
                   'bias': w.get(f'{prefix}.bias', (d,))}}


def _ffn(w: _Weights, prefix: str, d: int, f: int) -> dict:
  return {'wi': w.get(f'{prefix}.fc1.weight', (f, d)).T,
          'bi': w.get(f'{prefix}.fc1.bias', (f,)),
          'wo': w.get(f'{prefix}.fc2.weight', (d, f)).T,
          'bo': w.get(f'{prefix}.fc2.bias', (d,))}


def convert_params(tensors: dict, fields: dict, vocab_size: int,
                   ours_to_marian: np.ndarray, source: str = 'weights') -> dict:
  """This library's params tree (unscanned layers) from Marian's tensors.

  Args:
    tensors: ``{name: array}``, the first of what :func:`read_weights`
      returns.
    fields: :func:`model_fields`; vocab_size: Marian's vocabulary size.
    ours_to_marian: ``[vocab]`` Marian id of each of our ids.
  """
  w = _Weights(tensors, source)
  d, f = fields['d_model'], fields['d_ff']
  embedding = w.get('model.shared.weight', (vocab_size, d),
                    'model.encoder.embed_tokens.weight',
                    'model.decoder.embed_tokens.weight')
  bias = w.get('final_logits_bias', (1, vocab_size))[0]
  params = {'source_embed': {'embedding': embedding[ours_to_marian]},
            'logits': {'bias': bias[ours_to_marian]}}
  _check_positions(tensors, fields, source)
  for i in range(fields['num_encoder_layers']):
    p = f'model.encoder.layers.{i}'
    params[f'encoder_{i}'] = {
        'self_attention': _attention(w, f'{p}.self_attn', d),
        'attention_block': _norm(w, f'{p}.self_attn_layer_norm', d),
        'ffn': _ffn(w, p, d, f),
        'ffn_block': _norm(w, f'{p}.final_layer_norm', d)}
  for i in range(fields['num_decoder_layers']):
    p = f'model.decoder.layers.{i}'
    params[f'decoder_{i}'] = {
        'self_attention': _attention(w, f'{p}.self_attn', d),
        'self_attention_block': _norm(w, f'{p}.self_attn_layer_norm', d),
        'cross_attention': _attention(w, f'{p}.encoder_attn', d),
        'cross_attention_block': _norm(w, f'{p}.encoder_attn_layer_norm', d),
        'ffn': _ffn(w, p, d, f),
        'ffn_block': _norm(w, f'{p}.final_layer_norm', d)}
  return params


def _check_positions(tensors: dict, fields: dict, source: str) -> None:
  """Stored sinusoid tables (some files have them) must be the ones the
  model recomputes: anything else means positions this importer would drop."""
  for side in ('encoder', 'decoder'):
    table = tensors.get(f'model.{side}.embed_positions.weight')
    if table is None:
      continue
    ours = np.asarray(positional.sinusoidal_encoding(
        np.arange(table.shape[0]), fields['d_model'], layout='halves'))
    if table.shape != ours.shape or np.abs(table - ours).max() > 1e-3:
      raise MarianImportError(
          f'{source}: model.{side}.embed_positions.weight is not the '
          'sines-then-cosines table Marian models use')


def read_hf_dir(hf_dir: str):
  """``(model_fields, params, tokenizer, generation)`` of a Hugging Face
  Marian directory; a MarianImportError (or TokenizerError) naming the file
  or field that is missing or unsupported."""
  if not os.path.isdir(hf_dir):
    raise MarianImportError(f'{hf_dir!r} is not a directory')
  config_path = os.path.join(hf_dir, 'config.json')
  if not os.path.exists(config_path):
    raise MarianImportError(f'{config_path} is missing')
  hf = _read_json(config_path)
  fields = model_fields(hf, config_path)
  try:
    tokenizer = MarianTokenizer.from_files(hf_dir)
  except TokenizerError as e:
    raise MarianImportError(str(e)) from None
  vocab_size = hf.get('vocab_size')
  if tokenizer.vocab_size != vocab_size:
    raise MarianImportError(f'{config_path}: vocab_size={vocab_size} but '
                            f'vocab.json has {tokenizer.vocab_size} entries')
  for field, name in (('pad_token_id', 'pad'), ('eos_token_id', 'eos')):
    if hf.get(field) != tokenizer.marian_ids[name]:
      raise MarianImportError(
          f'{config_path}: {field}={hf.get(field)!r} but vocab.json gives '
          f'{tokenizer.marian_ids[name]}')
  tensors, source = read_weights(hf_dir)
  params = convert_params(tensors, fields, vocab_size,
                          tokenizer.ours_to_marian, source)
  return fields, params, tokenizer, generation_settings(hf_dir, hf)


def write_workdir(workdir: str, config, params, tokenizer) -> None:
  """Write a workdir that loads and trains like a trained one: the
  tokenizer, ``config.json`` and checkpoint 0 (``params`` with a fresh
  optimizer state; no data position).

  Args:
    config: the training config (``ml_collections``) whose ``model`` and
      ``vocab_size`` describe ``params``.
  """
  os.makedirs(workdir, exist_ok=True)
  wd = Workdir(workdir)
  if wd.has_checkpoints():
    raise MarianImportError(f'{workdir} already holds checkpoints; import '
                            'into a new workdir')
  model = build_model(config, tokenizer.vocab_size)
  tx = optim.from_config(config)
  fresh = jax.eval_shape(lambda: train_state.init_state(model, tx,
                                                         config.seed))
  shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
  if shapes(params) != shapes(fresh.params):
    raise MarianImportError('converted parameters do not match the model '
                            'tree (a bug in the importer)')
  params = jax.tree.map(jnp.asarray, params)
  state = train_state.TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
      rng=jax.random.key_data(jax.random.key(config.seed)),
      bad_step=jnp.full((), -1, jnp.int32))
  tokenizer.save(workdir)
  config_json = json.loads(config.to_json_best_effort())
  wd.write_config(config_json)
  ckpt = wd.checkpointer(async_save=False)
  try:
    ckpt.save(0, state, {}, config_json)
  finally:
    ckpt.close()
