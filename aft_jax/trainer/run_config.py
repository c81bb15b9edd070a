"""One run's config: the config tree read once into a frozen ``RunConfig`` of typed slices, the
one check of a run's settings before anything is written, and of a resumed run's against the
workdir's (``check_resume``).
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
from aft_jax.trainer.step_log import StepLogConfig, WandbConfig
from aft_jax.typed_config import flatten, type_problems
from aft_jax.workdir import Workdir


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Every component's typed slice of one run's config, checked, and their tree."""

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
    """The config as plain JSON data (a new dict each time)."""
    return json.loads(self.tree_json)

  @classmethod
  def from_tree(cls, tree) -> RunConfig:
    """The run config of ``tree``; one ValueError listing every problem of it."""
    plain = plain_tree(tree)
    ref, cur = flatten(default_tree()), flatten(plain)
    errors = unknown_keys(sorted(set(cur) - set(ref)))
    missing = [f"missing config key {key!r}" for key in sorted(set(ref) - set(cur))]
    if missing:  # no component can be built
      raise ValueError("invalid config: " + "; ".join(errors + missing))
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
    # The data folders and text globs absolute.
    data = plain["data"]
    data["data_dir"] = resolve_data_dir(data["data_dir"])
    if data["manual_dir"]:
      data["manual_dir"] = os.path.abspath(os.path.expanduser(data["manual_dir"]))
    for key in ("train_files", "valid_files", "test_files"):  # dataset 'text': its globs
      data[key] = absolute_globs(data[key])
    slices["data"] = DataConfig.from_config(plain)
    return cls(**slices, tree_json=json.dumps(plain))

  @classmethod
  def from_saved(cls, tree: Mapping) -> RunConfig:
    """The run config of a saved tree (config.json) as the version that wrote it ran."""
    return cls.from_tree(as_written(tree))

  def with_vocab(self, vocab_size: int) -> RunConfig:
    if vocab_size < 1:
      raise ValueError(f"the corpus has {vocab_size} tokens in its vocabulary: nothing to model")
    return dataclasses.replace(self, model=dataclasses.replace(self.model, vocab_size=vocab_size))

  def with_changes(self, values: dict) -> RunConfig:
    """This tree with dotted keys changed (``{"model.remat": True}``), checked anew."""
    changed = RunConfig.from_tree(default_config.override(self.tree, values))
    return changed.with_vocab(self.model.vocab_size) if self.model.vocab_size else changed


def plain_tree(tree) -> dict:
  """A ConfigDict or a mapping as plain JSON data."""
  if hasattr(tree, "to_json_best_effort"):
    return json.loads(tree.to_json_best_effort())
  if not isinstance(tree, Mapping):
    raise TypeError(f"a config is a ConfigDict or a mapping of keys, not a {type(tree).__name__}")
  return json.loads(json.dumps(dict(tree)))


def default_tree() -> dict:
  return json.loads(_DEFAULT_TREE_JSON())


_DEFAULT_TREE_JSON = functools.cache(lambda: json.dumps(default_config.get_config().to_dict()))


