"""How many devices a training run makes of a CPU host: one per core (up to ``MAX_DEVICES``),
as many as split every batch evenly.

Why: XLA:CPU runs a compiled step's operations mostly one after another, and at the sizes a
CPU trains (a few thousand tokens a step, d_model 128) its matrix-product library (YNNPACK)
does not split one product over threads: a step keeps one core busy and the rest wait. jax's
``jax_num_cpu_devices`` makes the CPU several devices; the trainer's default mesh (data = -1)
then splits each batch over them, every device runs its share of the step on its own core at
the same time, and one all-reduce sums the gradients. Measured on the 2-core machine of
benchmarks/RESULTS.md ("aft-jax beside nanoGPT", "Step time"): the quickstart's step 171 -> 81
ms, the softmax step at nanoGPT's recipe 69.5 -> 44.9 ms, the same losses to the printed digits. On
2 cores, 4 devices were slower than 2 (two devices' work on one core), hence at most one per
core; ``MAX_DEVICES`` bounds what was not measured (many-core hosts, where the replicated
optimizer update and the all-reduce grow with the count).

Only ``train.py`` (``aft-train``) applies it, before jax starts its backends (the count is fixed
then), and only where nothing else has set the count: ``--jax_num_cpu_devices`` /
``JAX_NUM_CPU_DEVICES``, an ``XLA_FLAGS`` device count, a multi-process run, or a mesh config
other than the default. In a notebook or script, ``jax.config.update("jax_num_cpu_devices", 2)``
right after ``import jax`` does the same. A GPU or TPU host is unaffected: the trainer's
devices are the accelerators there, not the CPU's. A count set to no number of devices (0, or
below -1, jax's unset; in XLA_FLAGS anything but a positive int) is refused in one line by
``aft-train`` and the tools (``check_set_count``).
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
  """A one-line ValueError where the count is set (``--jax_num_cpu_devices``,
  ``JAX_NUM_CPU_DEVICES``) to no number of devices: 0 (jax's CPU backend then fails to start,
  blaming a plugin) or below -1 (jax takes it as unset, without a word); -1 is jax's unset.
  Likewise an XLA_FLAGS count that is not a positive int (XLA prints its whole flag list when
  the backend starts, or blames a plugin). Before jax's backends start (a word that is no
  number in JAX_NUM_CPU_DEVICES jax refuses itself, when imported)."""
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
