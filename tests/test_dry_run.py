"""``train.py --dry_run --target NAME``: the recipe's steps compiled for a GPU or TPU that is not
here, and a report whose last line is one JSON object; exit 0 when it fits, 1 when not."""

import json
import subprocess

import pytest

from aft_jax import deviceless
from tests.helpers import ROOT

KEYS = {
  "target",
  "num_devices",
  "fits",
  "temp_bytes",
  "argument_bytes",
  "device_memory_bytes",
  "triton_kernels",
}


def _dry_run(*flags, config="configs/quickstart.py"):
  """(exit code, stdout lines, the last line's JSON or None) of train.py --dry_run."""
  cmd = ["python", "train.py", "--config", config, "--dry_run", *flags]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  lines = done.stdout.strip().splitlines()
  try:
    report = json.loads(lines[-1])
  except (IndexError, json.JSONDecodeError):
    report = None
  return done.returncode, lines, report, done.stderr


@pytest.mark.slow
def test_quickstart_fits_an_h100_with_the_kernels():
  code, lines, report, err = _dry_run("--target", "h100")
  assert code == 0 and report is not None, err[-2000:]
  assert KEYS <= set(report)
  assert report["fits"] and report["target"] == "h100" and report["num_devices"] == 1
  assert report["triton_kernels"] > 0 and report["impl"] == "auto"
  assert report["device_memory_bytes"] == deviceless.get("h100").memory_bytes
  assert 0 < report["temp_bytes"] < report["usable_bytes"]
  # The human part says what a person needs before renting the GPU.
  text = "\n".join(lines)
  assert "compiled for the target without a device" in text and "Fits:" in text


@pytest.mark.slow
def test_a_step_too_large_exits_1_and_says_what_would_fit():
  """A 2 x 16384 AFT-simple LM (6.4B parameters) on two devices of this machine's CPU: the
  parameters and AdamW state alone are several times the host's memory; each suggestion was
  compiled (fsdp over four devices among them)."""
  size = ("d_model=16384", "mlp_dim=65536", "mixing=aft_simple")
  flags = ("--target", "cpu", "--num_devices", "2", *(f"--config.model.{s}" for s in size))
  code, lines, report, err = _dry_run(*flags)
  assert code == 1 and report is not None, err[-2000:]
  assert not report["fits"] and report["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1}
  assert report["argument_bytes"] > report["usable_bytes"] and report["triton_kernels"] == 0
  fsdp = [s for s in report["suggestions"] if "--config.mesh.fsdp=4" in s]
  assert len(fsdp) == 1 and "(compiled)" in fsdp[0], report["suggestions"]
  assert "Does not fit" in "\n".join(lines)


def test_unknown_targets_and_a_missing_workdir_are_one_line_errors():
  with pytest.raises(ValueError, match="the targets are: t4 .*h200.*v5e.*cpu"):
    deviceless.get("k80")
  code, _, _, err = _dry_run("--target", "k80")
  assert code == 1 and "unknown target 'k80'" in err and "a100-40" in err
  assert len(err.strip().splitlines()) == 1
  done = subprocess.run(
    ["python", "train.py", "--config", "configs/quickstart.py"],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert done.returncode == 1 and "--workdir is required" in done.stderr
