"""The config check before anything is compiled: one clear line per problem.

Each component checks its own keys in its typed config (``default_config.COMPONENTS`` and
``ModelConfig``: their types from their defaults, their values in their own rules). What is
left here spans components: unknown and missing keys (the tree is generated from the
components), and the rules that tie two of them together (a training sequence no longer than
the model's positions, evaluation strides within a sequence).
"""

from __future__ import annotations

from aft_jax.model import ModelConfig
from aft_jax.trainer import default_config
from aft_jax.typed_config import flatten, type_problems


def check_config(config) -> None:
  """Raises ValueError listing every unknown key, wrong type and impossible combination."""
  errors = []
  reference = default_config.get_config().to_dict()
  ref = flatten(reference)
  cur = flatten(config.to_dict() if hasattr(config, "to_dict") else config)
  errors += [f"unknown config key {key!r}" for key in sorted(set(cur) - set(ref))]
  missing = [f"missing config key {key!r}" for key in sorted(set(ref) - set(cur))]
  if missing:  # the components cannot be built without their keys
    raise ValueError("invalid config: " + "; ".join(errors + missing))

  for component in default_config.COMPONENTS:
    errors += component.from_config(config).problems()
  model = dict(config["model"])
  wrong = type_problems(model, reference["model"], "model.")
  if wrong:
    errors += wrong
  else:
    # The model's own settings are checked where they are defined (vocab_size: from the data).
    try:
      errors += [f"config.{e}" for e in ModelConfig(vocab_size=1, **model).problems()]
    except ValueError as e:  # a dtype that is no dtype
      errors.append(f"config.{e}")
  if not errors or all(e.startswith("unknown config key") for e in errors):
    errors += _across_components(config)
  if errors:
    raise ValueError("invalid config: " + "; ".join(errors))


def _across_components(c) -> list[str]:
  """The rules between components' keys (their own values already checked)."""
  errors = []
  if c["seq_len"] > c["model"]["max_len"]:
    errors.append(
      f"config.seq_len = {c['seq_len']} exceeds config.model.max_len = {c['model']['max_len']}"
    )
  for key in ("eval_stride", "final_eval_stride"):
    if c[key] > c["seq_len"]:
      errors.append(f"config.{key} = {c[key]} must be in [0, seq_len = {c['seq_len']}]")
  errors += _sequence_split(c)
  return errors


def _sequence_split(c) -> list[str]:
  """mesh.sequence > 1 splits T over devices: only the causal recurrences allow it, and T
  must split evenly (docs/long_sequences.md)."""
  n, model = c["mesh"].get("sequence", 1), c["model"]
  if n == 1:
    return []
  mixing = model["mixing"]
  if mixing in ("softmax", "aft_full"):
    return [
      f"config.mesh.sequence = {n} with model.mixing = {mixing!r}: {mixing} mixes every pair "
      "of positions, so a device's outputs need every other device's keys, not a small "
      "state; context parallelism is for aft_simple, aft_local and aft_conv1d (or use "
      "mesh.sequence = 1)"
    ]
  if c["seq_len"] % n:
    return [f"config.seq_len = {c['seq_len']} is not divisible by mesh.sequence = {n}"]
  return []
