"""The config tree, from each component's typed config; recipes start from ``get_config()``."""

from __future__ import annotations

import dataclasses

import ml_collections

from aft_jax.data.config import DataConfig
from aft_jax.decode import SampleConfig
from aft_jax.model import ModelConfig
from aft_jax.sharding import MeshConfig, RulesConfig
from aft_jax.trainer.checkpointing import CheckpointConfig
from aft_jax.trainer.evaluation import EvalConfig
from aft_jax.trainer.optimizer import OptimizerConfig
from aft_jax.trainer.step_log import StepLogConfig, WandbConfig
from aft_jax.typed_config import TypedConfig, positive


@dataclasses.dataclass(frozen=True)
class TrainConfig(TypedConfig):
  """The run's own keys, at the top of the config tree (``config.batch_size``, ...)."""

  seed: int = 0  # parameters, dropout and the data order
  num_train_steps: int = 1000  # micro-steps (each one batch); updates = this / grad_accum_steps
  batch_size: int = 16  # global, in sequences, summed over all devices and processes
  seq_len: int = 128  # tokens per training sequence (<= model.max_len unless a stream)

  def _value_problems(self) -> list[str]:
    errors = positive(self, "num_train_steps", "batch_size", "seq_len")
    if not 0 <= self.seed < 2**31 - 1:
      errors.append(f"config.seed = {self.seed} must be in [0, 2**31 - 1)")
    return errors


# Every component config, in the order of the tree, by its slice of ``RunConfig`` (the model's
# vocab_size is no key: it comes from the data).
SLICES = {
  "data": DataConfig,
  "model": ModelConfig,
  "train": TrainConfig,
  "optimizer": OptimizerConfig,
  "step_log": StepLogConfig,
  "eval": EvalConfig,
  "checkpoint": CheckpointConfig,
  "sample": SampleConfig,
  "mesh": MeshConfig,
  "rules": RulesConfig,
  "wandb": WandbConfig,
}
COMPONENTS = tuple(SLICES.values())


def get_config() -> ml_collections.ConfigDict:
  """The default config: each component's keys with their defaults, where it keeps them."""
  config = ml_collections.ConfigDict()
  for component in COMPONENTS:
    if component.WHERE:
      config[component.WHERE] = ml_collections.ConfigDict(component.tree_defaults())
    else:
      config.update(component.tree_defaults())
  return config


def override(config: ml_collections.ConfigDict, values: dict) -> ml_collections.ConfigDict:
  """Sets dotted keys (``{"model.d_model": 16}``) in place, as ``--config.KEY=VALUE`` does."""
  for key, value in values.items():
    node = config
    *parents, leaf = key.split(".")
    for name in parents:
      node = node[name]
    node[leaf] = value
  return config
