"""Trains an AFT language model: python train.py --config configs/quickstart.py --workdir runs/x

The command line lives in aft_jax/train.py, which a pip install runs as ``aft-train``; this file
keeps the checkout's ``python train.py ...`` working. Its flags: ``python train.py --help``.
"""

from aft_jax.train import run

if __name__ == "__main__":
  run()
