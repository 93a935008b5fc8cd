"""Runnable entry points: ``python -m experiments.<name>``."""
