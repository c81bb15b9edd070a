"""One formatter and one linter for the whole tree (configured in pyproject.toml)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("args", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff(args):
  proc = subprocess.run(
    [sys.executable, "-m", "ruff", *args, "."], cwd=ROOT, capture_output=True, text=True
  )
  assert proc.returncode == 0, f"ruff {' '.join(args)} . failed:\n{proc.stdout}{proc.stderr}"
