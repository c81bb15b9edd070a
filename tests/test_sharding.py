"""Meshes and logical-axis sharding: mesh shapes here, 8-device training in a subprocess."""

import json
import os
import sys

import pytest

from tests.support import prefork
from tests.support.helpers import ROOT, xla_flags
from aft_jax import sharding


def _mesh(data, fsdp, tensor, sequence=1):
  return sharding.MeshConfig(data=data, fsdp=fsdp, tensor=tensor, sequence=sequence)


@pytest.mark.parametrize(
  "cfg, devices, expected",
  [
    ((-1, 1, 1), 8, (8, 1, 1, 1)),
    ((2, -1, 2), 8, (2, 2, 2, 1)),
    ((1, 4, -1), 8, (1, 4, 2, 1)),
    ((2, 2, 2), 8, (2, 2, 2, 1)),
    ((-1, 1, 1), 1, (1, 1, 1, 1)),
    ((-1, 1, 1, 4), 8, (2, 1, 1, 4)),
    ((1, 2, 1, -1), 8, (1, 2, 1, 4)),
  ],
)
def test_mesh_shape(cfg, devices, expected):
  assert sharding.mesh_shape(_mesh(*cfg), devices) == expected


@pytest.mark.parametrize(
  "cfg, devices, message",
  [
    ((2, 2, 1), 8, "2 x 2 x 1 x 1 = 4 does not match the 8 available devices"),
    ((2, 2, 1, 3), 8, "2 x 2 x 1 x 3 = 12 does not match"),
    ((3, -1, 1), 8, "8 devices are not divisible by 3"),
  ],
)
def test_bad_mesh_is_refused(cfg, devices, message):
  with pytest.raises(ValueError, match=message):
    sharding.mesh_shape(_mesh(*cfg), devices)


@pytest.mark.parametrize("cfg, n", [((-1, 2, 1), 2), ((2, 1, 1), 2), ((1, 2, 2), 4)])
def test_a_mesh_of_more_cpu_devices_than_there_are_says_how_to_make_them(cfg, n):
  """mesh.fsdp = 2 on one CPU device: jax makes the CPU one device unless told how many."""
  import jax

  with pytest.raises(ValueError) as e:
    sharding.make_mesh(_mesh(*cfg), jax.devices("cpu")[:1])
  assert f"; a CPU host makes {n} devices with --jax_num_cpu_devices={n} (or " in str(e.value)
  assert str(e.value).startswith("mesh: data")  # the mesh's own line first


@pytest.mark.parametrize(
  "cfg, message",
  [((-1, -1, 1), "at most one of them may be -1"), ((0, 1, 1), "each must be a positive int")],
)
def test_a_bad_mesh_config_is_a_config_problem(cfg, message):
  """Checked with the run config (``MeshConfig.problems``), not again by the mesh builder."""
  assert any(message in p for p in _mesh(*cfg).problems())


def test_rules_from_config_round_trips_the_default():
  from aft_jax.trainer.default_config import get_config

  assert sharding.rules_from_config(get_config().logical_axis_rules) == sharding.DEFAULT_RULES
  assert sharding.rules_from_config(None) == sharding.DEFAULT_RULES


def _worker(check, out):
  """Runs ``python -m tests.support.mesh_worker CHECK OUT`` (its asserts are the test); its
  report."""
  proc = prefork.run(
    [sys.executable, "-m", "tests.support.mesh_worker", check, str(out)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,  # a hang guard: about 2.5 min of CPU, far longer on a busy machine
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
  return json.loads(out.read_text())


@pytest.mark.slow
def test_eight_devices_match_one(tmp_path):
  """tests/support/mesh_worker.py sharding on 8 devices: four meshes give one device's losses and
  parameters, sharded as DEFAULT_RULES say; a (2,2,2) checkpoint continues on (8,1,1)."""
  report = _worker("sharding", tmp_path / "report.json")
  assert sorted(report["meshes"]) == ["(1, 1, 8)", "(1, 4, 2)", "(2, 2, 2)", "(8, 1, 1)"]
  for mesh in report["meshes"].values():
    assert mesh["max_param_diff"] < 1e-5
  assert report["checkpoint"]["next_loss"] == pytest.approx(
    report["checkpoint"]["ref_next_loss"], abs=1e-5
  )
  assert "not divisible" in report["batch_error"]


@pytest.mark.slow
def test_sequence_split_equals_one_device(tmp_path):
  """tests/support/mesh_worker.py sequence on 4 devices: the ops under shard_map with axis_name give
  the unsharded values and gradients; mesh.sequence = 4 trains as one device; softmax
  attention with mesh.sequence > 1 is a config error."""
  report = _worker("sequence", tmp_path / "report.json")
  assert len(report["ops"]) == 4
  for diffs in report["ops"].values():
    assert diffs["y"] < 1e-5 and max(diffs.values()) < 1e-4
  for mixing in ("aft_local", "aft_simple", "aft_conv1d"):
    assert report[mixing]["sequence_4"] == pytest.approx(report[mixing]["one_device"], abs=1e-4)
  assert "mixes every pair of positions" in report["softmax_error"]


@pytest.mark.slow
def test_layouts_that_combine_axes_train_as_one_device(tmp_path):
  """tests/support/mesh_worker.py layouts: meshes combining sequence with the other axes (softmax:
  data x fsdp x tensor) train to one device's losses within 1e-4, step by step."""
  report = _worker("layouts", tmp_path / "report.json")
  assert sorted(report) == ["aft_conv1d", "aft_local", "aft_simple", "softmax"]
  assert "(2, 1, 1, 2)" in report["aft_simple"] and "(2, 2, 1, 2)" in report["aft_local"]
  for runs in report.values():
    one = runs.pop("one_device")
    for losses in runs.values():
      assert losses == pytest.approx(one, abs=1e-4)


COLLECTIVES = """
import json, re
from aft_jax.trainer import train_lib
from aft_jax.trainer.run_config import RunConfig
from tests.support.helpers import tiny_config
counts = {}
for mixing in ("softmax", "aft_simple", "aft_local", "aft_full"):
  cfg = RunConfig.from_tree(tiny_config(**{"model.mixing": mixing, "model.num_heads": 2}))
  text = train_lib.make_trainer(cfg, 256).lower_train_step().compile().as_text()
  counts[mixing] = {op: len(re.findall(f" {op}[.(]", text)) for op in OPS}
print(json.dumps(counts))
"""


@pytest.mark.slow
def test_a_data_parallel_step_of_the_causal_ops_holds_only_the_gradient_all_reduce():
  """On 2 devices (data = 2) the causal ops' train steps hold only the gradient's all-reduce,
  as softmax's (``in_mesh_shards``)."""
  ops = ("all-reduce", "all-to-all", "collective-permute", "all-gather", "reduce-scatter")
  env = dict(os.environ, XLA_FLAGS=xla_flags(2))
  code = f"OPS = {ops!r}\n" + COLLECTIVES
  proc = prefork.run(
    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  counts = json.loads(proc.stdout.strip().splitlines()[-1])
  for mixing in ("aft_simple", "aft_local", "aft_full"):
    assert counts[mixing] == counts["softmax"], counts
  assert counts["softmax"]["all-to-all"] == counts["softmax"]["collective-permute"] == 0, counts
  assert counts["softmax"]["all-reduce"] >= 1, counts
