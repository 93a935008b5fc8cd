"""ml_collections configs for ``python -m experiments.train_wmt --config=...``."""
