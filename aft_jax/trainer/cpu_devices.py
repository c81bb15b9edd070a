"""How many devices a training run makes of a CPU host: one per core (up to ``MAX_DEVICES``),
as many as split every batch evenly, so the default mesh runs each device's share of a step on
its own core (why, and the step times: docs/training.md, "On a CPU: one device per core";
benchmarks/results/peer_nanogpt_timing.md). Only ``aft-train`` applies it, before jax starts its
backends, and only where nothing else set the count (a flag, JAX_NUM_CPU_DEVICES, XLA_FLAGS, a
multi-process run, a mesh config); a count that is no number of devices is refused in one line
(``check_set_count``).
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
  """The most devices, at most ``num_cores`` and ``MAX_DEVICES``, that split ``cfg``'s batch
  and evaluation batch evenly; 1 where ``cfg.mesh`` is not the default (the user laid out the
  devices)."""
  if cfg.mesh != MeshConfig():
    return 1
  batches = dict(batch_size=cfg.train.batch_size, eval_batch_size=cfg.eval.eval_batch_size)
  for n in range(min(num_cores, MAX_DEVICES), 1, -1):
    if not sharding.uneven_batches(n, **batches):
      return n
  return 1


def check_set_count() -> None:
  """A one-line ValueError, before jax's backends start, where the CPU device count is set (jax's
  flag or variable, or XLA_FLAGS) to no number of devices: 0 or below -1 (jax's unset) would
  fail later blaming a plugin, or be taken as unset without a word."""
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
  """Whether the CPU's device count is set already: jax's flag or environment variable
  (``jax.config.jax_num_cpu_devices`` is -1 otherwise), or a device count in XLA_FLAGS."""
  return jax.config.jax_num_cpu_devices != -1 or XLA_COUNT_FLAG in os.environ.get("XLA_FLAGS", "")


def apply(cfg: RunConfig) -> int | None:
  """Sets ``jax_num_cpu_devices`` to ``count_for(cfg, cores())`` unless the user set the count
  (``set_by_user``) or it would be 1; the count set, or None. Before jax's backends start."""
  if set_by_user():
    return None
  n = count_for(cfg, cores())
  if n == 1:
    return None
  jax.config.update("jax_num_cpu_devices", n)
  return n
