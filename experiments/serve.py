"""Serve translations over HTTP from an exported translator or a workdir.

    python -m experiments.serve --artifact=ARTIFACT --port=8000
    python -m experiments.serve --workdir=DIR      # every decoding option

    curl -s localhost:8000/translate -d '{"texts": ["a sentence"]}'
    curl -s localhost:8000/health; curl -s localhost:8000/metrics
    curl -s 'localhost:8000/metrics?format=prometheus'

An artifact runs the plain search without model code; a training workdir is
served with the model, so that requests may also ask for n-best lists,
prefixes, constraints, anti-repetition and alignments (see
``xfmr_jax/service_request.py``). Concurrent requests are batched dynamically; the queue is bounded
(``--max_queue``, 503), requests have a deadline (``--request_timeout_s``,
504) and, with ``--api_keys_file``, need a key (401); see
``xfmr_jax/service.py``.
SIGTERM (or Ctrl-C) stops accepting connections, finishes the requests in
flight, and exits 0.
"""
from __future__ import annotations

import os
import signal
import time

from absl import flags

from experiments import entry
from xfmr_jax.extras import require

_ARTIFACT = flags.DEFINE_string('artifact', None,
                                'Folder written by experiments.export.')
_WORKDIR = flags.DEFINE_string('workdir', None,
                               'Training workdir to serve with every decoding '
                               'option.')
_STEP = flags.DEFINE_integer('step', None, 'With --workdir: the checkpoint '
                             'step; default newest.')
_BEAMS = flags.DEFINE_list('beam_sizes', ['4', '1'], 'With --workdir: the '
                           'beam sizes requests may ask for (the first is the '
                           'default).')
_HOST = flags.DEFINE_string('host', '127.0.0.1', 'Address to listen on.')
_PORT = flags.DEFINE_integer('port', 8000, 'Port to listen on.')
_MAX_BATCH = flags.DEFINE_integer('max_batch', None,
                                  'Sentences per decoder call (default: the '
                                  'artifact\'s batch size).')
_MAX_WAIT = flags.DEFINE_float('max_wait_ms', 0.0,
                               'How long an idle decoder waits for a batch to '
                               'fill (0: start at once; batches still form '
                               'under load).')
_MAX_TEXTS = flags.DEFINE_integer('max_texts', 64, 'Texts per request.')
_MAX_CHARS = flags.DEFINE_integer('max_chars', 4000, 'Characters per text.')
_MAX_BODY = flags.DEFINE_integer('max_body_bytes', 1 << 20,
                                 'Largest request body.')
_MAX_QUEUE = flags.DEFINE_integer('max_queue', 4096,
                                  'Sentences that may wait for the decoder; '
                                  'beyond, 503 with Retry-After.')
_TIMEOUT = flags.DEFINE_float('request_timeout_s', 60.0,
                              'Seconds a request may take before it gets 504 '
                              '(0: no deadline).')
_API_KEYS = flags.DEFINE_string('api_keys_file', None,
                                'File of API keys, one per line (# comments); '
                                'if given, /translate and /metrics need one.')
_WARM_UP = flags.DEFINE_bool('warm_up', False,
                              'Compile every beam size, bucket and batch size '
                              'before accepting requests.')
_CACHE = flags.DEFINE_string('compilation_cache_dir', None,
                             'Keep compiled executables in this folder (jax\'s '
                             'persistent cache), so a restart skips compiling. '
                             'Only use a folder no one untrusted can write to.')
_GRACE = flags.DEFINE_integer('shutdown_timeout', 60,
                              'Seconds to finish in-flight requests on SIGTERM.')


