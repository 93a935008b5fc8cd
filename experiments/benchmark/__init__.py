r"""Train-step, decoding and PyTorch-comparison benchmarks, and a one-shot GPU check.

    python -m experiments.benchmark [--sizes toy,small,base] [--json PATH]
    python -m experiments.benchmark --gpu_check [--json PATH]   # or gpu_check.sh

For every size it measures, alternating round by round (so a machine shared
with other jobs slows every contender alike); each train-step contender runs
in a fresh process of its own, one at a time (``isolated``; ``--in_process``
times them side by side in one process, where they slow each other), and the
decoders run in this process:

* our jitted train step (``xfmr_jax.train_steps``: model, label-smoothed
  loss, Adam with the paper schedule, dropout 0.1) and its variants without
  dropout, with ``scan_layers`` and with ``remat``: median step time,
  tokens/s, compile time of the first step, memory, model FLOPs per step and
  MFU against a float32 ``jnp.dot`` peak measured in the same rounds;
* the same model in PyTorch (``torch.nn.Transformer`` with shared, scaled
  embeddings, sinusoidal positions, tied output projection, label-smoothed
  cross-entropy, ``torch.optim.Adam``), if torch is installed, with dropout
  where ours has it (``torch``: embeddings and sublayer outputs, the paper's
  sites) and, as a second row, with ``nn.Transformer``'s own sites
  (``torch_default``: also the attention weights and the FFN's hidden layer,
  extra random masks and multiplies that ours does not do, so that row is not
  the same computation). Ratios are against ``torch``, the same computation.
  The package makes PyTorch's OpenMP threads wait passively (below); the row
  ``torch_active`` is the same step as ``torch`` in a child process that
  imported torch under the user's policy (by default none: OpenMP spins a
  while before sleeping), driven round by round from here (``torch_worker``),
  and the report prints our step's ratio to it too (``marian`` likewise
  gives transformers the user's policy);
* the yardstick ``flax_wmt``: google/flax ``examples/wmt``'s Linen model
  (pre-LN, shared embedding, ``nn.MultiHeadDotProductAttention``) and train
  step (one-hot label smoothing, ``optax.adamw``, donated state), re-written
  in ``flax_wmt`` with the same sizes and dropout sites as ours, timed in the
  same rounds; the report prints our step's ratio to it;
* decoding: generated tokens/s for cached greedy and beam-4 search, the
  uncached recompute (``decode.naive_greedy_decode``), the flax example's
  beam-4 search (``flax_wmt_beam``: its ``lax.while_loop`` that gathers the
  whole cache every step and whose cross-attention projects the tiled
  encoder output every step; ``beam4_vs_flax_wmt`` = ours / its tokens/s)
  and a PyTorch naive greedy loop on the same model size; and cached greedy
  decoding of ONE sentence: ms per token against the time to read the
  model's parameters once at a memory bandwidth measured in the same rounds
  (a jitted ``jnp.sum`` over 256 MB).

Timings are wall-clock medians after warm-up. Each contender runs for at
least ``common.MIN_ROUND_S`` per round (a short step several times; its time
is the window over the count). Each timed window also measures the foreign
CPU load, the cores other jobs kept busy (``load``: ``/proc/stat`` less this
process, its children and workers); a round in which it exceeded
``load.DISTURBED_LOAD`` is run again, all contenders, up to
``load.MAX_RETRIES`` times, and the report warns when kept rounds were still
disturbed. Model FLOPs are counted
analytically (matmuls and attention, backward = 2 x forward, remat's
recomputation not counted). MFU = model FLOP/s / measured matmul FLOP/s.

The parts: ``cli`` (the command line, run by ``__main__``), ``common`` (sizes,
machine description, timing and FLOP counting), ``load`` (foreign CPU load),
``isolated`` (a process per contender), ``train``, ``torch_reference``,
``torch_worker`` (``torch_active`` in one process),
``decode``, ``flax_wmt`` and ``flax_wmt_beam`` (the yardstick),
``gpu_check`` and ``report`` (tables and JSON). Three benchmarks
have commands of their own: ``python -m experiments.benchmark.data_pipeline``
(the input pipeline, docs/data.md), ``python -m experiments.benchmark.serving``
(the HTTP service, docs/serving.md) and ``python -m experiments.benchmark.engines``
(translation engines on one opus-mt-shaped model: this library, CTranslate2
float32 and int8, ``transformers``' ``generate``).
"""
import os

# PyTorch's OpenMP threads busy-wait between parallel regions by default; on
# a machine shared with other jobs that spinning takes cores from whatever
# runs next and slows its own steps too. Passive waiting is the fair setting
# there; export OMP_WAIT_POLICY=ACTIVE to override. Set here, in the package,
# so that it is in place before any part imports jax or torch. The row
# ``torch_active`` runs PyTorch in a child process under the policy the user
# had (``USER_OMP_WAIT_POLICY``; None: OpenMP's default), see ``torch_worker``.
USER_OMP_WAIT_POLICY = os.environ.get('OMP_WAIT_POLICY')
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')


def cold_env() -> dict:
  """The environment for a child process whose compile or start-up is timed:
  without ``JAX_COMPILATION_CACHE_DIR``, so that a persistent compilation cache
  the caller's environment names cannot replay earlier compiles."""
  return {k: v for k, v in os.environ.items()
          if k != 'JAX_COMPILATION_CACHE_DIR'}


def no_compilation_cache():
  """This process's compiles are timed cold, whatever the environment says.
  The commands call it first thing: JAX decides whether to use the cache at
  a process's first compile."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_enable_compilation_cache', False)
