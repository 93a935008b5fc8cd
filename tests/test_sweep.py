"""The recipe sweep's trials name real config fields with valid values, and
its table reports what the runs wrote (no training here)."""
from experiments import sweep
from experiments.configs import toy
from xfmr_jax import run_config


def test_every_trial_is_a_valid_config():
  for name, overrides in sweep.TRIALS.items():
    c = toy.get_config()
    for dotted, value in overrides.items():
      node, *rest = dotted.split('.')
      target = c[node] if rest else c
      key = rest[0] if rest else node
      assert key in target, f'{name}: unknown field {dotted}'
      target[key] = value
    run_config.validate_config(c)  # raises ConfigError on a bad value


def test_table_has_one_row_per_trial_with_its_scores():
  results = [
      dict(name='base', overrides={'batch_size': 64}, parameters=2.27e6,
           train_tokens_per_sec=15000.0, train_steps_per_sec=2.1,
           val_exact_match={200: 0.344}, steps=400, test_exact_match=0.86,
           test_bleu=96.7, wall_seconds=216.0),
      dict(name='b32', overrides={'batch_size': 32}, parameters=2.27e6,
           train_tokens_per_sec=15100.0, train_steps_per_sec=4.3,
           val_exact_match={400: 0.698}, steps=800, test_exact_match=0.894,
           test_bleu=95.16, wall_seconds=204.0),
      dict(name='broken', error='exit 2: error: bad'),
  ]
  lines = sweep.table(results).splitlines()
  assert 'val EM@200' in lines[0] and 'val EM@400' in lines[0]
  assert len(lines) == 2 + len(results)
  assert '| base | batch_size=64 | 2.27M | 15,000 | 2.10 | 34.4 |  | 400 | 86.0' \
      in lines[2]
  assert '|  | 69.8 | 800 | 89.4 | 95.16 | 3.4 min |' in lines[3]
  assert 'error: exit 2' in lines[4]