def read_api_keys(path: str) -> list[str]:
  """The keys of ``--api_keys_file``: one per line, blank lines and ``#``
  comments skipped; an unreadable file or one without a key fails."""
  try:
    with open(path, encoding='utf-8') as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    entry.fail(f'--api_keys_file {path!r} cannot be read: {e}')
  keys = [line.strip() for line in lines
          if line.strip() and not line.lstrip().startswith('#')]
  if not keys:
    entry.fail(f'--api_keys_file {path!r} holds no key')
  if any(len(k) < 16 or any(c.isspace() for c in k) for k in keys):
    entry.fail(f'--api_keys_file {path!r}: every key must be at least 16 '
               'characters without spaces (e.g. python -c "import secrets; '
               'print(secrets.token_urlsafe(32))")')
  return keys


def main(argv):
  if len(argv) > 1:
    entry.fail(f'unexpected arguments: {argv[1:]}')
  if (_ARTIFACT.value is None) == (_WORKDIR.value is None):
    entry.fail('give exactly one of --artifact and --workdir')
  for name, value, low in (('port', _PORT.value, 0),
                           ('max_batch', _MAX_BATCH.value or 1, 1),
                           ('max_texts', _MAX_TEXTS.value, 1),
                           ('max_chars', _MAX_CHARS.value, 1),
                           ('max_body_bytes', _MAX_BODY.value, 1),
                           ('max_queue', _MAX_QUEUE.value, 1)):
    if value < low:
      entry.fail(f'--{name} must be at least {low}, got {value}')
  for name, value in (('max_wait_ms', _MAX_WAIT.value),
                      ('request_timeout_s', _TIMEOUT.value)):
    if value < 0:
      entry.fail(f'--{name} must be >= 0, got {value}')
  keys = read_api_keys(_API_KEYS.value) if _API_KEYS.value else ()
  try:
    beam_sizes = list(dict.fromkeys(int(b) for b in _BEAMS.value))
  except ValueError:
    entry.fail(f'--beam_sizes must be integers, got {_BEAMS.value}')
  if not beam_sizes or min(beam_sizes) < 1:
    entry.fail(f'--beam_sizes must be at least 1, got {_BEAMS.value}')
  entry.quiet_libraries()
  uvicorn = require('uvicorn', 'python -m experiments.serve')
  if _CACHE.value:
    import jax
    jax.config.update('jax_compilation_cache_dir', _CACHE.value)
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  from xfmr_jax import serving, service
  if _ARTIFACT.value is not None:
    path = _ARTIFACT.value
    translator = serving.load(path)
  else:
    from xfmr_jax.workdir_translator import WorkdirTranslator
    path = _WORKDIR.value
    if not os.path.isdir(path):
      entry.fail(f'--workdir {path!r} is not a directory')
    translator = WorkdirTranslator(path, beam_sizes=beam_sizes,
                                   step=_STEP.value)
  if _WARM_UP.value:
    start = time.time()
    count = translator.warm_up()
    print(f'compiled {count} executables in {time.time() - start:.1f} s',
          flush=True)
  app = service.make_app(
      translator, max_batch=_MAX_BATCH.value, max_wait_ms=_MAX_WAIT.value,
      max_texts=_MAX_TEXTS.value, max_chars=_MAX_CHARS.value,
      max_body_bytes=_MAX_BODY.value, max_queue=_MAX_QUEUE.value,
      request_timeout_s=_TIMEOUT.value, api_keys=keys)
  server = uvicorn.Server(uvicorn.Config(
      app, host=_HOST.value, port=_PORT.value, log_level='warning',
      timeout_graceful_shutdown=_GRACE.value))
  # uvicorn shuts down gracefully on SIGTERM/SIGINT and then re-raises the
  # signal to the handler that was installed before it; with Python's
  # default handler that would kill the process after a clean shutdown, so a
  # no-op handler lets it end with exit status 0.
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: None)
  print(f'serving {path} on http://{_HOST.value}:{_PORT.value} '
        f'(beam sizes {translator.beam_sizes})', flush=True)
  server.run()
  print('stopped', flush=True)


if __name__ == '__main__':
  entry.run(main)
