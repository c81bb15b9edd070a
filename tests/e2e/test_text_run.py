"""configs/text.py with a subword vocabulary (one run): a moved workdir works alone; changed data
is refused in one line."""

import contextlib
import io
import json
import logging.handlers
import math
import os
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy

import aft_jax
from aft_jax.data import subword, text as text_lib
from aft_jax.data.config import DataConfig
from aft_jax.tools import evaluate, export, generate, trained
from aft_jax.trainer import train_lib
from tests.e2e import test_recipes
from tests.support.helpers import STDLIB_JSON, listing

# Its tests change the module's run and put it back: one worker, one training.
pytestmark = pytest.mark.xdist_group("subword_run")


@pytest.mark.slow
def test_own_text_trains_then_a_moved_workdir_samples_scores_and_exports_alone(
  subword_run, tmp_path, capsys
):
  path = str(tmp_path / "elsewhere" / "run")
  shutil.copytree(subword_run["workdir"], path)
  hidden = tmp_path / "hidden"
  hidden.mkdir()
  for name in ("run", "data"):  # the copy needs neither the workdir nor the data
    os.rename(subword_run["tmp"] / name, hidden / name)
  try:
    saved = json.load(open(os.path.join(path, "results.json")))
    assert saved["unit"] == "subword" and saved["steps"] == 2
    for split in ("valid", "test"):
      assert math.isfinite(saved[f"{split}_ppl"]) and math.isfinite(saved[f"{split}_bpb"])
      # bits per byte: the split's total NLL over ln 2 and its bytes; pieces hold > 1 byte each
      bits = saved[f"{split}_loss"] / math.log(2)
      assert bits / 16 < saved[f"{split}_bpb"] < bits
    info = json.load(open(os.path.join(path, "corpus.json")))
    assert info["tokenizer"] == "subword" and info["vocab_size"] == 400
    assert os.path.isfile(os.path.join(path, "subword.model"))

    generate.main(["--workdir", path, "--prompt", "def ", "--length", "12"])
    assert capsys.readouterr().out.startswith("def ")
    text = tmp_path / "some.py"  # real text the model never saw
    text.write_text(open(logging.handlers.__file__).read()[:3000])
    evaluate.main(["--workdir", path, "--text_file", str(text)])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bytes"] == 3000 and out["unit"] == "subword" and math.isfinite(out["ppl"])
    assert out["bpb"] == pytest.approx(out["nll"] * out["tokens"] / (3000 * math.log(2)))

    run = trained.load_run(path)  # the exports give the same log-probabilities
    ids = run.vocab.encode("import json\nprint(json.dumps([1]))\n")[: run.model.cfg.max_len]
    tokens_BT = np.asarray([ids], np.int32)
    want = np.asarray(run.model.apply({"params": run.params}, tokens_BT))
    for name in ("model.safetensors", "model.msgpack"):
      _export(path, tmp_path / name)
      model, params, vocab = aft_jax.load_pretrained(str(tmp_path / name))
      got = np.asarray(model.apply({"params": params}, tokens_BT))
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
      assert vocab.decode(vocab.encode("héllo ☃\n  x")) == "héllo ☃\n  x"
    # one tensor per parameter, named by its path in the tree
    paths = jax.tree_util.tree_flatten_with_path(jax.device_get(run.params))[0]
    want_names = {"/".join(k.key for k in p) for p, _ in paths}
    assert set(safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))) == want_names

    copy = str(tmp_path / "damaged_run")
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns("checkpoints"))
    os.symlink(os.path.join(path, "checkpoints"), os.path.join(copy, "checkpoints"))
    model = os.path.join(copy, "subword.model")
    data = open(model, "rb").read()
    with open(model, "wb") as f:
      f.write(data[:-40] + bytes(40))
    with pytest.raises(SystemExit, match=r"subword vocabulary .*subword.model is damaged"):
      generate.main(["--workdir", copy, "--length", "2"])
  finally:
    for name in ("run", "data"):
      os.rename(hidden / name, subword_run["tmp"] / name)


# ------------------------------------------------------------------ the data changes after training


def _subword_config(docs, data_dir, **overrides):
  data = {"data.train_files": str(docs / "*.py"), "data.data_dir": str(data_dir)}
  steps = {"eval_every_steps": 1000, "checkpoint_every_steps": 1000}
  return test_recipes.recipe("text", **data, **steps, **{"data.vocab_size": 400, **overrides})


def _export(workdir, out) -> bytes:
  with contextlib.redirect_stdout(io.StringIO()):
    export.main(["--workdir", workdir, "--out", str(out)])
  with open(out, "rb") as f:
    return f.read()


