"""aft_jax.trainer.run_config: the recipes, the one config check, resume conflicts."""

import dataclasses
import glob
import os
import re

import ml_collections
import pytest

from aft_jax.model import MIXINGS
from aft_jax.trainer import default_config, recipes, run_config
from aft_jax.trainer.run_config import RunConfig
from tests.support.helpers import ROOT, tiny_config

# Recipes whose get_config takes the variant as its argument (NAME:ARG).
PER_MIXING = {"wikitext103": MIXINGS, "enwik8": MIXINGS + tuple(f"{m},12x512" for m in MIXINGS)}
SPECS = [f"{n}:{a}" if a else n for n in recipes.available() for a in PER_MIXING.get(n, [None])]


def test_a_recipe_argument_that_is_no_mixing_is_refused():
  with pytest.raises(ValueError, match="'linear' is not one of"):
    recipes.load("wikitext103:linear")
  for bad in ("linear", "aft_local,12x256"):
    with pytest.raises(ValueError, match="configs/enwik8.py:<mixing>"):
      recipes.load(f"enwik8:{bad}")


@pytest.mark.parametrize("spec", SPECS)
def test_config_loads_and_validates(spec):
  config = recipes.load(spec)
  vocab = 267_735 if config.data.dataset == "wikitext103" else 256
  cfg = RunConfig.from_tree(config).with_vocab(vocab).model
  assert cfg.mixing == config.model.mixing
  if config.data.dataset == "wikitext103":
    assert (cfg.num_layers, cfg.d_model, config.seq_len) == (16, 128, 256)
    assert cfg.adaptive_cutoffs == (20000, 40000, 200000)
    assert config.final_eval_stride == 1  # the small setting's sliding-window protocol
  if config.data.dataset == "enwik8":
    size = (12, 512) if spec.endswith(",12x512") else (24, 256)
    assert (cfg.num_layers, cfg.d_model, config.seq_len, config.batch_size) == (*size, 1024, 128)
    assert (cfg.window, cfg.factor_dim, cfg.mlp_dim) == (32, 256, 4 * cfg.d_model)
  if spec == "stream":  # its docstring's two overrides give the softmax baseline, no stream
    baseline = {"model.mixing": "softmax", "model.position_embedding": "learned"}
    softmax = RunConfig.from_tree(default_config.override(config, baseline)).with_vocab(vocab)
    assert cfg.streams and not softmax.model.streams


def _quick():
  return recipes.load("quickstart")


SOFTMAX = {"model.mixing": "softmax"}
PACKED = {"data.dataset": "text", "data.train_files": "x.txt", "data.packing": True}
CUDNN = "impl = 'cudnn': cuDNN flash attention needs dtype bfloat16 or float16, not float32"


