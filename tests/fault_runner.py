"""The trainer with a fault injected at a named point of the run:

    python -m tests.fault_runner --stop_at=kill:save:8 <train_wmt flags>

runs ``python -m experiments.train_wmt <train_wmt flags>`` with
``training_loop.fault_hook`` set by :func:`stop_at`, so that a test can
interrupt a subprocess exactly at a point of its run. In-process tests set
the hook themselves (``training_loop.fault_hook = stop_at('eval')``).

Points (see ``xfmr_jax.training_loop.fault_hook``): 'step:N', 'save:N',
'eval', 'final_save', 'final_eval'. ``POINT`` sends the process SIGTERM
there (a stop request: the run checkpoints and returns); ``kill:POINT``
sends SIGKILL (a crash).
"""
import os
import signal
import sys

_FLAG = '--stop_at='


def stop_at(spec: str):
  """A ``training_loop.fault_hook`` that signals this process at ``spec``
  ('POINT' for SIGTERM, 'kill:POINT' for SIGKILL), each time it is passed."""
  kill = spec.startswith('kill:')
  point = spec[len('kill:'):] if kill else spec
  signum = signal.SIGKILL if kill else signal.SIGTERM

  def hook(name: str) -> None:
    if name == point:
      os.kill(os.getpid(), signum)
  return hook


def main() -> None:
  specs = [a[len(_FLAG):] for a in sys.argv[1:] if a.startswith(_FLAG)]
  if len(specs) != 1:
    sys.exit(f'usage: python -m tests.fault_runner {_FLAG}POINT '
             '<train_wmt flags>')
  # train_wmt reads its config overrides from sys.argv when imported, and
  # sets glibc's malloc up before jax is imported: import it first, without
  # this runner's flag.
  sys.argv = [a for a in sys.argv if not a.startswith(_FLAG)]
  from experiments import entry, train_wmt
  from xfmr_jax import training_loop
  training_loop.fault_hook = stop_at(specs[0])
  entry.run(train_wmt.main)


if __name__ == '__main__':
  main()
