"""Files written by older versions read as they were written (tests/fixtures/README.md)."""

import contextlib
import functools
import io
import json
import os
import shutil

import numpy as np
import pytest

import aft_jax
from aft_jax.data import pydoc_corpus, record
from aft_jax.tools import evaluate, export
from aft_jax.trainer import default_config, run_config, train_lib
from aft_jax.trainer.run_config import SLICES, RunConfig, as_written, default_tree
from aft_jax.typed_config import flatten
from aft_jax.workdir import Workdir
from tests.support.helpers import ROOT, tiny_config

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
BEFORE_INIT = os.path.join(FIXTURES, "before_model_init")  # the tree before commit bdcc2f1
BEFORE_RECORD = os.path.join(FIXTURES, "before_corpus_record")  # the tree before 7899ccd


def _read(path):
  with open(path) as f:
    return json.load(f)


# Every key some component lists as added since the first release: {dotted key: (component, name)}.
ADDED = {
  (c.WHERE + "." if c.WHERE else "") + name: (c, name) for c in SLICES.values() for name in c.ADDED
}


def test_a_workdir_from_before_model_init_reads_and_resumes_only_as_it_was_written(
  tmp_path, capsys
):
  old_workdir = str(tmp_path / "workdir")  # no model.init in its config
  shutil.copytree(os.path.join(BEFORE_INIT, "workdir"), old_workdir)
  path = os.path.join(old_workdir, "config.json")
  written = _read(path)
  with open(path, "w") as f:  # model.adaptive_cutoffs: null, as the first release wrote ()
    json.dump({**written, "model": {**written["model"], "adaptive_cutoffs": None}}, f)
  old = _read(os.path.join(BEFORE_INIT, "old_evaluate.json"))  # the old tree's aft-evaluate
  evaluate.main(["--workdir", old_workdir, "--text_file", os.path.join(BEFORE_INIT, "text.txt")])
  got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert (got["tokens"], got["step"]) == (old["tokens"], old["step"])
  assert got["nll"] == pytest.approx(old["nll"], rel=1e-6)  # 'gpt2' would read it as 17.7

  out = str(tmp_path / "model.msgpack")
  export.main(["--workdir", old_workdir, "--out", out])
  assert json.loads(capsys.readouterr().out.splitlines()[-1])["out"] == out
  assert json.loads(export._read(out)["meta"])["model"]["init"] == "glorot"  # the real value
  # The old tree's own export (no init in its model config) loads as that model too.
  new_model, new_params, _ = aft_jax.load_pretrained(out)
  old_model, old_params, _ = aft_jax.load_pretrained(os.path.join(BEFORE_INIT, "model.msgpack"))
  assert old_model.cfg == new_model.cfg and new_model.cfg.adaptive_cutoffs == ()
  for a, b in zip(flatten(old_params).values(), flatten(new_params).values(), strict=True):
    np.testing.assert_array_equal(a, b)

  corpus = _read(os.path.join(old_workdir, "corpus.json"))
  if record.of_corpus(pydoc_corpus("byte"))["tokens"] != corpus["tokens"]:
    pytest.skip("this Python's pydoc text is not the one the fixture was trained on")
  with open(path, "w") as f:
    json.dump(written, f)
  # Resumed as written (two more steps), it continues at its loss, not at 'gpt2''s (today's
  # default is refused, naming --config.model.init=glorot: test_run_config.py).
  steps = {"num_train_steps": 12, "log_every_steps": 1, "sample.length": 0}
  longer = _with(default_tree(), {**flatten(written), "model.init": "glorot", **steps})
  with contextlib.redirect_stdout(io.StringIO()):
    results = train_lib.train_and_evaluate(longer, old_workdir, allow_config_change=True)
  loss = {r["step"]: r["loss"] for r in Workdir(old_workdir).read_metrics() if "loss" in r}
  assert sorted(loss) == [5, 10, 11, 12]
  assert abs(loss[11] - loss[10]) < 1 and abs(loss[12] - loss[10]) < 1  # 5.39; 'gpt2': ~15
  before = _read(os.path.join(BEFORE_INIT, "workdir", "results.json"))["valid_loss"]
  assert abs(results["valid_loss"] - before) < 0.1


@pytest.fixture
def unrecorded_workdir(tmp_path):
  """The workdir the tree before 7899ccd trained: no corpus.json, its corpus builder version 1."""
  path = str(tmp_path / "workdir")
  shutil.copytree(os.path.join(BEFORE_RECORD, "workdir"), path)
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top

  results = _read(os.path.join(path, "results.json"))
  position = _read(os.path.join(path, "checkpoints", "10", "data", "metadata"))
  trained = position["num_tokens"] + results["valid_tokens"] + results["test_tokens"]
  if sum(len(t.encode()) for t in topics.topics.values()) != trained:
    pytest.skip("this Python's pydoc text is not the one the fixture was trained on")
  return path