@pytest.fixture(scope="module")
def subword_run(tmp_path_factory):
  """A 400-piece subword run (3 train files, 1 validation, 1 test)."""
  tmp = tmp_path_factory.mktemp("subword_run")
  docs = tmp / "docs"
  docs.mkdir()
  for path in STDLIB_JSON:
    shutil.copy(path, docs)
  shutil.copytree(docs, tmp / "original")
  run = {"tmp": tmp, "docs": docs, "data": tmp / "data", "workdir": str(tmp / "run")}
  with contextlib.redirect_stdout(io.StringIO()):
    train_lib.train_and_evaluate(_subword_config(docs, run["data"]), run["workdir"])
  return run


def _train_files(docs):
  return text_lib.split_files(DataConfig.of(_subword_config(docs, "x").data))["train"]


DATA_CHANGES = {  # case: (config overrides, what the refusal names)
  "a train file changed": ({}, "train file {train} changed"),
  "a train file deleted": ({}, "train file {train} was deleted"),
  "a train file added": ({}, "{added} was added"),
  "data.vocab_size": ({"data.vocab_size": 420}, "data.vocab_size: 400 in the workdir"),
  "data.tokenizer": ({"data.tokenizer": "byte"}, "data.tokenizer: 'subword' in the"),
}


@contextlib.contextmanager
def _changed(run, case):
  """The run's data changed as ``case`` says, then put back: yields (overrides, message)."""
  train, added = _train_files(run["docs"])[0], run["docs"] / "added.py"
  if case == "a train file changed":
    with open(train, "a") as f:
      f.write("# edited after training\n")
  elif case == "a train file deleted":
    os.remove(train)
  elif case == "a train file added":
    added.write_text("def added():\n  return 1\n")
  overrides, says = DATA_CHANGES[case]
  try:
    yield overrides, says.format(train=train, added=added)
  finally:
    shutil.rmtree(run["docs"])
    shutil.copytree(run["tmp"] / "original", run["docs"])


@pytest.mark.parametrize("allow", [False, True], ids=["", "allow_config_change"])
@pytest.mark.parametrize("case", DATA_CHANGES)
def test_a_rerun_on_changed_data_is_refused_in_one_line_and_changes_nothing(
  case, allow, subword_run
):
  """Refused before anything is prepared or compiled, naming the file or key."""
  before = listing(subword_run["workdir"]), listing(subword_run["data"])
  with _changed(subword_run, case) as (overrides, says):
    config = _subword_config(subword_run["docs"], subword_run["data"], **overrides)
    with pytest.raises(ValueError) as e:
      with contextlib.redirect_stdout(io.StringIO()):
        train_lib.train_and_evaluate(config, subword_run["workdir"], allow_config_change=allow)
    line = str(e.value)
    assert says in line and "\n" not in line, line
    if case.startswith("a train file"):
      assert line.startswith("the data changed since the checkpoint at step 2: ")
    if case.startswith("a train file") and not allow:  # the tools score no rebuilt corpus
      with pytest.raises(SystemExit) as e:
        evaluate.main(["--workdir", subword_run["workdir"], "--split", "validation"])
      line = str(e.value)
      prefix = f"evaluate: --workdir {subword_run['workdir']}: the data changed since the "
      assert line.startswith(prefix + "checkpoint at step 2 was written: "), line
      assert says in line and "--split scores the corpus" in line and "\n" not in line, line
  assert (listing(subword_run["workdir"]), listing(subword_run["data"])) == before


def test_a_workdir_whose_vocabulary_was_replaced_is_refused_by_the_tools(subword_run, tmp_path):
  """Before any array is read, by load_run (generate, export, evaluate) and evaluate --split."""
  workdir = str(tmp_path / "replaced")
  shutil.copytree(subword_run["workdir"], workdir)
  docs = [open(p).read() for p in _train_files(subword_run["docs"])]
  other = subword.train(docs[:-1] + [docs[-1] + "\n# edited after training\n"], 400)
  info = json.load(open(os.path.join(workdir, "corpus.json")))
  assert other.sha256 != info["vocab_sha256"]
  other.save(os.path.join(workdir, "subword.model"))
  with open(os.path.join(workdir, "corpus.json"), "w") as f:
    json.dump(dict(info, vocab_sha256=other.sha256), f)
  before = listing(workdir)
  for module, flags in ((generate, ["--length", "4"]), (evaluate, ["--split", "validation"])):
    with pytest.raises(SystemExit) as e:
      with contextlib.redirect_stdout(io.StringIO()):
        module.main(["--workdir", workdir, *flags])
    line = str(e.value)
    assert "\n" not in line and "data changed since the checkpoint at step 2 was written: " in line
    assert "the subword vocabulary is another one (SHA-256" in line, line
    assert "the workdir's subword.model and corpus.json were replaced after training" in line
  assert listing(workdir) == before
