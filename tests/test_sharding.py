"""Meshes and logical-axis sharding: mesh shapes here, 8-device checks in a subprocess."""

import os
import sys

import pytest

from tests.support import prefork
from tests.support.helpers import ROOT
from aft_jax import sharding


def _mesh(data, fsdp, tensor, sequence=1):
  return sharding.MeshConfig(data=data, fsdp=fsdp, tensor=tensor, sequence=sequence)


@pytest.mark.parametrize(
  "cfg, devices, expected",  # the mesh shape, or the error's message
  [
    ((-1, 1, 1), 8, (8, 1, 1, 1)),
    ((2, -1, 2), 8, (2, 2, 2, 1)),
    ((1, 4, -1), 8, (1, 4, 2, 1)),
    ((2, 2, 2), 8, (2, 2, 2, 1)),
    ((-1, 1, 1, 4), 8, (2, 1, 1, 4)),
    ((1, 2, 1, -1), 8, (1, 2, 1, 4)),
    ((2, 2, 1), 8, "2 x 2 x 1 x 1 = 4 does not match the 8 available devices"),
    ((3, -1, 1), 8, "8 devices are not divisible by 3"),
  ],
)
def test_mesh_shape(cfg, devices, expected):
  if isinstance(expected, str):
    with pytest.raises(ValueError, match=expected):
      sharding.mesh_shape(_mesh(*cfg), devices)
  else:
    assert sharding.mesh_shape(_mesh(*cfg), devices) == expected


@pytest.mark.parametrize("cfg, n", [((-1, 2, 1), 2), ((2, 1, 1), 2), ((1, 2, 2), 4)])
def test_a_mesh_of_more_cpu_devices_than_there_are_says_how_to_make_them(cfg, n):
  import jax

  with pytest.raises(ValueError) as e:
    sharding.make_mesh(_mesh(*cfg), jax.devices("cpu")[:1])
  assert f"; a CPU host makes {n} devices with --jax_num_cpu_devices={n} (or " in str(e.value)
  assert str(e.value).startswith("mesh: data")  # the mesh's own line first


def test_rules_from_config_round_trips_the_default():
  from aft_jax.trainer.default_config import get_config

  assert sharding.rules_from_config(get_config().logical_axis_rules) == sharding.DEFAULT_RULES
  assert sharding.rules_from_config(None) == sharding.DEFAULT_RULES


@pytest.mark.slow
@pytest.mark.parametrize("check", ["sharding", "sequence", "layouts", "collectives"])
def test_eight_devices_match_one(check):
  """tests/support/mesh_worker.py CHECK on 8 CPU devices (a process: jax fixes the count)."""
  proc = prefork.run(
    [sys.executable, "-m", "tests.support.mesh_worker", check],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,  # a hang guard: about 2.5 min of CPU, far longer on a busy machine
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
