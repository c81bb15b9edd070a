"""benchmarks.quality --quick trains mixing layers alike and writes a complete table."""

import json
import math
import os

from benchmarks import quality


def test_quality_quick_writes_the_table_and_curves(tmp_path):
  # Two of the five layers: every mixing layer already trains in tests/e2e/test_recipes.py, and
  # each one here costs a train-step compilation (seconds on 2 cores).
  mixings = ["softmax", "aft_simple"]
  quality.main(["--quick", "--out", str(tmp_path), "--mixings", *mixings])
  result = json.loads((tmp_path / "quality.json").read_text())
  assert [r["mixing"] for r in result["records"]] == mixings
  for r in result["records"]:
    for key in ("valid_bpb", "test_bpb", "tokens_per_s", "wall_s"):
      assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
    assert r["num_params"] > 0 and r["steps"] == result["settings"]["num_train_steps"]
    assert r["curve"][-1] == [r["steps"], r["valid_bpb"]]  # the curve ends at the final number
  md = (tmp_path / "quality.md").read_text()
  assert all(f"| {m} |" in md for m in mixings) and "| +0.0000 |" in md  # softmax: the base
  assert os.path.getsize(tmp_path / "quality.png") > 0
