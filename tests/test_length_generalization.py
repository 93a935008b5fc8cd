"""The length-generalisation study script: runs, resumes and reports."""
import json
import os
import subprocess
import sys

import pytest

from experiments import length_generalization as lg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _result(scheme, seed, test_em, long_em):
  split = lambda em: dict(bleu=100 * em, exact_match=em,
                          by_length={'1': [1, 2], '31': [0, 3]})
  return dict(scheme=scheme, seed=seed, test=split(test_em),
              long=split(long_em))


def test_by_length_bins_source_words():
  samples = [dict(source=' '.join(['w'] * n), output=o, reference='r')
             for n, o in ((3, 'r'), (5, 'x'), (6, 'r'), (33, 'r'))]
  assert lg.by_length(samples) == {1: (1, 2), 6: (1, 1), 31: (1, 1)}


def test_table_averages_seeds_and_shows_their_range(tmp_path):
  results = [_result('rope', 0, 0.9, 0.4), _result('rope', 1, 0.8, 0.2),
             _result('learned', 0, 0.7, 0.0)]
  rows = lg.table(results).splitlines()
  assert rows[2].startswith('| rope | 85.0% (80.0-90.0) | 85.0 (80.0-90.0) '
                            '| 30.0% (20.0-40.0) |')
  assert rows[3].startswith('| learned | 70.0% | 70.0 | 0.0% |')
  lg.plot(results, str(tmp_path / 'p.png'))
  assert (tmp_path / 'p.png').stat().st_size > 10_000


@pytest.mark.slow
def test_study_trains_scores_both_splits_and_resumes(data_dir, tmp_path):
  args = [sys.executable, '-m', 'experiments.length_generalization',
          f'--workdir={tmp_path / "runs"}', '--schemes=alibi', '--seeds=0',
          '--steps=3', '--dataset=toy_translate/small',
          f'--data_dir={data_dir}', '--eval_limit=8',
          f'--json={tmp_path / "r.json"}', f'--plot={tmp_path / "p.png"}']
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  first = subprocess.run(args, cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
  assert first.returncode == 0, first.stderr[-3000:]
  results = json.loads((tmp_path / 'r.json').read_text())
  assert [(r['scheme'], r['seed'], r['steps']) for r in results] == [
      ('alibi', 0, 3)]
  for split in ('test', 'long'):
    assert sum(n for _, n in results[0][split]['by_length'].values()) == 8
  # The long split really is longer than every test sentence.
  assert (min(map(int, results[0]['long']['by_length'])) >
          max(map(int, results[0]['test']['by_length'])))
  assert '| alibi |' in first.stdout and (tmp_path / 'p.png').exists()
  # Run again: the finished scheme is read back, not trained again.
  second = subprocess.run(args, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
  assert second.returncode == 0, second.stderr[-3000:]
  assert 'parameters' in first.stderr and 'parameters' not in second.stderr
  assert json.loads((tmp_path / 'r.json').read_text()) == results
