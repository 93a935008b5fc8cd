"""The toy recipe with a model that exports to Hugging Face Marian.

``experiments/configs/toy.py`` with the three settings a Marian model fixes
and the toy model leaves at the paper's choices: sinusoids laid out
sines-then-cosines, LayerNorm epsilon 1e-5, and the PAD embedding row held at
zero (Marian's decoders start from a zero vector; CTranslate2 assumes it).
Its measured quality is in docs/toy_task.md; export it with

    python -m experiments.train_wmt --config=experiments/configs/toy_marian.py --workdir=workdir/toy_marian
    python -m experiments.export_hf --workdir=workdir/toy_marian --out=toy-marian-hf
"""
from experiments.configs import toy


def get_config():
  c = toy.get_config()
  c.model.sinusoid_layout = 'halves'
  c.model.layer_norm_epsilon = 1e-5
  c.model.pad_embedding = 'zero'
  return c
