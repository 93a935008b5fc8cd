"""FFN activations by name (the ``ModelConfig.activation`` choices).

``FUNCTIONS`` feed the paper's two-matrix FFN ``f(x W1 + b1) W2 + b2``;
``GATED`` ones feed a gated FFN ``(f(x W_gate) * x W1) W2`` with a third
matrix (SwiGLU when ``f`` is swish).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax

# 'gelu' is the tanh approximation (jax.nn.gelu's default), 'gelu_exact' the
# erf form; 'silu' (also called swish) is x * sigmoid(x), Marian's choice.
FUNCTIONS: dict[str, Callable] = {
    'relu': jax.nn.relu, 'gelu': jax.nn.gelu,
    'gelu_exact': functools.partial(jax.nn.gelu, approximate=False),
    'silu': jax.nn.silu}
GATED: dict[str, Callable] = {'swiglu': jax.nn.silu}
NAMES = (*FUNCTIONS, *GATED)
