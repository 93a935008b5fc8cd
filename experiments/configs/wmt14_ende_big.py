"""WMT14 English-German, the paper's big model (Table 3, row "big")."""
from experiments.configs import wmt14_ende_base


def get_config():
  c = wmt14_ende_base.get_config()
  c.model.update(d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3)
  c.num_train_steps = 300_000
  return c