@pytest.mark.parametrize(
  "values, message",
  [
    ({"model.window": 1000}, "config.model.window = 1000 must be in \\[1, config.model.max_len"),
    ({**SOFTMAX, "model.num_heads": 3}, "d_model = 128 is not divisible by config.model.num_h"),
    ({"model.mixing": "linear"}, "mixing = 'linear' is not one of"),
    ({"seq_len": 512}, "seq_len = 512 exceeds config.model.max_len = 64"),
    ({"batch_size": 0}, "batch_size = 0 must be >= 1"),
    ({"learning_rate": float("nan")}, "learning_rate = nan must be > 0"),
    ({"weight_decay": float("nan")}, "weight_decay = nan must be >= 0"),
    ({"weight_decay_on": "vectors"}, "weight_decay_on = 'vectors' is not one of all, matrices"),
    ({"sample.temperature": float("nan")}, "temperature = nan must be >="),
    ({"nonfinite": "ignore"}, "nonfinite = 'ignore'"),
    ({"grad_clip_norm": -1.0}, "grad_clip_norm = -1.0 must be > 0"),  # else gradient ascent
    ({"b1": 5.0}, "b1 = 5.0 must be in \\[0, 1\\)"),
    ({"b2": 1.0}, "b2 = 1.0 must be in \\[0, 1\\)"),
    ({"weight_decay": -0.1}, "weight_decay = -0.1 must be >= 0"),
    ({"seed": -1}, "seed = -1 must be in \\[0, 2\\*\\*31 - 1\\)"),
    ({"model.dtype": "float16"}, "dtype = 'float16': use 'float32' or"),
    ({**SOFTMAX, "model.impl": "pallas"}, "impl = 'pallas': softmax attention takes impl 'auto'"),
    ({**SOFTMAX, "model.impl": "cudnn"}, CUDNN),
    ({"model.impl": "cudnn"}, "impl = 'cudnn' is not one of .* for aft_"),
    ({"sample.top_k": -1}, "sample.top_k = -1 must be >= 0"),
    ({"sample.temperature": -1.0}, "sample.temperature = -1.0 must be >= 0"),
    ({"max_consecutive_skips": -1}, "max_consecutive_skips = -1 must be"),
    ({"final_eval_stride": 129}, "final_eval_stride = 129 must be in"),
    ({"data.dataset": "enwik9"}, "'enwik9' is not one of"),
    ({"data.dataset": "enwik8", "data.tokenizer": "word"}, "enwik8 is bytes"),
    ({"mesh.sequence": 2, "model.mixing": "softmax"}, "config.mesh.sequence = 2 with config.mo"),
    ({**PACKED, "mesh.sequence": 2, "mesh.data": 1}, "packing = True with config.mesh.sequence"),
    ({"model.dtype": "half16"}, "config.model.dtype = 'half16' is not a dtype name"),
    ({"wandb.entity": "me"}, "config.wandb.entity = 'me' needs config.wandb.project: without"),
    ({"wandb.name": "x"}, "config.wandb.name = 'x' needs config.wandb.project"),
    ({"wandb.project": " "}, "config.wandb.project = ' ' is blank"),
    ({"wandb.project": "a/b"}, "config.wandb.project: Invalid project name 'a/b': cannot cont"),
    ({"wandb.project": "x" * 129}, "config.wandb.project: Invalid project name .* exceeded 128"),
  ],
)
def test_an_invalid_config_is_one_line_naming_each_key(values, message):
  with pytest.raises(ValueError, match=message) as e:
    RunConfig.from_tree(default_config.override(_quick(), values))
  assert "\n" not in str(e.value)


def test_unknown_keys_and_wrong_types_fail():
  d = _quick().to_dict()  # (a ConfigDict itself refuses a str for an int field)
  d["learning_rte"] = 0.1
  d["model"]["num_layers"] = "two"
  d["model"]["nosuch"] = 1
  with pytest.raises(ValueError) as err:
    RunConfig.from_tree(ml_collections.ConfigDict(d))
  # The whole key, and the known keys closest to it (none is close to 'nosuch').
  assert "unknown config key 'learning_rte'; did you mean 'learning_rate'?" in str(err.value)
  assert "unknown config key 'model.nosuch';" in str(err.value)
  assert "config.model.num_layers = 'two' should be a int" in str(err.value)
  # A misplaced key: the place it belongs.
  assert run_config.unknown_keys(["model.learning_rate", "model", "data.packed"]) == [
    "unknown config key 'model.learning_rate'; did you mean 'learning_rate'?",
    "unknown config key 'data.packed'; did you mean 'data.packing'?",
  ]
  with pytest.raises(TypeError, match="a config is a ConfigDict or a mapping"):
    run_config.plain_tree(3)


