"""Runs in its own process with 8 simulated CPU devices (see tests/test_sharding.py).

    python -m tests.support.layouts_worker OUT.json

Mesh layouts that combine axes, on 4 devices (the first 4) and on 8: T split over ``sequence``
together with the batch (``data``, ``fsdp``) and the channels (``tensor``) for the causal AFT
layers that take a shard of T, data x fsdp x tensor for softmax attention (AFT-full's:
sharding_worker.py). Each trains the tiny model (dropout 0, no warmup) to one device's losses,
step by step (an assert); the losses go to OUT.json.
"""

import json
import math
import os
import sys

# Must precede the first jax import: the device count is fixed when the CPU backend starts.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from aft_jax import data as data_lib  # noqa: E402
from aft_jax.trainer import train_lib  # noqa: E402
from aft_jax.trainer.run_config import RunConfig  # noqa: E402
from tests.support.helpers import tiny_config, train_losses  # noqa: E402

STEPS = 3
# mixing: the (data, fsdp, tensor, sequence) layouts it trains on, on 4 devices (the first 4)
# and on 8. Those that take a shard of T: T split together with the batch and the channels.
LAYOUTS = {
  "aft_local": [(2, 1, 1, 2), (2, 2, 1, 2), (2, 1, 1, 4)],
  "aft_simple": [(2, 1, 1, 2), (1, 2, 1, 2), (2, 2, 1, 2)],
  "aft_conv1d": [(2, 1, 1, 2), (2, 2, 1, 2), (2, 1, 2, 2)],
  "softmax": [(2, 2, 2, 1)],
}


def _losses(mixing, layout, corpus):
  config = tiny_config(**{"model.mixing": mixing, "model.dropout_rate": 0.0, "warmup_steps": 0})
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor, config.mesh.sequence = layout
  devices = jax.devices()[: math.prod(layout)]
  trainer = train_lib.make_trainer(RunConfig.from_tree(config), corpus.vocab.size, devices)
  assert tuple(trainer.mesh.shape.values()) == layout, trainer.mesh
  return train_losses(trainer, corpus.splits["train"], STEPS)


def main(out_path):
  assert jax.device_count() == 8, jax.devices()
  corpus = data_lib.load_corpus(RunConfig.from_tree(tiny_config()).data)
  report = {}
  for mixing, layouts in LAYOUTS.items():
    one = _losses(mixing, (1, 1, 1, 1), corpus)
    report[mixing] = {"one_device": one}
    for layout in layouts:
      losses = _losses(mixing, layout, corpus)
      np.testing.assert_allclose(losses, one, rtol=0, atol=1e-4, err_msg=f"{mixing} {layout}")
      report[mixing][str(layout)] = losses
  with open(out_path, "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
