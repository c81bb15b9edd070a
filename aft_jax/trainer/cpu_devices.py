"""How many devices ``aft-train`` makes of a CPU host where nothing else set the count: one per
core, as many as split every batch evenly (docs/training.md, "On a CPU: one device per core").
"""

from __future__ import annotations

import os
import re

import jax

from aft_jax import sharding
from aft_jax.sharding import MeshConfig
from aft_jax.trainer.run_config import RunConfig

MAX_DEVICES = 8
XLA_COUNT_FLAG = "xla_force_host_platform_device_count"


def cores() -> int:
  """The cores this process may run on (its affinity: taskset, a container's cpuset)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def count_for(cfg: RunConfig, num_cores: int) -> int:
  """The most devices (<= cores, MAX_DEVICES) that split the batches; 1 for a user's mesh."""
  if cfg.mesh != MeshConfig():
    return 1
  batches = dict(batch_size=cfg.train.batch_size, eval_batch_size=cfg.eval.eval_batch_size)
  for n in range(min(num_cores, MAX_DEVICES), 1, -1):
    if not sharding.uneven_batches(n, **batches):
      return n
  return 1


def check_set_count() -> None:
  """A one-line ValueError where the CPU device count is set to no number of devices."""
  n = jax.config.jax_num_cpu_devices
  if n == 0 or n < -1:
    raise ValueError(
      f"jax_num_cpu_devices = {n} (JAX_NUM_CPU_DEVICES, aft-train's --jax_num_cpu_devices) is "
      "no number of CPU devices: give 1 or more, or leave it unset"
    )
  for flag in os.environ.get("XLA_FLAGS", "").split():
    name, _, value = flag.partition("=")
    if name == f"--{XLA_COUNT_FLAG}" and not (
      re.fullmatch(r"\+?[0-9]+", value) and 0 < int(value) < 2**31
    ):
      raise ValueError(
        f"XLA_FLAGS has {flag}: no number of CPU devices: give 1 or more, or leave it unset"
      )


def set_by_user() -> bool:
  """Whether jax's flag or variable, or XLA_FLAGS, set the CPU's device count already."""
  return jax.config.jax_num_cpu_devices != -1 or XLA_COUNT_FLAG in os.environ.get("XLA_FLAGS", "")


def apply(cfg: RunConfig) -> int | None:
  """Sets ``jax_num_cpu_devices`` to ``count_for`` unless the user set it; the count, or None."""
  if set_by_user():
    return None
  n = count_for(cfg, cores())
  if n == 1:
    return None
  jax.config.update("jax_num_cpu_devices", n)
  return n
