"""aft_jax.trainer.cpu_devices: how many devices aft-train makes of a CPU host, if any."""

import sys
import types

import pytest

from aft_jax.trainer import cpu_devices
from aft_jax.trainer.run_config import RunConfig
from tests.support import prefork
from tests.support.helpers import ROOT, tiny_config


def _cfg(**overrides) -> RunConfig:
  return RunConfig.from_tree(tiny_config(**overrides))


@pytest.mark.parametrize(
  "cores, batch, eval_batch, expected",
  [
    (2, 12, 16, 2),  # nanoGPT's recipe on this machine
    (1, 12, 16, 1),
    (3, 12, 16, 2),  # 3 divides 12 but not 16
    (4, 12, 16, 4),
    (64, 12, 16, 4),  # at most MAX_DEVICES (8), then the largest that divides both
    (64, 64, 64, cpu_devices.MAX_DEVICES),
    (2, 7, 16, 1),  # an odd batch stays on one device
  ],
)
def test_one_device_per_core_as_many_as_split_every_batch(cores, batch, eval_batch, expected):
  cfg = _cfg(batch_size=batch, eval_batch_size=eval_batch)
  assert cpu_devices.count_for(cfg, cores) == expected


@pytest.mark.parametrize("mesh", [{"mesh.data": 2}, {"mesh.tensor": 2}, {"mesh.fsdp": -1}])
def test_a_mesh_the_user_laid_out_keeps_one_device(mesh):
  assert cpu_devices.count_for(_cfg(batch_size=16, **{"mesh.data": 1, **mesh}), 2) == 1


def test_a_count_set_by_xla_flags_or_jax_is_the_users_and_a_count_below_minus_1_refused(
  monkeypatch,
):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
  assert cpu_devices.set_by_user() and cpu_devices.apply(_cfg(batch_size=12)) is None
  # This session sets neither (tests/conftest.py: XLA_FLAGS without a count).
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  assert not cpu_devices.set_by_user()
  config = types.SimpleNamespace(jax_num_cpu_devices=-5)  # -5 was taken as unset, unsaid
  monkeypatch.setattr(cpu_devices, "jax", types.SimpleNamespace(config=config))
  with pytest.raises(ValueError, match=r"jax_num_cpu_devices = -5 \(JAX_NUM_CPU_DEVICES, aft"):
    cpu_devices.check_set_count()


def test_the_tools_refuse_a_device_count_that_is_no_number_of_devices(tmp_path):
  """(jax's count set as JAX_NUM_CPU_DEVICES=0 sets it, in a process that has not started jax.)"""
  code = (
    "import jax\n"
    "jax.config.update('jax_num_cpu_devices', 0)\n"
    "from aft_jax.tools import evaluate\n"
    f"evaluate.main(['--workdir', {str(tmp_path)!r}])\n"
  )
  out = prefork.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert out.returncode == 1 and len(lines) == 1, out.stderr[-2000:]
  assert lines[0].startswith("evaluate: jax_num_cpu_devices = 0 (JAX_NUM_CPU_DEVICES"), lines[0]
