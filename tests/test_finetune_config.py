"""Fine-tuning settings: the linear schedule, config.init_from and the
checks that name a bad field."""
import json
import os

import numpy as np
import pytest

from experiments.configs import finetune
from xfmr_jax import optim, run_config
from xfmr_jax.finetune import apply_init_from
from xfmr_jax.workdir import CONFIG_FILE


def test_linear_schedule_warms_up_then_decays_to_near_zero():
  sched = optim.linear_schedule(1e-3, warmup_steps=4, total_steps=10)
  rates = np.asarray([float(sched(c)) for c in range(10)])
  np.testing.assert_allclose(rates[:4], [2.5e-4, 5e-4, 7.5e-4, 1e-3])
  assert np.all(np.diff(rates[3:]) < 0) and 0 < rates[-1] < 2e-4


def test_finetune_config_checks_name_the_field(tmp_path):
  config = finetune.get_config()
  config.lr_schedule = 'cosine'
  with pytest.raises(run_config.ConfigError, match='lr_schedule'):
    run_config.validate_config(config)
  config.lr_schedule, config.learning_rate = 'linear', 0.0
  with pytest.raises(run_config.ConfigError, match='learning_rate'):
    run_config.validate_config(config)
  config.learning_rate, config.beam_rules = 1e-4, 'marian'
  with pytest.raises(run_config.ConfigError, match='beam_rules'):
    run_config.validate_config(config)
  config.init_from = str(tmp_path / 'absent')
  with pytest.raises(run_config.ConfigError, match='init_from'):
    apply_init_from(config)
  config.init_from = str(tmp_path)
  with pytest.raises(run_config.ConfigError, match='config.json'):
    apply_init_from(config)


def test_init_from_takes_the_model_but_keeps_dropout(tmp_path):
  saved = finetune.get_config()
  saved.model.update(d_model=64, num_heads=2, dropout_rate=0.3,
                     logits_bias='fixed')
  saved.vocab_size = 123
  with open(os.path.join(tmp_path, CONFIG_FILE), 'w') as f:
    json.dump(json.loads(saved.to_json_best_effort()), f)
  config = finetune.get_config()
  config.init_from = str(tmp_path)
  resolved = apply_init_from(config)
  assert resolved.model.d_model == 64 and resolved.model.logits_bias == 'fixed'
  assert resolved.vocab_size == 123
  assert resolved.model.dropout_rate == config.model.dropout_rate == 0.1
  assert config.model.d_model == 512   # the given config is left as it was
