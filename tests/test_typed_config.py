"""aft_jax.typed_config: the tree is the components' keys, each checked by its own component."""

import dataclasses
import re

import pytest

from aft_jax.data.config import DataConfig
from aft_jax.decode import SampleConfig
from aft_jax.model import ModelConfig
from aft_jax.sharding import MeshConfig
from aft_jax.trainer import default_config
from aft_jax.trainer.run_config import RunConfig
from aft_jax.trainer.optimizer import OptimizerConfig
from aft_jax.trainer.step_log import StepLogConfig
from aft_jax.typed_config import flatten, type_ok
from tests.support.helpers import tiny_config


def test_the_tree_is_the_components_keys_each_once():
  config = default_config.get_config().to_dict()
  keys = set(flatten(config))
  owned = []
  for component in default_config.COMPONENTS:
    prefix = component.WHERE + "." if component.WHERE else ""
    owned += [prefix + name for name in component.tree_defaults()]
    assert component.from_config(config) == component()  # the defaults, read back
  assert len(owned) == len(set(owned))  # no key has two owners
  assert keys == set(owned)
  assert "model.vocab_size" not in keys  # from the data: RunConfig.with_vocab


@pytest.mark.parametrize(
  "component,change,message",
  [
    (DataConfig, {"dataset": "enwik9"}, "config.data.dataset = 'enwik9' is not one of"),
    (DataConfig, {"tokenizer": 3}, "config.data.tokenizer = 3 should be a str"),
    (SampleConfig, {"top_k": -1}, "config.sample.top_k = -1 must be >= 0 (0: all tokens)"),
    (SampleConfig, {"length": -1}, "config.sample.length = -1 must be >= 0"),
    (MeshConfig, {"data": -1, "fsdp": -1}, "at most one of them may be -1"),
    (MeshConfig, {"data": 0}, "each must be a positive int"),
    (OptimizerConfig, {"b2": 1.0}, "config.b2 = 1.0 must be in [0, 1)"),
    (OptimizerConfig, {"learning_rate": True}, "config.learning_rate = True should be a float"),
    (ModelConfig, {"window": 0}, "config.model.window = 0 must be in [1, config.model.max_len"),
    (ModelConfig, {"dtype": "float16"}, "config.model.dtype = 'float16': use 'float32' or"),
    (StepLogConfig, {"profile_steps": (5, 2)}, "config.profile_steps = (5, 2) must be (start, "),
  ],
)
def test_each_component_checks_its_keys(component, change, message):
  assert component().problems() == []
  bad = dataclasses.replace(component(), **change)
  assert any(message in p for p in bad.problems()), bad.problems()
  # The whole config's check reports it too (a plain dict: a ConfigDict would convert types).
  config = tiny_config().to_dict()
  (config[component.WHERE] if component.WHERE else config).update(change)
  with pytest.raises(ValueError, match="invalid config: .*" + re.escape(message.split(" = ")[0])):
    RunConfig.from_tree(config)


def test_type_rules():
  assert type_ok(3, 1.0) and not type_ok(True, 1.0) and not type_ok(1, True)
  assert type_ok([1, 2], ()) and type_ok(None, 5) and not type_ok("a", 5)


def test_data_config_of_a_partial_mapping_takes_the_defaults():
  """One default per key, whatever the dataset (a WikiText-103 recipe sets 'word' itself)."""
  assert DataConfig.of({"dataset": "wikitext103"}).tokenizer == DataConfig.tokenizer == "byte"
  assert DataConfig.of({"dataset": "enwik8", "manual_dir": None}).manual_dir == ""