def test_resume_conflicts_ignore_only_harmless_keys():
  a = _quick().to_dict()

  def conflicts(values):
    return run_config.resume_conflicts(a, default_config.override(_quick(), values).to_dict())

  assert conflicts({"log_every_steps": 1, "max_consecutive_skips": 0}) == []
  changed = conflicts({"model.d_model": 64, "seed": 3})
  assert changed[0].startswith("model.d_model: 128") and changed[1].startswith("seed: 0")
  # A new num_train_steps would restart the cosine decay from another length.
  assert conflicts({"num_train_steps": 5000}) == [
    "num_train_steps: 1000 in the workdir, 5000 now (the learning-rate schedule is built from it)"
  ]


def test_a_key_added_since_the_workdir_was_written_compares_as_its_old_value(tmp_path):
  """Not today's default (``as_written``): the refusal names the flag that resumes it as written."""
  saved = _quick().to_dict()
  del saved["model"]["init"], saved["mesh"]["sequence"]  # written before bdcc2f1 and 2bacbb7
  as_then = _quick()
  as_then.model.init = "glorot"
  run_config.check_resume(saved, as_then.to_dict(), tmp_path, False)
  with pytest.raises(ValueError) as refused:
    run_config.check_resume(saved, _quick().to_dict(), tmp_path, False)
  assert str(refused.value).startswith(
    f"workdir {tmp_path} holds a run with a different config (model.init: 'glorot' in the "
    "workdir, 'gpt2' now; compared with the checkpoint); it was written before model.init "
    "existed, by a version that ran as --config.model.init=glorot: pass that to resume the run "
    "as it was written; use another --workdir"
  )
  assert run_config.resume_conflicts(saved, _quick().to_dict()) == [
    "model.init: None in the workdir, 'gpt2' now"
  ]


# The modules that make or read the ml_collections tree; the others take typed slices (issue 34).
TREE_READERS = (
  "typed_config.py",
  "trainer/default_config.py",
  "trainer/run_config.py",
  "trainer/train.py",
)


def test_the_tree_is_named_only_where_it_is_made_or_read_and_the_model_validates_nothing():
  package = os.path.join(ROOT, "aft_jax")
  for path in glob.glob(os.path.join(package, "**", "*.py"), recursive=True):
    if os.path.relpath(path, package) not in TREE_READERS:
      assert not re.search("ConfigDict|ml_collections", open(path).read()), path
  assert not re.search(r"\bvalidate\b", open(os.path.join(package, "model.py")).read())


def test_the_config_never_climbs_back_up(trained_run_config_flow):
  rooms, climbs = trained_run_config_flow["rooms"], trained_run_config_flow["climbs"]
  assert climbs == [], climbs
  for component in ("model", "sharding", "data.corpus", "trainer.optimizer"):
    assert f"aft_jax.{component}" in rooms, rooms
  assert not [r for r in rooms if r.startswith(("aft_jax.ops", "aft_jax.layers"))], rooms


def test_a_climb_is_a_call_from_a_lower_layer_with_the_config():
  from tests.support import config_flow

  # A function compiled as if in aft_jax/data/corpus.py calls one "in" train_lib with a slice.
  namespace = {}
  for module, source in [
    ("trainer/train_lib.py", "def target(data_cfg):\n  return data_cfg\n"),
    ("data/corpus.py", "def caller(cfg):\n  return target(cfg.data)\n"),
  ]:
    exec(compile(source, os.path.join(ROOT, "aft_jax", module), "exec"), namespace)
  _, rooms, climbs = config_flow.follow(namespace["caller"], RunConfig.from_tree(tiny_config()))
  assert climbs == {("aft_jax.data.corpus.caller", "aft_jax.trainer.train_lib.target")}
  assert rooms == {"aft_jax.trainer.train_lib"}


def test_the_slices_cannot_change_paths_are_absolute_and_the_vocabulary_size_comes_with_data(
  tmp_path, monkeypatch
):
  monkeypatch.chdir(tmp_path)
  cfg = RunConfig.from_tree(tiny_config(**{"data.data_dir": "data"}))
  assert cfg.data.data_dir == cfg.tree["data"]["data_dir"] == str(tmp_path / "data")
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
