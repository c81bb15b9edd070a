"""Train on your own text, end to end: configs/text.py on real text no one here wrote (Python's
own standard-library sources), a 512-piece subword vocabulary, a tiny model; results.json's
perplexity and bits per byte; a copy of the workdir moved elsewhere generates, evaluates a text
file and exports (msgpack and safetensors) on its own; a damaged vocabulary is refused.

One run (in-process, as train.py runs it) serves every check: they are one test, so that
pytest-xdist's two workers never train it twice."""

import contextlib
import io
import json
import math
import os
import shutil

import jax
import numpy as np
import pytest

import aft_jax
from aft_jax.tools import evaluate, export, generate, trained
from aft_jax.trainer import train_lib
from tests import test_recipes

STDLIB = os.path.dirname(os.__file__)
TRAIN_FILES = os.path.join(STDLIB, "json", "*.py")  # 5 files, ~48 KB: 3 train, 1 valid, 1 test


def _train_and_move(tmp):
  """(workdir copied elsewhere, results) of configs/text.py shrunk to one tiny layer."""
  config = test_recipes.recipe(
    "text.py",
    **{
      "data.train_files": TRAIN_FILES,
      "data.vocab_size": 512,
      "data.data_dir": str(tmp / "data"),
      "num_train_steps": 3,
      "eval_every_steps": 1000,
      "checkpoint_every_steps": 1000,
    },
  )
  with contextlib.redirect_stdout(io.StringIO()):
    results = train_lib.train_and_evaluate(config, str(tmp / "run"))
  moved = str(tmp / "elsewhere" / "run")
  shutil.copytree(str(tmp / "run"), moved)
  shutil.rmtree(str(tmp / "run"))
  shutil.rmtree(str(tmp / "data"))  # the copy must need neither the workdir nor the data
  return moved, results


@pytest.mark.slow
def test_own_text_trains_then_a_moved_workdir_samples_scores_and_exports_alone(tmp_path, capsys):
  path, _ = _train_and_move(tmp_path / "text")
  _results_have_perplexity_and_bits_per_byte(path)
  _moved_workdir_generates_and_evaluates_a_text_file(path, tmp_path, capsys)
  _safetensors_round_trip_gives_the_same_log_probabilities(path, tmp_path)
  _missing_or_damaged_subword_vocabulary_is_one_line(path, tmp_path)


def _results_have_perplexity_and_bits_per_byte(path):
  with open(os.path.join(path, "results.json")) as f:
    saved = json.load(f)
  assert saved["unit"] == "subword" and saved["steps"] == 3
  for split in ("valid", "test"):
    assert math.isfinite(saved[f"{split}_ppl"]) and math.isfinite(saved[f"{split}_bpb"])
    # bits per byte: the split's total NLL over ln 2 and its bytes; pieces hold > 1 byte each
    assert saved[f"{split}_bpb"] > saved[f"{split}_loss"] / math.log(2) / 16
    assert saved[f"{split}_bpb"] < saved[f"{split}_loss"] / math.log(2)
  with open(os.path.join(path, "corpus.json")) as f:
    info = json.load(f)
  assert info["tokenizer"] == "subword" and info["vocab_size"] == 512
  assert os.path.isfile(os.path.join(path, "subword.model"))


def _moved_workdir_generates_and_evaluates_a_text_file(path, tmp_path, capsys):
  generate.main(["--workdir", path, "--prompt", "def ", "--length", "12"])
  assert capsys.readouterr().out.startswith("def ")
  text = tmp_path / "some.py"  # real text the model never saw
  text.write_text(open(os.path.join(STDLIB, "logging", "handlers.py")).read()[:3000])
  evaluate.main(["--workdir", path, "--text_file", str(text)])
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["bytes"] == 3000 and out["unit"] == "subword"
  assert math.isfinite(out["ppl"]) and out["bpb"] == pytest.approx(
    out["nll"] * out["tokens"] / (3000 * math.log(2))
  )


def _safetensors_round_trip_gives_the_same_log_probabilities(path, tmp_path):
  run = trained.load_run(path)
  ids = run.vocab.encode("import json\nprint(json.dumps([1]))\n")[: run.model.cfg.max_len]
  tokens_BT = np.asarray([ids], np.int32)
  want = np.asarray(run.model.apply({"params": run.params}, tokens_BT))
  for name in ("model.safetensors", "model.msgpack"):
    out = str(tmp_path / name)
    with contextlib.redirect_stdout(io.StringIO()):
      export.main(["--workdir", path, "--out", out])
    model, params, vocab = aft_jax.load_pretrained(out)
    got = np.asarray(model.apply({"params": params}, tokens_BT))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert vocab.decode(vocab.encode("héllo ☃\n  x")) == "héllo ☃\n  x"
  from safetensors.numpy import load_file

  # one tensor per parameter, named by its path in the tree
  paths = jax.tree_util.tree_flatten_with_path(jax.device_get(run.params))[0]
  want_names = {"/".join(k.key for k in p) for p, _ in paths}
  assert set(load_file(str(tmp_path / "model.safetensors"))) == want_names


def _missing_or_damaged_subword_vocabulary_is_one_line(path, tmp_path):
  copy = str(tmp_path / "damaged_run")
  shutil.copytree(path, copy, ignore=shutil.ignore_patterns("checkpoints"))
  os.symlink(os.path.join(path, "checkpoints"), os.path.join(copy, "checkpoints"))
  model = os.path.join(copy, "subword.model")
  data = open(model, "rb").read()
  with open(model, "wb") as f:
    f.write(data[:-40] + bytes(40))
  with pytest.raises(SystemExit, match=r"subword vocabulary .*subword.model is damaged"):
    generate.main(["--workdir", copy, "--length", "2"])
  os.remove(model)
  with pytest.raises(SystemExit, match=r"subword vocabulary .*subword.model is missing"):
    evaluate.main(["--workdir", copy, "--text_file", __file__])
