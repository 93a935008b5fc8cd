"""Runnable entry points: ``python -m experiments.<name>``.

Every one of them first lets glibc's malloc reuse freed memory (see
:mod:`xfmr_jax.host_memory`): this runs before any of them imports jax.
"""
from xfmr_jax import host_memory

host_memory.reuse_freed_memory()
