"""train.py on the WikiText-103 and enwik8 recipes, with fake data in the official formats given
offline (tests/e2e/test_recipes.py trains every variant of both in-process)."""

import json
import os
import subprocess

import numpy as np
import pytest

from tests.support import fake_enwik8, fake_wikitext
from tests.support.helpers import ROOT, train_py


@pytest.mark.slow
def test_wikitext_recipe_trains_on_fake_data(tmp_path):
  manual = str(tmp_path / "manual")
  fake_wikitext.write_extracted(manual, "v1")
  data_dir, workdir = str(tmp_path / "data"), str(tmp_path / "run")
  cmd = train_py(
    workdir,
    f"--config.data.data_dir={data_dir}",
    f"--config.data.manual_dir={manual}",
    "--config.num_train_steps=2",
    "--config.model.num_layers=1",
    "--config.model.d_model=16",
    "--config.model.num_heads=2",
    "--config.model.mlp_dim=32",
    "--config.seq_len=32",
    "--config.model.max_len=32",
    "--config.model.window=8",
    "--config.batch_size=4",
    "--config.eval_batch_size=8",
    "--config.model.adaptive_cutoffs=(8,16)",
    "--config.model.dtype=float32",
    "--config.sample.length=5",
    "--config.log_every_steps=1",
    config="configs/wikitext103.py:aft_local",
  )
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  results = json.load(open(os.path.join(workdir, "results.json")))
  assert results["steps"] == 2 and np.isfinite(results["valid_ppl"])
  # Evaluation covers every token of the split, counted by the protocol: words + one <eos>
  # per line.
  text = fake_wikitext.texts("v1")
  for split, key in (("validation", "valid_tokens"), ("test", "test_tokens")):
    expected = sum(len(line.split()) + 1 for line in text[split].split("\n")[:-1])
    assert results[key] == expected, (split, results[key], expected)
  assert "Sample:\nThe " in out.stdout


def test_enwik8_recipe_trains_through_train_py_and_reports_bpc(tmp_path):
  manual = str(tmp_path / "manual")
  fake_enwik8.write_zip(manual, fake_enwik8.content(20_000))
  workdir = str(tmp_path / "run")
  tiny = {
    "num_train_steps": 2,
    "model.num_layers": 1,
    "model.d_model": 16,
    "model.num_heads": 2,
    "model.mlp_dim": 32,
    "model.max_len": 32,
    "model.window": 8,
    "model.factor_dim": 4,
    "seq_len": 32,
    "batch_size": 4,
    "eval_batch_size": 16,
    "log_every_steps": 1,
    "sample.length": 0,
  }
  cmd = train_py(
    workdir,
    f"--config.data.data_dir={tmp_path / 'data'}",
    f"--config.data.manual_dir={manual}",
    *(f"--config.{k}={v}" for k, v in tiny.items()),
    config="configs/enwik8.py:aft_local",
  )
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  results = json.load(open(os.path.join(workdir, "results.json")))
  # The paper's unit: bits per character (= per byte); every byte of the 1,000-byte test split.
  assert results["test_tokens"] == 20_000 // 20 and np.isfinite(results["test_bpc"])
  assert results["test_bpc"] == results["test_loss"] / np.log(2)
