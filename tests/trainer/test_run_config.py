"""aft_jax.trainer.run_config: the config tree read once per run into frozen typed slices, which
each component takes as its own; the tree's types named only where the tree is made or read."""

import dataclasses
import os
import re

import pytest

from aft_jax import typed_config
from aft_jax.trainer import run_config, train_lib
from aft_jax.trainer.run_config import SLICES, RunConfig
from tests.support.helpers import ROOT, tiny_config

# Where the ml_collections tree may not be named: these take typed slices (issue 34).
SLICE_TAKERS = (
  "aft_jax/model.py",
  "aft_jax/layers.py",
  "aft_jax/sharding.py",
  "aft_jax/data",
  "aft_jax/trainer/train_lib.py",
  "aft_jax/trainer/optimizer.py",
  "aft_jax/trainer/checkpointing.py",
  "aft_jax/trainer/evaluation.py",
  "aft_jax/trainer/step_log.py",
  "aft_jax/trainer/wandb_log.py",
  "aft_jax/trainer/dry_run.py",
)


def _sources(paths):
  for path in paths:
    full = os.path.join(ROOT, path)
    if os.path.isdir(full):
      names = sorted(n for n in os.listdir(full) if n.endswith(".py"))
      yield from (os.path.join(path, n) for n in names)
    else:
      yield path


def test_the_tree_is_named_only_where_it_is_made_or_read_and_the_model_validates_nothing():
  """The model's settings are checked once, with the run config: no validate() in model.py."""
  for path in _sources(SLICE_TAKERS):
    with open(os.path.join(ROOT, path)) as f:
      text = f.read()
    for word in ("ConfigDict", "ml_collections"):
      assert word not in text, f"{path} names {word}: it takes a typed slice (run_config)"
    if path == "aft_jax/model.py":
      assert not re.search(r"\bvalidate\b", text)


def test_a_run_builds_its_config_once_and_checks_each_component_once(tmp_path, monkeypatch):
  """One tiny run: ``RunConfig.from_tree`` once, each component's ``problems()`` once."""
  built, checked = [], []
  from_tree, problems = RunConfig.from_tree.__func__, typed_config.TypedConfig.problems

  def counting_from_tree(cls, tree):
    built.append(tree)
    return from_tree(cls, tree)

  def counting_problems(self):
    checked.append(type(self).__name__)
    return problems(self)

  monkeypatch.setattr(RunConfig, "from_tree", classmethod(counting_from_tree))
  monkeypatch.setattr(typed_config.TypedConfig, "problems", counting_problems)
  config = tiny_config(num_train_steps=2, **{"sample.length": 0})
  results = train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert results["steps"] == 2
  assert len(built) == 1
  assert sorted(checked) == sorted(c.__name__ for c in SLICES.values()), checked


def test_the_config_never_climbs_back_up(trained_run_config_flow):
  """Followed from ``train_and_evaluate`` through every call that passes the tree, the
  RunConfig or a slice on (tests/support/config_flow.py, on the session's trained run), the
  config goes down the layers only: no module calls one above it with it (issue 34 asked for
  at most 6 such climbs; 19 before). The rooms are the components that take a slice."""
  rooms, climbs = trained_run_config_flow["rooms"], trained_run_config_flow["climbs"]
  assert climbs == [], climbs
  for component in ("model", "sharding", "data.corpus", "trainer.optimizer"):
    assert f"aft_jax.{component}" in rooms, rooms
  assert not [r for r in rooms if r.startswith(("aft_jax.ops", "aft_jax.layers"))], rooms


def test_a_climb_is_a_call_from_a_lower_layer_with_the_config():
  from tests.support import config_flow

  cfg = RunConfig.from_tree(tiny_config())
  assert config_flow.layer("aft_jax.data.corpus") > config_flow.layer("aft_jax.trainer.train_lib")
  # data.config's module calling train_lib with a slice would be a climb; measured here on a
  # call made from a function compiled as if it lived in aft_jax/data/corpus.py.
  namespace = {"target": lambda data_cfg: data_cfg}
  source = "def caller(cfg):\n  return target(cfg.data)\n"
  corpus_file = os.path.join(ROOT, "aft_jax", "data", "corpus.py")
  exec(compile(source, corpus_file, "exec"), namespace)
  lib_file = os.path.join(ROOT, "aft_jax", "trainer", "train_lib.py")
  exec(compile("def target(data_cfg):\n  return data_cfg\n", lib_file, "exec"), namespace)
  _, rooms, climbs = config_flow.follow(namespace["caller"], cfg)
  assert climbs == {("aft_jax.data.corpus.caller", "aft_jax.trainer.train_lib.target")}
  assert rooms == {"aft_jax.trainer.train_lib"}


def test_the_slices_cannot_change_and_the_vocabulary_size_comes_once_the_data_is_known():
  cfg = RunConfig.from_tree(tiny_config())
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.model.d_model = 32
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.train = None
  cfg.tree["seq_len"] = 1  # a copy: the run's config is what it was
  assert cfg.tree["seq_len"] == cfg.train.seq_len == 32
  assert isinstance(cfg.rules.logical_axis_rules, tuple)  # lists from the tree: tuples
  assert all(isinstance(r, tuple) for r in cfg.rules.logical_axis_rules)
  assert cfg.model.vocab_size == 0  # no config key: the data's
  assert cfg.with_vocab(256).model.vocab_size == 256 and cfg.model.vocab_size == 0
  with pytest.raises(ValueError, match="nothing to model"):
    cfg.with_vocab(0)
  changed = cfg.with_vocab(256).with_changes({"model.remat": True})
  assert changed.model.remat and changed.model.vocab_size == 256


def test_paths_are_absolute_and_a_saved_config_takes_new_keys_old_values(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  cfg = RunConfig.from_tree(tiny_config(**{"data.data_dir": "data"}))
  assert cfg.data.data_dir == cfg.tree["data"]["data_dir"] == str(tmp_path / "data")
  saved = cfg.tree
  del saved["wandb"], saved["model"]["init"]  # written before those keys existed
  again = RunConfig.from_saved(saved)
  assert again.wandb == SLICES["wandb"]() and again.model.init == "glorot"  # as it ran then
  with pytest.raises(ValueError, match="missing config key 'model.init'"):
    RunConfig.from_tree(saved)


def test_errors_name_the_config_key_and_span_components():
  with pytest.raises(ValueError) as e:
    RunConfig.from_tree(tiny_config(**{"mesh.sequence": 2, "model.mixing": "softmax"}))
  assert "config.mesh.sequence = 2 with config.model.mixing = 'softmax'" in str(e.value)
  packed = {"data.dataset": "text", "data.train_files": "x.txt", "data.packing": True}
  with pytest.raises(ValueError, match="config.data.packing = True with config.mesh.sequence = 2"):
    RunConfig.from_tree(tiny_config(**packed, **{"mesh.sequence": 2, "mesh.data": 1}))
  with pytest.raises(ValueError, match="config.model.dtype = 'half16' is not a dtype name"):
    RunConfig.from_tree(tiny_config(**{"model.dtype": "half16"}))
  with pytest.raises(TypeError, match="a config is a ConfigDict or a mapping"):
    run_config.plain_tree(3)