def test_a_workdir_from_before_corpus_records_scores_its_own_split(unrecorded_workdir, capsys):
  old = _read(os.path.join(unrecorded_workdir, "results.json"))
  evaluate.main(["--workdir", unrecorded_workdir, "--split", "validation"])
  got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert got["tokens"] == old["valid_tokens"]  # today's pydoc builder: 41,091 tokens, ppl 238
  assert got["ppl"] == pytest.approx(old["valid_ppl"], rel=1e-5)

  # What it is checked against: the counts results.json scored...
  with open(os.path.join(unrecorded_workdir, "results.json"), "w") as f:
    json.dump({**old, "valid_tokens": 41_091}, f)
  with pytest.raises(SystemExit, match=f"split has {old['valid_tokens']:,} tokens, had 41,091"):
    evaluate.main(["--workdir", unrecorded_workdir, "--split", "validation"])
  # ... and a version of the builder this aft_jax cannot build: refused in one line.
  with open(os.path.join(unrecorded_workdir, "corpus.json"), "w") as f:
    json.dump({**record.of_corpus(pydoc_corpus("byte")), "builder_version": 3}, f)
  with pytest.raises(SystemExit) as refused:
    evaluate.main(["--workdir", unrecorded_workdir, "--split", "validation"])
  line = str(refused.value)
  assert "\n" not in line and "the corpus builder changed since the checkpoint at step 10" in line
  assert "built by version 3 (made by a newer aft_jax), this aft_jax builds version 2" in line
  assert "--text_file" in line


def test_a_workdir_from_before_corpus_records_resumes_on_its_own_corpus(unrecorded_workdir):
  tree = RunConfig.from_saved(_read(os.path.join(unrecorded_workdir, "config.json"))).tree
  longer = _with(tree, {"num_train_steps": 12, "log_every_steps": 1, "sample.length": 0})
  with contextlib.redirect_stdout(io.StringIO()):
    results = train_lib.train_and_evaluate(longer, unrecorded_workdir, allow_config_change=True)
  before = _read(os.path.join(BEFORE_RECORD, "workdir", "results.json"))
  for key in ("valid_tokens", "test_tokens"):  # today's builder: 41,091 and 41,116
    assert results[key] == before[key]
  corpus = Workdir(unrecorded_workdir).read_corpus()  # written now, naming the old builder
  assert corpus["builder_version"] == 1 and corpus["tokens"]["validation"] == before["valid_tokens"]
  loss = {r["step"]: r["loss"] for r in Workdir(unrecorded_workdir).read_metrics() if "loss" in r}
  assert sorted(loss) == [5, 10, 11, 12] and abs(loss[11] - loss[10]) < 1


def _with(tree: dict, values: dict) -> dict:
  """A copy of ``tree`` with dotted keys set (``{"model.init": "glorot"}``)."""
  return default_config.override(json.loads(json.dumps(tree)), values)


def _without(tree: dict, key: str) -> dict:
  """A copy of ``tree`` without the dotted ``key``: a config written before it existed."""
  out = json.loads(json.dumps(tree))
  *parents, leaf = key.split(".")
  functools.reduce(dict.get, parents, out).pop(leaf)
  return out


def test_the_table_lists_every_key_added_since_the_first_release():
  first = _read(os.path.join(FIXTURES, "first_release_config.json"))
  assert set(ADDED) == set(flatten(default_tree())) - set(flatten(first))
  cfg = RunConfig.from_saved(first)
  got = (cfg.model.init, cfg.model.impl, cfg.step_log.max_consecutive_skips)
  assert got == ("glorot", "xla", 0)
  # Its model.adaptive_cutoffs: null (a plain embedding) is (): given now, no config change.
  rerun = RunConfig.from_tree(_with(as_written(first), {"model.adaptive_cutoffs": ()}))
  assert run_config.resume_conflicts(as_written(first), rerun.tree) == []
  assert first["model"]["adaptive_cutoffs"] is None and cfg.model == rerun.model


@pytest.mark.parametrize("key", sorted(ADDED))
def test_a_saved_config_without_a_key_runs_with_its_old_value(key):
  component, name = ADDED[key]
  saved = RunConfig.from_tree(tiny_config(eval_stride=8)).tree  # a workdir's config.json
  without = _without(saved, key)
  old = component.ADDED[name][1]
  if callable(old):  # final_eval_stride: eval_stride's value
    old = old(without[component.WHERE] if component.WHERE else without)
  explicit = _with(saved, {key: old})
  got, want = RunConfig.from_saved(without), RunConfig.from_tree(explicit)
  assert {s: getattr(got, s) for s in SLICES} == {s: getattr(want, s) for s in SLICES}
  assert got.tree == want.tree
  assert run_config.resume_conflicts(as_written(without), want.tree) == []


def test_a_saved_config_without_a_first_release_key_is_refused_as_damaged():
  saved = _without(RunConfig.from_tree(tiny_config()).tree, "model.remat")
  with pytest.raises(ValueError, match="missing config key 'model.remat'"):
    RunConfig.from_saved(saved)
