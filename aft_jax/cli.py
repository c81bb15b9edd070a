"""The ``aft-prepare`` console script (pyproject.toml's [project.scripts]).

The other commands' modules have their own entry points: ``aft-train`` is aft_jax/train.py's
``run``; ``aft-generate``, ``aft-evaluate`` and ``aft-export`` are the ``main`` functions of
aft_jax/generate.py, evaluate.py and export.py.
"""

import sys


def prepare():
  """``aft-prepare``: python -m aft_jax.data.prepare (argparse, not absl)."""
  from aft_jax.data import prepare as prepare_lib

  try:
    prepare_lib.main()  # returns the summary it printed; the exit status is 0
  except ValueError as e:  # bad or missing data: the message says what to do
    sys.exit(f"error: {type(e).__name__}: {e}")
