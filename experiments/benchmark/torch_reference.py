"""The PyTorch reference: the same Transformer in ``torch.nn``, eager.

``TorchTrain`` times a PyTorch train step (forward, label-smoothed
cross-entropy, Adam) beside ours; ``TorchNaiveGreedy`` times the usual
uncached PyTorch greedy loop beside our decoders. torch is imported only when
one of them is built, so everything else runs without it.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np

from experiments.benchmark.common import DROPOUT, LABEL_SMOOTHING, PeakRSS
from xfmr_jax import config as config_lib
from xfmr_jax.token_ids import EOS


def torch_available() -> bool:
  try:
    import torch  # pylint: disable=g-import-not-at-top
    del torch     # only whether it imports
    return True
  except ImportError:
    return False


# Where the PyTorch model drops out: 'paper' = where xfmr_jax does (the sums
# of embeddings and positions, and every sublayer's output before the
# residual add; paper section 5.4); 'torch' = nn.Transformer's defaults, which
# also drop out the attention weights and the FFN's hidden activations.
TORCH_DROPOUT_SITES = ('paper', 'torch')


def _torch_model(cfg: config_lib.ModelConfig, dropout: float,
                 sites: str = 'paper'):
  """``torch.nn.Transformer`` with our embeddings, positions and output layer,
  dropping out at ``sites`` (see TORCH_DROPOUT_SITES)."""
  if sites not in TORCH_DROPOUT_SITES:
    raise ValueError(f'dropout sites {sites!r} not in {TORCH_DROPOUT_SITES}')
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top

  class TorchTransformer(nn.Module):

    def __init__(self):
      super().__init__()
      d = cfg.d_model
      self.embed = nn.Embedding(cfg.vocab_size, d)
      nn.init.normal_(self.embed.weight, std=d ** -0.5)
      pos = torch.arange(cfg.max_len, dtype=torch.float32)[:, None]
      div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) *
                      (-math.log(10000.0) / d))
      pe = torch.zeros(cfg.max_len, d)
      pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
      self.register_buffer('pe', pe)
      self.drop = nn.Dropout(dropout)
      self.core = nn.Transformer(
          d, cfg.num_heads, cfg.num_encoder_layers, cfg.num_decoder_layers,
          cfg.d_ff, dropout, batch_first=True)
      if sites == 'paper':
        for layer in [*self.core.encoder.layers, *self.core.decoder.layers]:
          layer.dropout = nn.Identity()   # between the FFN's two linears
          for attn in (layer.self_attn, getattr(layer, 'multihead_attn', None)):
            if attn is not None:
              attn.dropout = 0.0          # on the attention weights

    def emb(self, tokens):
      x = self.embed(tokens) * math.sqrt(cfg.d_model)
      return self.drop(x + self.pe[:tokens.shape[1]])

    def encode(self, src):
      return self.core.encoder(self.emb(src))

    def decode(self, memory, tgt_in):
      mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
      out = self.core.decoder(self.emb(tgt_in), memory, tgt_mask=mask,
                              tgt_is_causal=True)
      return out @ self.embed.weight.T   # tied output projection

    def forward(self, src, tgt_in):
      return self.decode(self.encode(src), tgt_in)

  return TorchTransformer()


class TorchTrain:
  """PyTorch eager train step: forward, smoothed cross-entropy, Adam."""

  def __init__(self, cfg: config_lib.ModelConfig, batch: dict,
               dropout: float = DROPOUT, sites: str = 'paper'):
    import torch  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    self.torch = torch
    self.src = torch.from_numpy(batch['inputs']).long()
    self.tgt = torch.from_numpy(batch['targets']).long()
    self.tgt_in = torch.nn.functional.pad(self.tgt, (1, 0))[:, :-1]
    with PeakRSS() as mem:
      self.model = _torch_model(cfg, dropout, sites).train()
      self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4,
                                  betas=(0.9, 0.98), eps=1e-9)
      t0 = time.perf_counter()
      self()
      self.first_step_s = time.perf_counter() - t0
      self()
    self.rss_delta = mem.delta

  def __call__(self):
    torch = self.torch
    logits = self.model(self.src, self.tgt_in)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), self.tgt.reshape(-1),
        label_smoothing=LABEL_SMOOTHING)
    self.opt.zero_grad(set_to_none=True)
    loss.backward()
    self.opt.step()
    return loss.item()


class TorchNaiveGreedy:
  """The usual PyTorch loop: encode once, re-run the decoder on the whole
  prefix for every new token, no cache."""

  def __init__(self, cfg, inputs, length: int):
    import torch  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    self.torch = torch
    self.model = _torch_model(cfg, DROPOUT).eval()
    with torch.no_grad():
      self.model.embed.weight[EOS] = 0.0
    self.src = torch.from_numpy(np.array(inputs)).long()
    self.length = length

  def __call__(self, length=None):
    torch = self.torch
    with torch.no_grad():
      memory = self.model.encode(self.src)
      ys = torch.zeros(self.src.shape[0], 1, dtype=torch.long)
      for _ in range(length or self.length):
        logits = self.model.decode(memory, ys)[:, -1]
        logits[:, 0] = -float('inf')   # never the pad id, as ours
        ys = torch.cat([ys, logits.argmax(-1, keepdim=True)], dim=1)
    return ys[:, 1:].numpy()
