"""The training recipes; installed as the package aft_jax.configs (see setup.py)."""
