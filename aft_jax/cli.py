"""Console scripts for the commands whose modules run as ``python -m aft_jax.<module>``.

pyproject.toml's [project.scripts] points here. Each function imports its module only when
called: the modules define absl flags with the same names (--workdir), and a flag may be defined
only once per process. ``aft-train`` is aft_jax/train.py's own ``run``.
"""

import importlib
import sys


def _absl_main(module: str):
  from absl import app

  app.run(importlib.import_module(module).main)


def generate():
  """``aft-generate``: python -m aft_jax.generate."""
  _absl_main("aft_jax.generate")


# The evaluate and export commands (python -m aft_jax.evaluate / aft_jax.export) follow the same
# pattern: def evaluate(): _absl_main("aft_jax.evaluate"), and a line in [project.scripts].


def prepare():
  """``aft-prepare``: python -m aft_jax.data.prepare (argparse, not absl)."""
  from aft_jax.data import prepare as prepare_lib

  try:
    prepare_lib.main()  # returns the summary it printed; the exit status is 0
  except ValueError as e:  # bad or missing data: the message says what to do
    sys.exit(f"error: {type(e).__name__}: {e}")
