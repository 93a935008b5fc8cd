"""The parameter tree of every model kind, pinned.

Checkpoints store parameters by path, so a path or shape that changes makes
every saved checkpoint unrestorable. The expected trees are written out here
from the naming scheme (independently of the modules that create them).
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from xfmr_jax import config, model

V, D, H, F, L = 40, 16, 2, 24, 2  # vocab, width, heads, FFN width, max_len


def cfg(**changes):
  return config.ModelConfig(**{**dict(
      vocab_size=V, d_model=D, num_heads=H, num_encoder_layers=2,
      num_decoder_layers=2, d_ff=F, max_len=32), **changes})


def tree_of(c):
  x = jnp.ones((1, 4), jnp.int32)
  boxed = jax.eval_shape(model.build(c).init, jax.random.key(0), x, x)
  flat = jax.tree_util.tree_flatten_with_path(nn.unbox(boxed)['params'])[0]
  return {'/'.join(k.key for k in path): tuple(v.shape) for path, v in flat}


def dense(prefix, d_in, d_out, bias=True):
  out = {f'{prefix}/kernel': (d_in, d_out)}
  if bias:
    out[f'{prefix}/bias'] = (d_out,)
  return out


def norm(prefix, rms=False):
  return {f'{prefix}/scale': (D,), **({} if rms else {f'{prefix}/bias': (D,)})}


def attention(prefix, kv_heads=H, bias=True):
  kv = kv_heads * (D // H)
  return {**dense(f'{prefix}/query', D, D, bias),
          **dense(f'{prefix}/key', D, kv, bias),
          **dense(f'{prefix}/value', D, kv, bias),
          **dense(f'{prefix}/out', D, D, bias)}


def ffn(prefix, gated=False, bias=True):
  if gated:
    return {f'{prefix}/wi': (D, F), f'{prefix}/wo': (F, D),
            f'{prefix}/wi_gate': (D, F)}
  out = {f'{prefix}/wi': (D, F), f'{prefix}/wo': (F, D)}
  if bias:
    out.update({f'{prefix}/bi': (F,), f'{prefix}/bo': (D,)})
  return out


def encoder_layer(p, rms=False, kv_heads=H, bias=True, gated=False):
  return {**attention(f'{p}/self_attention', kv_heads, bias),
          **norm(f'{p}/attention_block/norm', rms),
          **ffn(f'{p}/ffn', gated, bias), **norm(f'{p}/ffn_block/norm', rms)}


def decoder_layer(p, **kw):
  rms = kw.get('rms', False)
  return {**attention(f'{p}/self_attention', kw.get('kv_heads', H),
                      kw.get('bias', True)),
          **norm(f'{p}/self_attention_block/norm', rms),
          **attention(f'{p}/cross_attention', kw.get('kv_heads', H),
                      kw.get('bias', True)),
          **norm(f'{p}/cross_attention_block/norm', rms),
          **ffn(f'{p}/ffn', kw.get('gated', False), kw.get('bias', True)),
          **norm(f'{p}/ffn_block/norm', rms)}


def scanned(tree, prefix, layers=2):
  """One ``prefix`` entry with a leading layers axis instead of prefix_0.."""
  out = {}
  for path, shape in tree.items():
    head, _, rest = path.partition('/')
    if head == f'{prefix}_0':
      out[f'{prefix}/{rest}'] = (layers, *shape)
    elif not head.startswith(f'{prefix}_'):
      out[path] = shape
  return out


def encoder_decoder(shared=True, **kw):
  tree = {'source_embed/embedding': (V, D)}
  for i in range(2):
    tree.update(encoder_layer(f'encoder_{i}', **kw))
    tree.update(decoder_layer(f'decoder_{i}', **kw))
  if not shared:
    tree.update({'target_embed/embedding': (V, D), 'logits/kernel': (D, V)})
  return tree


def test_encoder_decoder_tree():
  assert tree_of(cfg()) == encoder_decoder()


def test_unshared_embeddings_add_target_embedding_and_output_kernel():
  assert tree_of(cfg(share_embeddings=False)) == encoder_decoder(shared=False)


@pytest.mark.parametrize('remat', [False, True])
def test_scan_layers_stacks_each_layer_stack(remat):
  expected = scanned(scanned(encoder_decoder(), 'encoder'), 'decoder')
  assert tree_of(cfg(scan_layers=True, remat=remat)) == expected


def test_variant_tree():
  got = tree_of(cfg(norm_position='pre', norm_type='rmsnorm',
                    activation='swiglu', num_kv_heads=1, use_bias=False,
                    positional='learned'))
  expected = encoder_decoder(rms=True, kv_heads=1, bias=False, gated=True)
  expected.update({'source_embed/position_embedding': (32, D),
                   **norm('encoder_norm', rms=True),
                   **norm('decoder_norm', rms=True)})
  assert got == expected


def test_peri_ln_adds_an_output_norm_to_every_sublayer_and_final_norms():
  expected = encoder_decoder()
  for path in list(expected):
    if path.endswith('_block/norm/scale'):
      expected.update(norm(path[:-len('/norm/scale')] + '/output_norm'))
  expected.update({**norm('encoder_norm'), **norm('decoder_norm')})
  assert tree_of(cfg(norm_position='peri')) == expected
  assert len(expected) == len(encoder_decoder()) + 2 * (2 * 3 + 2 * 2) + 4


@pytest.mark.parametrize('changes', [
    dict(attention_kind='local', attention_window=3,
         attention_global_tokens=1),
    dict(attention_kind='linear'),
    dict(attention_kind='linear', linear_feature_map='favor'),
])
def test_local_and_linear_attention_add_no_parameters(changes):
  """FAVOR+'s random projection is drawn from favor_seed, not learned."""
  assert tree_of(cfg(**changes)) == encoder_decoder()
  assert tree_of(cfg(model_kind='decoder_only', **changes)) == tree_of(
      cfg(model_kind='decoder_only'))


