"""``python -m experiments.benchmark``: runs :func:`cli.main`."""
from experiments.benchmark.cli import main

if __name__ == '__main__':
  main()
