"""The model switches an imported Marian model needs, usable by any model:
the SiLU activation, Marian's sinusoid layout, a bias on the logits and a PAD
embedding row held at zero."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from xfmr_jax import config, losses, model, train_steps, train_state


def small(**changes):
  return config.ModelConfig(**{**dict(
      vocab_size=30, d_model=16, num_heads=2, num_encoder_layers=1,
      num_decoder_layers=1, d_ff=32, max_len=32, dropout_rate=0.0),
      **changes})


def test_bad_values_name_the_field():
  with pytest.raises(ValueError, match='sinusoid_layout'):
    small(sinusoid_layout='zigzag')
  with pytest.raises(ValueError, match="sinusoid_layout='halves'"):
    small(sinusoid_layout='halves', positional='rope')
  with pytest.raises(ValueError, match='logits_bias'):
    small(logits_bias='yes')
  with pytest.raises(ValueError, match='activation'):
    small(activation='swish')
  with pytest.raises(ValueError, match='pad_embedding'):
    small(pad_embedding='none')


def _init(cfg, seed=0):
  x = jnp.ones((2, 5), jnp.int32)
  m = model.build(cfg)
  return m, nn.unbox(m.init(jax.random.key(seed), x, x)['params'])


@pytest.mark.parametrize('kind', ['encoder_decoder', 'decoder_only'])
def test_logits_bias_shifts_every_logit_and_the_training_path_agrees(kind):
  m, params = _init(small(model_kind=kind, logits_bias='learned'))
  bias = jnp.linspace(-1.0, 1.0, 30)
  params = {**params, 'logits': {'bias': bias}}
  inputs = jnp.array([[3, 4, 5, 1, 0], [6, 7, 1, 0, 0]], jnp.int32)
  targets = jnp.array([[8, 9, 1, 0, 0], [10, 11, 12, 1, 0]], jnp.int32)
  logits = m.apply({'params': params}, inputs, targets)
  no_bias = m.apply({'params': {**params, 'logits': {'bias': 0 * bias}}},
                    inputs, targets)
  np.testing.assert_allclose(logits - no_bias, jnp.broadcast_to(
      bias, logits.shape), atol=1e-5)
  # (hidden, table) of the fast loss path give the same logits.
  hidden, table = m.apply({'params': params}, inputs, targets,
                          return_hidden=True)
  np.testing.assert_allclose(losses.project(hidden, table), logits, atol=1e-5)


@pytest.mark.parametrize('mode, moves', [('learned', True), ('fixed', False)])
def test_fixed_logits_bias_stays_as_loaded_under_training(mode, moves):
  m, params = _init(small(logits_bias=mode))
  bias = jnp.linspace(-1.0, 1.0, 30)
  params = {**params, 'logits': {'bias': bias}}
  tx = optax.adam(1e-2)
  state = train_state.TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
      rng=jax.random.key_data(jax.random.key(0)),
      bad_step=jnp.full((), -1, jnp.int32))
  batch = {'inputs': jnp.array([[3, 4, 5, 1]], jnp.int32),
           'targets': jnp.array([[8, 9, 1, 0]], jnp.int32)}
  step = jax.jit(lambda s, b: train_steps.train_step(
      s, b, model=m, tx=tx, label_smoothing=0.0))
  for _ in range(3):
    state, _ = step(state, batch)
  changed = not np.allclose(state.params['logits']['bias'], bias)
  assert changed == moves
  assert not np.allclose(state.params['source_embed']['embedding'],
                         params['source_embed']['embedding'])


def test_silu_is_x_times_sigmoid():
  from xfmr_jax import activations
  x = jnp.linspace(-4, 4, 9)
  np.testing.assert_allclose(activations.FUNCTIONS['silu'](x),
                             x / (1 + np.exp(-np.asarray(x))), atol=1e-6)
  np.testing.assert_allclose(
      activations.FUNCTIONS['gelu_exact'](x),
      jax.nn.gelu(x, approximate=False), atol=1e-6)


@pytest.mark.parametrize('kind', ['encoder_decoder', 'decoder_only'])
def test_pad_embedding_zero_keeps_the_row_at_zero(kind):
  """The PAD row starts at zero, gets no gradient (the logits' and the
  lookup's), and what is stored there does not change the logits."""
  m, params = _init(small(model_kind=kind, pad_embedding='zero'))
  where = ('source_embed',) if kind == 'encoder_decoder' else ('body', 'embed')
  get = lambda tree: functools.reduce(lambda t, k: t[k], where, tree)
  table = get(params)['embedding']
  assert (table[0] == 0).all() and (table[3] != 0).any()
  x = jnp.array([[5, 6, 1, 0, 0], [7, 8, 9, 10, 1]], jnp.int32)
  y = jnp.array([[7, 8, 1, 0, 0], [3, 4, 5, 6, 1]], jnp.int32)
  apply = lambda p: m.apply({'params': p}, x, y)
  loss = lambda p: jax.nn.log_softmax(apply(p)).sum()
  grad = get(jax.grad(loss)(params))['embedding']
  assert (grad[0] == 0).all() and (grad[5] != 0).any()
  moved = jax.tree.map(lambda a: a, params)  # a copy of the dicts
  get(moved)['embedding'] = table.at[0].set(1.0)
  np.testing.assert_array_equal(apply(moved), apply(params))
  learned = get(_init(small(model_kind=kind))[1])['embedding']
  assert (learned[0] != 0).any()  # the default keeps a learned PAD row


def test_pad_embedding_zero_stays_zero_under_training():
  """Through the fast loss path and an optimizer with weight decay."""
  m, params = _init(small(pad_embedding='zero'))
  tx = optax.adamw(1e-2, weight_decay=0.1)
  state = train_state.TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
      rng=jax.random.key_data(jax.random.key(0)),
      bad_step=jnp.full((), -1, jnp.int32))
  batch = {'inputs': jnp.array([[3, 4, 5, 1], [6, 1, 0, 0]], jnp.int32),
           'targets': jnp.array([[8, 9, 1, 0], [7, 1, 0, 0]], jnp.int32)}
  step = jax.jit(lambda s, b: train_steps.train_step(
      s, b, model=m, tx=tx, label_smoothing=0.1))
  for _ in range(3):
    state, _ = step(state, batch)
  table = state.params['source_embed']['embedding']
  assert (table[0] == 0).all()
  assert not np.allclose(table[8], params['source_embed']['embedding'][8])
