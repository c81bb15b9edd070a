"""ruff for the whole tree (pyproject.toml); no diary in the package, configs and docs."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# An issue number, a date, a time of day, a load figure: for benchmarks/results/ only.
DIARY = re.compile(
  r"\bissue\s*#?\d+|\(issue\b|\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}:\d{2}(\s*-\s*\d{1,2}:\d{2})?\s*UTC\b"
  r"|\bload average|\bload (of |about |at )?\d|\bsteal\b|\bstolen\b|another engineer",
  re.IGNORECASE,
)


@pytest.mark.parametrize("args", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff(args):
  proc = subprocess.run([sys.executable, "-m", "ruff", *args, "."], cwd=ROOT, capture_output=True)
  assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


def _read(path):
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    return f.read()


def test_no_issue_numbers_dates_times_or_load_figures_outside_the_results():
  paths = [
    os.path.relpath(p, ROOT)
    for pattern in ("aft_jax/**/*.py", "aft_jax/**/*.txtpb", "configs/*.py", "docs/*.md",
                    "benchmarks/*.py")
    for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)
  ] + ["README.md", "train.py", "benchmarks/RESULTS.md"]  # fmt: skip
  assert len(paths) > 50
  found = [
    f"{path}:{i}: {line.strip()}"
    for path in sorted(paths)
    for i, line in enumerate(_read(path).splitlines(), 1)
    if DIARY.search(line)
  ]
  assert not found, "\n".join(found)


def test_the_result_and_development_pages_stay_short():
  assert len(_read("benchmarks/RESULTS.md").splitlines()) <= 250
  assert len(_read("docs/development.md").splitlines()) <= 120
