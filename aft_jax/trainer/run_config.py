"""One run's config: the config tree (a ConfigDict from a recipe and the command line, or
config.json's dict) read once into a frozen ``RunConfig``, the one check of a run's settings
before anything is loaded, compiled or written (one line per problem), with each component's
typed slice (``run_cfg.optimizer``, ...) and the plain tree for what records the config. The
model's ``vocab_size`` comes from the data (``with_vocab``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
from collections.abc import Mapping

from aft_jax.data.config import DataConfig, absolute_globs, resolve_data_dir
from aft_jax.decode import SampleConfig
from aft_jax.model import ModelConfig
from aft_jax.sharding import MeshConfig, RulesConfig
from aft_jax.trainer import default_config
from aft_jax.trainer.checkpointing import CheckpointConfig
from aft_jax.trainer.default_config import SLICES, TrainConfig
from aft_jax.trainer.evaluation import EvalConfig
from aft_jax.trainer.optimizer import OptimizerConfig
from aft_jax.trainer.step_log import StepLogConfig
from aft_jax.trainer.wandb_log import WandbConfig
from aft_jax.typed_config import flatten, type_problems


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Every component's typed slice of one run's config, checked, and the tree they came from."""

  data: DataConfig
  model: ModelConfig  # vocab_size 0 until ``with_vocab``
  train: TrainConfig
  optimizer: OptimizerConfig
  step_log: StepLogConfig
  eval: EvalConfig
  checkpoint: CheckpointConfig
  sample: SampleConfig
  mesh: MeshConfig
  rules: RulesConfig
  wandb: WandbConfig
  tree_json: str  # the checked tree (paths absolute) as JSON: ``tree`` reads it

  @property
  def tree(self) -> dict:
    """The config as plain JSON data (a new dict each time: the run's config cannot change)."""
    return json.loads(self.tree_json)

  @classmethod
  def from_tree(cls, tree) -> RunConfig:
    """The run config of ``tree`` (a ConfigDict or a mapping); ValueError "invalid config: "
    listing every unknown or missing key, wrong type and impossible combination."""
    plain = plain_tree(tree)
    errors = _key_problems(plain)
    slices, frozen = {}, _frozen(plain)
    for name, component in SLICES.items():
      node = frozen[component.WHERE] if component.WHERE else frozen
      prefix = component.WHERE + "." if component.WHERE else ""
      wrong = type_problems(node, component.tree_defaults(), prefix)
      if wrong:  # before the dataclass is built: ModelConfig converts some values
        errors += wrong
        continue
      try:
        slices[name] = component.from_config(frozen)
      except ValueError as e:  # a dtype that is no dtype
        errors.append(str(e))
        continue
      errors += slices[name].problems()
    if not errors or all(e.startswith("unknown config key") for e in errors):
      errors += _across_components(slices)
    if errors:
      raise ValueError("invalid config: " + "; ".join(errors))
    plain = absolute_paths(plain)
    slices["data"] = DataConfig.from_config(plain)
    return cls(**slices, tree_json=json.dumps(plain))

  @classmethod
  def from_saved(cls, tree: Mapping) -> RunConfig:
    """The run config of a saved tree (config.json) as the version that wrote it ran: a key it
    lacks, added to the package since, takes that version's value (``as_written``)."""
    return cls.from_tree(as_written(tree))

  def with_vocab(self, vocab_size: int) -> RunConfig:
    """This config with the model's vocabulary size, once the data is known."""
    if vocab_size < 1:
      raise ValueError(f"the corpus has {vocab_size} tokens in its vocabulary: nothing to model")
    return dataclasses.replace(self, model=dataclasses.replace(self.model, vocab_size=vocab_size))

  def with_changes(self, values: dict) -> RunConfig:
    """Another run config: this tree with dotted keys changed (``{"model.remat": True}``),
    checked as a new one (the vocabulary size kept)."""
    changed = RunConfig.from_tree(default_config.override(self.tree, values))
    return changed.with_vocab(self.model.vocab_size) if self.model.vocab_size else changed


def plain_tree(tree) -> dict:
  """A config tree (a ConfigDict or a mapping) as plain JSON data: what config.json holds."""
  if hasattr(tree, "to_json_best_effort"):
    return json.loads(tree.to_json_best_effort())
  if not isinstance(tree, Mapping):
    raise TypeError(f"a config is a ConfigDict or a mapping of keys, not a {type(tree).__name__}")
  return json.loads(json.dumps(dict(tree)))


