"""Stream: AFT with a learned decay and no position embedding, byte-level on the Python
documentation text (no download), CPU; the quickstart's size and schedule.

A stream reads and writes text of any length at a constant cost per token (docs/training.md,
"Streams"). Each channel's bias falls linearly with distance (decay learned per channel) and a
learned bonus weighs the current token, so the state stays a recent weighted mean at any length:
scored with its whole past, the last 64 bytes of a longer text are better predicted than alone
(about 0.1-0.15 nats per byte at 16 and 64 times the training length; about 1.57 nats per byte on
texts of 64 bytes, softmax with learned positions about 1.64: benchmarks/RESULTS.md, "Streams").
With ``--config.model.mixing=softmax --config.model.position_embedding=learned`` it is the
softmax baseline it is compared with (benchmarks/RESULTS.md, "Streams").
"""

from aft_jax.trainer import recipes


def get_config():
  config = recipes.load("quickstart")
  config.model.mixing = "aft_decay"
  config.model.position_embedding = "none"
  return config
