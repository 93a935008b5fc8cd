"""FFN activations by name (the ``ModelConfig.activation`` choices).

``FUNCTIONS`` feed the paper's two-matrix FFN ``f(x W1 + b1) W2 + b2``;
``GATED`` ones feed a gated FFN ``(f(x W_gate) * x W1) W2`` with a third
matrix (SwiGLU when ``f`` is swish).
"""
from __future__ import annotations

from typing import Callable

import jax

FUNCTIONS: dict[str, Callable] = {'relu': jax.nn.relu, 'gelu': jax.nn.gelu}
GATED: dict[str, Callable] = {'swiglu': jax.nn.silu}
NAMES = (*FUNCTIONS, *GATED)
