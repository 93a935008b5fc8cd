"""host_memory.reuse_freed_memory: a large buffer freed and allocated again
reuses its pages instead of faulting them in afresh (checked by counting the
process's page faults, not by timing)."""
import os
import subprocess
import sys

import pytest

_CHILD = r'''
import resource, sys
from xfmr_jax import host_memory
applied = host_memory.reuse_freed_memory() if sys.argv[1] == 'on' else False
import numpy as np
faults = []
for _ in range(4):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  a = np.ones(64 << 20, np.uint8)  # 64 MiB, every page written
  del a
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, *faults)
'''

needs_glibc = pytest.mark.skipif(
    not sys.platform.startswith('linux'), reason='glibc malloc is Linux only')


def _run(mode, env=None):
  out = subprocess.run([sys.executable, '-c', _CHILD, mode], check=True,
                       capture_output=True, text=True, env=env).stdout.split()
  return out[0] == 'True', [int(f) for f in out[1:]]


@needs_glibc
def test_freed_buffer_is_reused_without_page_faults():
  applied, faults = _run('on')
  assert applied
  # The kernel may fault in several pages at a time, so the counts are
  # compared with the first buffer's rather than with a page count.
  assert faults[0] > 100                     # the first buffer is faulted in
  assert max(faults[1:]) < faults[0] // 10   # later ones reuse its pages
  _, default = _run('off')
  assert min(default[1:]) > default[0] // 2  # glibc's default maps it anew


@needs_glibc
def test_malloc_tunables_in_the_environment_win():
  env = dict(os.environ, MALLOC_ARENA_MAX='2')
  applied, faults = _run('on', env)
  assert not applied
  assert min(faults[1:]) > faults[0] // 2
