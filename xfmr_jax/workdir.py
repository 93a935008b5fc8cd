"""The run directory (``workdir``) of a training run: what is where in it,
and loading the model it holds. ``python -m experiments.train_wmt`` (and
``experiments.import_marian``) write one; ``Translator.from_workdir``,
export and the other tools read it.

    workdir/
      tokenizer.model     the SentencePiece model the checkpoints belong to,
                          or marian_tokenizer/ (an imported Marian model's,
                          see :mod:`xfmr_jax.marian_tokenizer`)
      config.json         the resolved training config
      checkpoints/<step>/ orbax checkpoints (:mod:`xfmr_jax.checkpoint`)
      metrics.jsonl, tensorboard/, final_metrics.json

    trained = Workdir('workdir/toy').load()   # the newest checkpoint
    trained.model, trained.params, trained.tokenizer, trained.config

The model and optimizer are rebuilt from ``config.json`` with the factories
training uses (:func:`xfmr_jax.run_config.build_model`,
:func:`xfmr_jax.optim.from_config`), so that the checkpoint's tree matches.
"""
from __future__ import annotations

import json
import os
from typing import Any, NamedTuple, Union

import flax.linen as nn
import jax
import ml_collections

from xfmr_jax import checkpoint, marian_tokenizer, optim, train_state
from xfmr_jax.marian_tokenizer import MarianTokenizer
from xfmr_jax.run_config import ConfigError, build_model, model_differences
from xfmr_jax.tokenizer import MODEL_FILENAME as TOKENIZER_FILE
from xfmr_jax.tokenizer import Tokenizer

CONFIG_FILE = 'config.json'
CHECKPOINT_DIR = 'checkpoints'
FINAL_METRICS_FILE = 'final_metrics.json'

# Both have encode/decode/vocab_size/save: the rest of the library takes either.
AnyTokenizer = Union[Tokenizer, MarianTokenizer]


class Trained(NamedTuple):
  """A trained model loaded from a workdir (:meth:`Workdir.load`).

  Attributes:
    model: the Flax module of ``config.model`` and the tokenizer's vocabulary.
    params: the parameters to evaluate and translate with (the moving average
      when the run kept one, see :func:`xfmr_jax.optim.eval_params`).
    tokenizer: the workdir's tokenizer.
    config: the workdir's ``config.json``.
  """
  model: nn.Module
  params: Any
  tokenizer: AnyTokenizer
  config: ml_collections.ConfigDict


