"""An ASGI app served by uvicorn on a thread of the test process, for tests
that need a real HTTP server (disconnects, a browser) without a subprocess."""
import contextlib
import socket
import threading
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, start_timeout: float = 60):
  """Yields the base URL of ``app`` served on 127.0.0.1; stops it after."""
  import uvicorn
  port = free_port()
  server = uvicorn.Server(uvicorn.Config(app, host='127.0.0.1', port=port,
                                         log_level='warning'))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.time() + start_timeout
  while not server.started:
    if time.time() > deadline or not thread.is_alive():
      raise AssertionError('the test server did not start')
    time.sleep(0.02)
  try:
    yield f'http://127.0.0.1:{port}'
  finally:
    server.should_exit = True
    thread.join(30)
