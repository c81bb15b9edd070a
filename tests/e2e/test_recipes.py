"""The enwik8 variants and WikiText-103's baseline train tiny on fake data in one process;
WikiText-103's default through train.py with an argument, data flags and adaptive softmax."""

import json
import math
import os

import pytest

from tests.support import fake_enwik8, fake_wikitext, prefork
from benchmarks import quality
from tests.support.helpers import ROOT, train_py
from aft_jax.trainer import train_lib
from aft_jax.trainer.recipes import load
from aft_jax.trainer.default_config import override
from aft_jax.model import MIXINGS

ENWIK8_BYTES = 20_000  # any size is prepared like the real file: 18,000 / 1,000 / 1,000

# The tiniest model (the quality benchmark's --quick one: 1 layer, d 16, T 16), 2 steps; one
# layer not scanned (nn.scan would only add tracing and compile time).
TINY = {
  k: v for k, v in quality.settings(quick=True).items() if k.startswith(("model.", "seq_len"))
}
TINY.update({"model.factor_dim": 4, "model.scan_layers": False, "batch_size": 4})
TINY.update(eval_batch_size=64, num_train_steps=2, warmup_steps=1, log_every_steps=1)
TINY["sample.length"] = 0


def _words(split):
  """A fake WikiText-103 split's tokens: its words and one <eos> per line."""
  return sum(len(line.split()) + 1 for line in fake_wikitext.texts("v1")[split].split("\n")[:-1])


def recipe(spec: str, **overrides):
  """A recipe loaded as train.py loads it, shrunk (``TINY``), with dotted overrides."""
  return override(load(spec), {**TINY, **overrides})


@pytest.mark.slow
def test_the_enwik8_and_wikitext103_variants_train_and_report_their_protocol(tmp_path):
  enwik8_dir, wikitext_dir = str(tmp_path / "enwik8"), str(tmp_path / "wikitext")
  fake_enwik8.write_zip(enwik8_dir, fake_enwik8.content(ENWIK8_BYTES))  # as downloaded
  fake_wikitext.write_extracted(wikitext_dir, "v1")
  data_dir = str(tmp_path / "data")  # each dataset is prepared once, by its first run
  for mixing in MIXINGS:
    data = {"data.data_dir": data_dir, "data.manual_dir": enwik8_dir}
    config = recipe(f"enwik8:{mixing}", **data)
    results = train_lib.train_and_evaluate(config, str(tmp_path / f"enwik8_{mixing}"))
    assert results["steps"] == 2 and results["mixing"] == mixing
    for split in ("valid", "test"):
      # bits per character = bits per byte: the NLL in nats over ln 2, every byte counted
      assert math.isfinite(results[f"{split}_bpc"]), results
      assert results[f"{split}_bpc"] == results[f"{split}_loss"] / math.log(2)
      assert results[f"{split}_tokens"] == ENWIK8_BYTES // 20
    assert results["eval_protocol"] == {"name": "disjoint_windows", "window": 16, "stride": 16}
  data = {"data.data_dir": data_dir, "data.manual_dir": wikitext_dir}
  config = recipe("wikitext103:softmax", **data, **{"model.adaptive_cutoffs": (8, 16)})
  results = train_lib.train_and_evaluate(config, str(tmp_path / "wt103_softmax"))
  assert results["steps"] == 2 and results["mixing"] == "softmax"
  _check_wikitext(results, window=16)


def _check_wikitext(results, window):
  """Final numbers on sliding windows (stride 1), each token scored once."""
  assert results["eval_protocol"] == {"name": "sliding_window", "window": window, "stride": 1}
  assert results["train_eval_protocol"]["name"] == "disjoint_windows"
  for split, key in (("validation", "valid"), ("test", "test")):
    assert math.isfinite(results[f"{key}_ppl"]), results
    assert results[f"{key}_tokens"] == _words(split)


@pytest.mark.slow
def test_wikitext_recipe_trains_with_train_py_on_fake_data(tmp_path):
  manual, data_dir, workdir = (str(tmp_path / name) for name in ("manual", "data", "run"))
  fake_wikitext.write_extracted(manual, "v1")
  tiny = """num_train_steps=2 model.num_layers=1 model.d_model=16 model.num_heads=2
    model.mlp_dim=32 seq_len=32 model.max_len=32 model.window=8 batch_size=4 eval_batch_size=8
    model.adaptive_cutoffs=(8,16) model.dtype=float32 sample.length=5 log_every_steps=1"""
  data = [f"data.data_dir={data_dir}", f"data.manual_dir={manual}"]
  flags = [f"--config.{setting}" for setting in data + tiny.split()]
  cmd = train_py(workdir, *flags, config="configs/wikitext103.py:aft_local")
  out = prefork.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  results = json.load(open(os.path.join(workdir, "results.json")))
  assert results["steps"] == 2 and results["mixing"] == "aft_local"
  _check_wikitext(results, window=32)
  assert "Sample:\nThe " in out.stdout
