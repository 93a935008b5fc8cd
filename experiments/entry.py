"""How every entry point (``train_wmt``, ``translate``, ``train_tagger``,
``import_marian``, ``export_hf``) ends
on an expected failure: one line on stderr that names the field, file, line or
path, and exit code 2 for bad input (1 for a run that failed), with the
traceback only under ``-v`` / ``--verbosity``. Anything else is a bug and keeps
its traceback.

    if __name__ == '__main__':
      entry.run(main)
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys

from absl import app, flags

BAD_INPUT, FAILED = 2, 1


def verbose() -> bool:
  """Whether the user asked for ``-v`` / ``--verbosity`` on the command line."""
  return any(a.startswith(('-v', '--v')) for a in sys.argv[1:])


def quiet_libraries() -> None:
  """Warnings and errors only from absl and the libraries' loggers, unless
  the user asked for ``-v`` / ``--verbosity``."""
  if not verbose():
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)


def fail(message: str, code: int = BAD_INPUT):
  if code != FAILED:
    print(f'error: {message}', file=sys.stderr, flush=True)
    sys.exit(code)
  # A run that failed part-way (a full disk) leaves writer threads behind
  # that go on printing (tracebacks of callbacks that find their event loop
  # closed), and a progress bar or one of those prints may have left half a
  # line. Point the stderr descriptor itself at /dev/null first: a thread
  # that already holds the old stream object then writes nowhere, and the
  # last line is this one, on its own (written through a saved duplicate).
  stderr = sys.stderr
  logging.disable(logging.CRITICAL)
  for stream in (sys.stdout, stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  try:
    fd = stderr.fileno()
  except (AttributeError, OSError, ValueError):  # a replaced stream
    fd = 2
  try:
    saved = os.dup(fd)
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
  except OSError:  # no descriptor to silence: write to it as it is
    saved = fd
  sys.stderr = open(os.devnull, 'w')
  os.write(saved, f'\nerror: {message}\n'.encode())
  os._exit(code)  # their teardown would print screens more


def _config_path(argv) -> str | None:
  for i, a in enumerate(argv):
    if a.startswith('--config='):
      return a.split('=', 1)[1]
    if a == '--config' and i + 1 < len(argv):
      return argv[i + 1]
  return None


@contextlib.contextmanager
def flag_errors(argv=None):
  """Config-file and config-field errors, which ml_collections raises as
  exceptions of its own (some when the flag is defined), as one line each."""
  argv = sys.argv if argv is None else argv
  try:
    yield
  except flags.Error as e:
    fail(str(e))
  except OSError as e:
    path = _config_path(argv)
    if path and not os.path.isfile(path):
      fail(f'config file {path!r} does not exist')
    fail(f'cannot load the config file {path!r}: {e.__cause__ or e}')
  except (AttributeError, KeyError) as e:
    name = str(e).strip('"\'')
    fail(f'unknown config field {name!r} (every field is listed in '
         'experiments/configs/default.py)')
  except (TypeError, ValueError) as e:
    fail(f'bad flag value: {e}')


def parse_flags(argv):
  """absl's flag parsing, errors as one line (:func:`flag_errors`)."""
  with flag_errors(argv):
    return flags.FLAGS(argv)


def _classify(e: BaseException) -> int | None:
  """The exit code of an expected failure, None for a bug."""
  from xfmr_jax import checkpoint, run_config, training_loop
  from xfmr_jax.data import DataError
  from xfmr_jax.serving import ArtifactError
  from xfmr_jax.marian import MarianImportError
  from xfmr_jax.marian_export import MarianExportError
  from xfmr_jax.tokenizer import TokenizerError
  from xfmr_jax.constraints import ConstraintError
  from xfmr_jax.target_prefix import PrefixError
  from xfmr_jax.translate import InputTooLong
  if isinstance(e, checkpoint.CheckpointWriteError):
    return FAILED
  if isinstance(e, (run_config.ConfigError, DataError, TokenizerError,
                    InputTooLong, PrefixError, ConstraintError, ArtifactError,
                    MarianImportError, MarianExportError,
                    checkpoint.CheckpointError, FileNotFoundError,
                    NotADirectoryError, IsADirectoryError,
                    PermissionError)):
    return BAD_INPUT
  if isinstance(e, (training_loop.NonFiniteError, OSError)):
    return FAILED  # e.g. the disk filled up: the last good checkpoint stays
  return None


def run(main) -> None:
  """``app.run(main)`` with expected failures reported as one line."""
  def guarded(argv):
    try:
      return main(argv)
    except (SystemExit, KeyboardInterrupt):
      raise
    except Exception as e:  # pylint: disable=broad-except
      code = _classify(e)
      if code is None or verbose():
        raise
      fail(' '.join(str(e).split()) or type(e).__name__, code)
  app.run(guarded, flags_parser=parse_flags)