@pytest.mark.parametrize('shared, scan', [(True, False), (False, True)])
def test_decoder_only_tree(shared, scan):
  tree = {'body/embed/embedding': (V, D)}
  for i in range(2):
    tree.update(encoder_layer(f'body/layer_{i}'))
  if scan:
    tree = {('body/layer/' + k.split('/', 2)[2] if k.startswith('body/layer_0/')
             else k): ((2, *v) if k.startswith('body/layer_0/') else v)
            for k, v in tree.items() if not k.startswith('body/layer_1/')}
  if not shared:
    tree['logits/kernel'] = (D, V)
  got = tree_of(cfg(model_kind='decoder_only', share_embeddings=shared,
                    scan_layers=scan))
  assert got == tree


def test_encoder_only_tree():
  tree = {'body/embed/embedding': (V, D), **dense('head', D, 5)}
  for i in range(2):
    tree.update(encoder_layer(f'body/layer_{i}'))
  assert tree_of(cfg(model_kind='encoder_only', num_labels=5)) == tree


@pytest.mark.parametrize('shared', [True, False])
def test_param_count_counts_every_parameter(shared):
  x = jnp.ones((1, 4), jnp.int32)
  boxed = model.build(cfg(share_embeddings=shared)).init(jax.random.key(0), x,
                                                         x)
  expected = sum(math.prod(s) for s in encoder_decoder(shared).values())
  assert model.param_count(boxed['params']) == expected  # boxed by init
  assert model.param_count(nn.unbox(boxed)['params']) == expected
  assert model.param_count(boxed) == expected  # the whole variables dict


@pytest.mark.parametrize('bias', ['learned', 'fixed'])
@pytest.mark.parametrize('kind', ['encoder_decoder', 'decoder_only'])
def test_logits_bias_adds_one_vocab_vector(bias, kind):
  base = tree_of(cfg(model_kind=kind))
  got = tree_of(cfg(model_kind=kind, logits_bias=bias,
                    sinusoid_layout='halves', activation='silu'))
  assert got == {**base, 'logits/bias': (V,)}
