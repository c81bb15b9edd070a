"""Trains an AFT language model: python train.py --config configs/quickstart.py --workdir runs/x

The command line lives in aft_jax/trainer/train.py, which a pip install runs as ``aft-train``;
this file keeps the checkout's ``python train.py ...`` working. Flags: ``python train.py --help``.
"""

import sys

try:
  from aft_jax.trainer.train import run
except KeyboardInterrupt:  # Ctrl-C while jax and the trainer are imported: nothing was done yet.
  # What aft_jax.ctrl_c does once the package is imported (one line, exit status 130); no
  # thread has started yet, so the interpreter's shutdown is safe.
  print("train.py: interrupted (Ctrl-C) while starting; nothing was written", file=sys.stderr)
  sys.exit(130)

if __name__ == "__main__":
  run()