@functools.cache
def _default_tree_json() -> str:
  return json.dumps(default_config.get_config().to_dict())


def default_tree() -> dict:
  """The default config as plain data: every key a config has."""
  return json.loads(_default_tree_json())


def absolute_paths(tree: dict) -> dict:
  """``tree`` (changed in place) with its data folders and text globs absolute (``data_dir`` '':
  the default one): config.json says where the data is, from whatever directory a run starts."""
  data = tree["data"]
  data["data_dir"] = resolve_data_dir(data["data_dir"])
  if data["manual_dir"]:
    data["manual_dir"] = os.path.abspath(os.path.expanduser(data["manual_dir"]))
  for key in ("train_files", "valid_files", "test_files"):  # dataset 'text': its globs
    data[key] = absolute_globs(data[key])
  return tree


def _frozen(value):
  """JSON data with its lists as tuples: a slice's values cannot be changed in place."""
  if isinstance(value, dict):
    return {k: _frozen(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_frozen(v) for v in value)
  return value


def as_written(tree: Mapping) -> dict:
  """A saved config tree as plain data, each key added since it was written at the value the
  version that wrote it ran with (the components' ``ADDED``); any other missing key stays so."""
  tree = plain_tree(tree)
  for component in SLICES.values():
    if not component.WHERE:
      tree = component.as_written(tree)
    elif isinstance(tree.get(component.WHERE, {}), dict):
      tree[component.WHERE] = component.as_written(tree.get(component.WHERE, {}))
  return plain_tree(tree)


def unknown_keys(keys) -> list[str]:
  """One line for each of the dotted ``keys`` (``"model.d_model"``) that no component defines
  (a key above others, ``"model"``, is known): the whole key and the known keys closest to it
  (difflib), a mistyped or misplaced key's likely meaning."""
  known = flatten(default_tree())
  lines = []
  for key in keys:
    if key in known or any(k.startswith(key + ".") for k in known):
      continue
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    lines.append(f"unknown config key {key!r}{hint}")
  return lines


def _key_problems(tree: dict) -> list[str]:
  """The unknown keys' lines; a missing key raises at once (no component can be built)."""
  ref, cur = flatten(default_tree()), flatten(tree)
  errors = unknown_keys(sorted(set(cur) - set(ref)))
  missing = [f"missing config key {key!r}" for key in sorted(set(ref) - set(cur))]
  if missing:
    raise ValueError("invalid config: " + "; ".join(errors + missing))
  return errors


def _across_components(s: dict) -> list[str]:
  """The rules between components' keys (their own values already checked)."""
  train, model, ev = s["train"], s["model"], s["eval"]
  errors = []
  if model.length_limit is not None and train.seq_len > model.length_limit:
    errors.append(
      f"config.seq_len = {train.seq_len} exceeds config.model.max_len = {model.max_len}"
    )
  for key in ("eval_stride", "final_eval_stride"):
    if getattr(ev, key) > train.seq_len:
      errors.append(f"config.{key} = {getattr(ev, key)} must be in [0, seq_len = {train.seq_len}]")
  if s["data"].packing and s["mesh"].sequence > 1:
    # The layers take a packed row whole (the ops' segment forms have no axis_name): split
    # over devices along T, a document would not see its start on the earlier shard.
    errors.append(
      f"config.data.packing = True with config.mesh.sequence = {s['mesh'].sequence}: packed "
      "rows are not split along T over devices; use config.mesh.sequence = 1 (or packing off)"
    )
  # mesh.sequence > 1 splits T over devices: only the causal recurrences allow it, and T must
  # split evenly (docs/long_sequences.md).
  n, mixing = s["mesh"].sequence, model.mixing
  if n > 1 and mixing in ("softmax", "aft_full"):
    errors.append(
      f"config.mesh.sequence = {n} with config.model.mixing = {mixing!r}: {mixing} mixes every "
      "pair of positions, so a device's outputs need every other device's keys, not a small "
      "state; context parallelism is for aft_simple, aft_local and aft_conv1d (or use "
      "config.mesh.sequence = 1)"
    )
  elif n > 1 and train.seq_len % n:
    errors.append(
      f"config.seq_len = {train.seq_len} is not divisible by config.mesh.sequence = {n}"
    )
  return errors
