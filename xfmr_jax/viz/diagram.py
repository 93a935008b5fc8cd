"""The architecture diagram: the encoder-decoder of figure 1 of the paper,
each box labelled with the function that implements it."""
from __future__ import annotations

from xfmr_jax.config import ModelConfig
from xfmr_jax.viz.figure import axes_or_new, matplotlib


def _box(ax, x, y, w, h, text, color, fontsize=8, sub=None):
  ax.add_patch(matplotlib.patches.FancyBboxPatch(
      (x - w / 2, y - h / 2), w, h, boxstyle='round,pad=0.02,rounding_size=0.08',
      facecolor=color, edgecolor='black', lw=0.8))
  ax.text(x, y + (0.07 if sub else 0), text, ha='center', va='center',
          fontsize=fontsize)
  if sub:
    ax.text(x, y - 0.13, sub, ha='center', va='center', fontsize=6,
            family='monospace', color='#333333')


def _arrow(ax, x0, y0, x1, y1, **kw):
  ax.annotate('', (x1, y1), (x0, y0),
              arrowprops=dict(arrowstyle='->', lw=0.9, **kw))


def _column(ax, x, w, h, colors, source, embed_sub, blocks):
  """One stack of figure 1: input box, embedding box, then ``blocks`` of
  ``(y, text, color key, subtitle)`` joined by arrows."""
  _box(ax, x, 0.55, w, h, source[0], 'white', sub=source[1])
  _box(ax, x, 1.6, w, 0.75, 'Embedding x sqrt(d_model)\n+ positional encoding',
       colors['emb'], sub=embed_sub)
  for y, text, c, sub in blocks:
    _box(ax, x, y, w, h, text, colors[c], sub=sub)
  _arrow(ax, x, 0.8, x, 1.22)
  _arrow(ax, x, 1.98, x, 2.75)
  for (y0, *_), (y1, *_) in zip(blocks, blocks[1:]):
    _arrow(ax, x, y0 + h / 2, x, y1 - h / 2)


def architecture_diagram(config=None, ax=None):
  """Figure 1 of the paper, drawn with the names of the functions in this
  library that implement each block.

  Args:
    config: a :class:`xfmr_jax.config.ModelConfig` for the labels (layer
      counts, widths); the paper's base model by default.
  """
  cfg = config or ModelConfig()
  ax = axes_or_new(ax, (10, 9.5))
  ax.set(xlim=(0, 10), ylim=(0, 11.6))
  ax.axis('off')
  colors = dict(attn='#fbd9a6', norm='#f6f3b5', ffn='#bfe3f5', emb='#f5c6cb',
                out='#d7c8ee', stack='#f2f2f2')
  w, h = 3.0, 0.5
  # Stacks.
  ex, dx = 2.6, 7.2
  ax.add_patch(matplotlib.patches.FancyBboxPatch(
      (ex - 1.8, 2.55), 3.6, 3.45, boxstyle='round,pad=0.05',
      facecolor=colors['stack'], edgecolor='grey'))
  ax.add_patch(matplotlib.patches.FancyBboxPatch(
      (dx - 1.8, 2.55), 3.6, 5.45, boxstyle='round,pad=0.05',
      facecolor=colors['stack'], edgecolor='grey'))
  ax.text(ex - 1.95, 4.3, f'N = {cfg.num_encoder_layers}\nEncoderLayer',
          ha='right', va='center', fontsize=8)
  ax.text(dx + 1.95, 5.3, f'N = {cfg.num_decoder_layers}\nDecoderLayer',
          ha='left', va='center', fontsize=8)
  # Encoder and decoder columns: input, embedding, then the sublayers.
  _column(ax, ex, w, h, colors, ('Inputs (source tokens)', None),
          'Embedder, sinusoidal_encoding',
          [(3.0, 'Multi-head self-attention', 'attn', 'MultiHeadAttention'),
           (3.8, 'Add & Norm', 'norm', 'Sublayer, layer_norm'),
           (4.6, 'Feed forward', 'ffn', 'feed_forward'),
           (5.4, 'Add & Norm', 'norm', 'Sublayer')])
  _column(ax, dx, w, h, colors, ('Outputs (shifted right)', 'shift_right'),
          'Embedder (shared weights)',
          [(3.0, 'Masked multi-head self-attention', 'attn',
            'causal_mask, padding_mask'),
           (3.8, 'Add & Norm', 'norm', 'Sublayer'),
           (4.6, 'Multi-head cross-attention', 'attn',
            'Q: decoder, K,V: encoder'),
           (5.4, 'Add & Norm', 'norm', 'Sublayer'),
           (6.2, 'Feed forward', 'ffn', 'feed_forward'),
           (7.0, 'Add & Norm', 'norm', 'Sublayer')])
  # Encoder output -> every decoder layer's cross-attention (K and V).
  ax.plot([ex, ex], [5.65, 6.6], color='black', lw=0.9)
  ax.plot([ex, 4.85], [6.6, 6.6], color='black', lw=0.9)
  ax.plot([4.85, 4.85], [6.6, 4.6], color='black', lw=0.9)
  _arrow(ax, 4.85, 4.6, dx - w / 2, 4.6)
  ax.text(4.95, 6.72, 'encoder output: keys and values', fontsize=7)
  # Output.
  _box(ax, dx, 8.6, w, 0.6, 'Linear (shared embedding) + softmax',
       colors['out'], sub='Embedder.attend')
  _box(ax, dx, 9.6, w, h, 'Output probabilities', 'white')
  _arrow(ax, dx, 7.25, dx, 8.3)
  _arrow(ax, dx, 8.9, dx, 9.35)
  ax.text(5, 11.2, 'The encoder-decoder Transformer (Vaswani et al., 2017, '
          'figure 1)', ha='center', fontsize=11, weight='bold')
  ax.text(5, 10.7, f'd_model = {cfg.d_model}, heads = {cfg.num_heads}, '
          f'd_k = {cfg.d_model // cfg.num_heads}, d_ff = {cfg.d_ff}, '
          f"{cfg.norm_position}-LN, positions: {cfg.positional}",
          ha='center', fontsize=9)
  ax.text(ex, 7.8, 'Attention(Q, K, V) =\nsoftmax(Q K^T / sqrt(d_k)) V\n'
          'attention.dot_product_attention', ha='center', fontsize=8,
          family='monospace', bbox=dict(facecolor='white', edgecolor='grey'))
  return ax