class Workdir:
  """The files of one workdir; ``path`` is kept as given (messages name it
  so), except by :meth:`load`, which names the absolute path."""

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)

  def __repr__(self) -> str:
    return f'Workdir({self.path!r})'

  @property
  def config_path(self) -> str:
    return os.path.join(self.path, CONFIG_FILE)

  @property
  def checkpoint_dir(self) -> str:
    return os.path.join(self.path, CHECKPOINT_DIR)

  @property
  def final_metrics_path(self) -> str:
    return os.path.join(self.path, FINAL_METRICS_FILE)

  @property
  def tokenizer_path(self) -> str:
    """``marian_tokenizer/`` if there is one, else ``tokenizer.model`` (which
    need not exist yet)."""
    marian = os.path.join(self.path, marian_tokenizer.DIRNAME)
    return marian if os.path.isdir(marian) else os.path.join(self.path,
                                                             TOKENIZER_FILE)

  def has_config(self) -> bool:
    return os.path.exists(self.config_path)

  def has_checkpoints(self) -> bool:
    """Whether ``checkpoints/`` exists (a run or an import made it; the
    checkpoints in it may all be damaged)."""
    return os.path.exists(self.checkpoint_dir)

  def has_tokenizer(self) -> bool:
    return os.path.exists(self.tokenizer_path)

  def has_marian_tokenizer(self) -> bool:
    return os.path.isdir(os.path.join(self.path, marian_tokenizer.DIRNAME))

  def finished(self) -> bool:
    """Whether a run ended here with its final evaluation."""
    return os.path.exists(self.final_metrics_path)

  def read_config(self) -> dict:
    """``config.json`` (a CheckpointError if it cannot be read)."""
    try:
      with open(self.config_path) as f:
        return json.load(f)
    except (OSError, ValueError) as e:
      raise checkpoint.CheckpointError(f'{self.config_path} cannot be read '
                                       f'as JSON: {e}') from None

  def write_config(self, config_json: dict) -> None:
    """``config.json``, for the tools that load the model without reading a
    checkpoint's copy (process 0 writes it)."""
    self._write_json(self.config_path, config_json)

  def write_final_metrics(self, metrics: dict) -> None:
    """``final_metrics.json`` (process 0 writes it)."""
    self._write_json(self.final_metrics_path, metrics)

  @staticmethod
  def _write_json(path: str, value: dict) -> None:
    if jax.process_index() == 0:  # the others share its filesystem or not
      with open(path, 'w') as f:
        json.dump(value, f, indent=2)

  def load_tokenizer(self) -> AnyTokenizer:
    return load_tokenizer(self.tokenizer_path)

  def checkpointer(self, **kwargs) -> checkpoint.Checkpointer:
    """A :class:`~xfmr_jax.checkpoint.Checkpointer` of ``checkpoints/``
    (``kwargs`` are its ``keep``, ``async_save`` and ``read_only``); close it
    after use."""
    return checkpoint.Checkpointer(self.checkpoint_dir, **kwargs)

  def load(self, step: int | None = None) -> Trained:
    """The model of the newest (or given) checkpoint; a CheckpointError if
    this is not a training workdir or holds no readable checkpoint, a
    ConfigError naming the fields if ``config.json`` no longer matches the
    checkpoint. Reads only: nothing in the workdir is renamed or deleted."""
    here = Workdir(os.path.abspath(self.path))
    for path in (here.tokenizer_path, here.checkpoint_dir, here.config_path):
      if not os.path.exists(path):
        raise checkpoint.CheckpointError(
            f'{here.path} is not a training workdir: {path} is missing')
    tokenizer = here.load_tokenizer()
    config = ml_collections.ConfigDict(here.read_config())
    model = build_model(config, tokenizer.vocab_size)
    tx = optim.from_config(config)
    abstract = jax.eval_shape(
        lambda: train_state.init_state(model, tx, config.seed))
    ckpt = here.checkpointer(async_save=False, read_only=True)
    try:
      restored = ckpt.restore(abstract, step)
    except checkpoint.CheckpointMismatch as e:
      raise here._mismatch(ckpt, e, config) from None
    finally:
      ckpt.close()
    if restored is None:
      raise checkpoint.CheckpointError(f'no checkpoint in {here.checkpoint_dir}')
    return Trained(model, optim.eval_params(restored[1]), tokenizer, config)

  def _mismatch(self, ckpt, error, config) -> ConfigError:
    """A config error naming the fields in which ``config.json`` differs
    from the config the checkpoint was trained with."""
    try:
      shown = model_differences(ckpt.saved_config(error.step),
                                config.to_dict())
    except Exception:  # pylint: disable=broad-except
      shown = ''  # its config is unreadable: the shapes are all there is
    if not shown:
      return ConfigError(f'{error}; nothing was changed')
    return ConfigError(
        f'{self.config_path} does not match checkpoint {error.step}: {shown} '
        '(there: the checkpoint, here: config.json). Nothing was changed; '
        'put the checkpoint\'s values back in config.json.')


def load_tokenizer(path: str) -> AnyTokenizer:
  """A tokenizer from a workdir, a ``.model`` file, a workdir's
  ``marian_tokenizer/`` or a folder of Marian's three files."""
  if os.path.isdir(path):
    path = Workdir(path).tokenizer_path
    if not os.path.exists(path) and os.path.exists(
        os.path.join(os.path.dirname(path), 'vocab.json')):
      path = os.path.dirname(path)  # a folder of Marian's three files
  if os.path.isdir(path):
    return MarianTokenizer.load(path)
  return Tokenizer.load(path)
