"""Trains an AFT language model: python train.py --config configs/quickstart.py --workdir runs/x

The command line lives in aft_jax/trainer/train.py, which a pip install runs as ``aft-train``;
this file keeps the checkout's ``python train.py ...`` working. Flags: ``python train.py --help``.
"""

from aft_jax.trainer.train import run

if __name__ == "__main__":
  run()
