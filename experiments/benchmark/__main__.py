"""``python -m experiments.benchmark``: runs :func:`cli.main`."""
import experiments.benchmark as package
from experiments.benchmark.cli import main

if __name__ == '__main__':
  package.no_compilation_cache()
  main()