def _frozen(value):
  if isinstance(value, dict):
    return {k: _frozen(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_frozen(v) for v in value)
  return value


def as_written(tree: Mapping) -> dict:
  """A saved config tree, each key added since at the value its version ran with (``ADDED``)."""
  tree = plain_tree(tree)
  for component in SLICES.values():
    if not component.WHERE:
      tree = component.as_written(tree)
    elif isinstance(tree.get(component.WHERE, {}), dict):
      tree[component.WHERE] = component.as_written(tree.get(component.WHERE, {}))
  return plain_tree(tree)


def unknown_keys(keys) -> list[str]:
  """One line for each dotted key that no component defines, with the known keys closest to it."""
  known = flatten(default_tree())
  lines = []
  for key in keys:
    if key in known or any(k.startswith(key + ".") for k in known):
      continue
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    lines.append(f"unknown config key {key!r}{hint}")
  return lines


def _across_components(s: dict) -> list[str]:
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
    # The ops' segment forms have no axis_name: a document would not see its start on a shard.
    errors.append(
      f"config.data.packing = True with config.mesh.sequence = {s['mesh'].sequence}: packed "
      "rows are not split along T over devices; use config.mesh.sequence = 1 (or packing off)"
    )
  # mesh.sequence > 1 splits T over devices: causal recurrences only (docs/long_sequences.md).
  n, mixing = s["mesh"].sequence, model.mixing
  if n > 1 and mixing in ("softmax", "aft_full"):
    errors.append(
      f"config.mesh.sequence = {n} with config.model.mixing = {mixing!r}: {mixing} mixes every "
      "pair of positions, so a device's outputs need every other device's keys, not a small "
      "state; context parallelism is for the other mixings (or use "
      "config.mesh.sequence = 1)"
    )
  elif n > 1 and train.seq_len % n:
    errors.append(
      f"config.seq_len = {train.seq_len} is not divisible by config.mesh.sequence = {n}"
    )
  return errors


# Keys that may differ when resuming a run: they do not change what is computed (the schedule's,
# num_train_steps included, do: the cosine decay would restart from another length).
RESUMABLE = (
  *("log_every_steps", "eval_every_steps", "checkpoint_every_steps", "keep_checkpoints"),
  *("eval_batch_size", "eval_stride", "final_eval_stride", "sample", "mesh", "logical_axis_rules"),
  *("data.data_dir", "data.manual_dir", "nonfinite", "max_consecutive_skips", "profile_steps"),
)
SCHEDULE = ("num_train_steps", "warmup_steps", "learning_rate", "grad_accum_steps")
# Never resumed changed: the checkpoint's embedding would be read as other tokens.
VOCABULARY = ("data.dataset", "data.tokenizer", "data.vocab_size", "data.variant", "data.encoding")


def resume_conflicts(saved: dict, current: dict) -> list[str]:
  """Differences between two config trees that make resuming one as the other wrong."""
  a, b = flatten(saved), flatten(current)
  out = []
  for key in sorted(set(a) | set(b)):
    if any(key == r or key.startswith(r + ".") for r in RESUMABLE):
      continue
    va, vb = (tuple(v) if isinstance(v, list) else v for v in (a.get(key), b.get(key)))
    if va != vb:
      why = " (the learning-rate schedule is built from it)" if key in SCHEDULE else ""
      out.append(f"{key}: {va!r} in the workdir, {vb!r} now{why}")
  return out


def check_resume(
  saved: dict | None, current: dict, workdir: str | Workdir, allow_config_change: bool
) -> list[str]:
  """Refuses to resume ``saved`` (None: config.json's) as ``current``; the allowed differences."""
  where = "the checkpoint"
  if saved is None:
    saved, where = Workdir.of(workdir).read_config(), "config.json"
  if saved is None:
    return []
  written = as_written(saved)
  conflicts = resume_conflicts(written, current)
  keys = [c.split(":")[0] for c in conflicts]
  if any(k in VOCABULARY for k in keys):
    vocabulary = "; ".join(c for c, k in zip(conflicts, keys) if k in VOCABULARY)
    raise ValueError(
      f"workdir {workdir} holds a run trained on another vocabulary ({vocabulary}; compared with "
      f"{where}): a model cannot resume on another vocabulary, not even with "
      "--allow_config_change; use another --workdir"
    )
  if not conflicts or allow_config_change:
    return conflicts
  a, b = flatten(saved), flatten(written)
  older = [k for k in keys if k in b and k not in a]  # added since: the values it ran with
  hint = ""
  if older:
    flags = " ".join(f"--config.{k}={b[k] if isinstance(b[k], str) else repr(b[k])}" for k in older)
    hint = (
      f"; it was written before {', '.join(older)} existed, by a version that ran as {flags}: "
      "pass that to resume the run as it was written"
    )
  raise ValueError(
    f"workdir {workdir} holds a run with a different config ({'; '.join(conflicts)}; compared "
    f"with {where}){hint}; use another --workdir, or pass --allow_config_change to resume it "
    "anyway"
  )
