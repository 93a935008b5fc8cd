"""Sharding across devices (the checks live in ``tests/sharding_checks.py``).

They need 8 CPU devices, which must be chosen before JAX starts, and the rest of
the suite runs on one device (8 simulated devices make the in-process trainer
tests shard their batches, about 15% more CPU time). So the checks run in one
pytest subprocess with ``JAX_NUM_CPU_DEVICES=8`` and each is reported here as
its own test, with its failure message.
"""
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests import sharding_checks

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _checks():
  """One case per check, marked slow where the check's case is."""
  cases = []
  for name, fn in vars(sharding_checks).items():
    if not (name.startswith('test_') and callable(fn)):
      continue
    marks = [m for m in getattr(fn, 'pytestmark', []) if m.name == 'parametrize']
    slow = any(m.name == 'slow' for m in getattr(fn, 'pytestmark', []))
    if not marks:
      cases.append(pytest.param(name, marks=[pytest.mark.slow] * slow))
      continue
    for value in marks[0].args[1]:
      if isinstance(value, type(pytest.param(0))):
        value_marks, value = list(value.marks), value.values[0]
      else:
        value_marks = []
      cases.append(pytest.param(f'{name}[{value}]',
                                marks=value_marks + [pytest.mark.slow] * slow))
  return cases


@pytest.fixture(scope='module')
def outcomes(request, tmp_path_factory):
  # Only the checks this run selected (``-m slow`` selects the slow ones).
  selected = [item.callspec.params['check'] for item in request.session.items
              if item.originalname == 'test_sharding']
  report = tmp_path_factory.mktemp('sharding') / 'report.xml'
  env = {k: v for k, v in os.environ.items() if not k.startswith('XLA_')}
  env.update(JAX_NUM_CPU_DEVICES='8', JAX_PLATFORMS='cpu')
  # One process (-n 0): the checks share module fixtures, and pytest-xdist's
  # workers would only add their start-up.
  run = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-m',
       '', '-n', '0', f'--junitxml={report}'] +
      [f'tests/sharding_checks.py::{check}' for check in selected],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert report.exists(), run.stdout[-5000:] + run.stderr[-5000:]
  results = {}
  for case in ET.parse(report).getroot().iter('testcase'):
    problem = case.find('failure')
    if problem is None:
      problem = case.find('error')
    skipped = case.find('skipped')
    results[case.get('name')] = (
        'skipped: ' + (skipped.get('message') or '') if skipped is not None
        else None if problem is None else
        (problem.get('message') or '') + '\n' + (problem.text or ''))
  return results


@pytest.mark.parametrize('check', _checks())
def test_sharding(check, outcomes):
  assert check in outcomes, f'{check} did not run: {sorted(outcomes)}'
  assert outcomes[check] is None, outcomes[check]
