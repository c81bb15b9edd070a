"""Config validation before anything is compiled: one clear line per problem."""

from __future__ import annotations

import ml_collections

from aft_jax import default_config
from aft_jax.data import DATASETS
from aft_jax.model import ModelConfig

# Keys that may differ when resuming a run: they do not change what is computed. Everything
# else does, the learning-rate schedule included: a new num_train_steps would restart the cosine
# decay from another length, so it is a conflict like a new learning_rate.
RESUMABLE = (
  "log_every_steps",
  "eval_every_steps",
  "checkpoint_every_steps",
  "keep_checkpoints",
  "eval_batch_size",
  "eval_stride",
  "final_eval_stride",
  "sample",
  "mesh",
  "logical_axis_rules",
  "data.data_dir",
  "data.manual_dir",
  "nonfinite",
  "max_consecutive_skips",
  "profile_steps",
)

# Keys the learning-rate schedule is built from: their conflicts say so.
SCHEDULE = ("num_train_steps", "warmup_steps", "learning_rate", "grad_accum_steps")


def flatten(d, prefix: str = "") -> dict:
  """A nested config (dicts or ConfigDicts) as one dict keyed "model.mixing" etc."""
  out = {}
  for k, v in d.items():
    key = f"{prefix}{k}"
    if isinstance(v, (dict, ml_collections.ConfigDict)):
      out.update(flatten(v, key + "."))
    else:
      out[key] = v
  return out


def _type_ok(value, default):
  if default is None or value is None:
    return True
  if isinstance(default, bool):
    return isinstance(value, bool)
  if isinstance(default, float):
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if isinstance(default, int):
    return isinstance(value, int) and not isinstance(value, bool)
  if isinstance(default, (list, tuple)):
    return isinstance(value, (list, tuple))
  return isinstance(value, type(default))


def check_config(config) -> None:
  """Raises ValueError listing every unknown key, wrong type and impossible combination."""
  errors = []
  ref = flatten(default_config.get_config().to_dict())
  cur = flatten(config.to_dict() if hasattr(config, "to_dict") else config)
  for key in sorted(set(cur) - set(ref)):
    errors.append(f"unknown config key {key!r}")
  for key in sorted(set(ref) - set(cur)):
    errors.append(f"missing config key {key!r}")
  for key in sorted(set(cur) & set(ref)):
    if not _type_ok(cur[key], ref[key]):
      errors.append(f"config.{key} = {cur[key]!r} should be a {type(ref[key]).__name__}")
  if errors:
    raise ValueError("invalid config: " + "; ".join(errors))

  c = config
  m = c.model
  positive = [
    "num_train_steps",
    "batch_size",
    "seq_len",
    "log_every_steps",
    "eval_every_steps",
    "checkpoint_every_steps",
    "keep_checkpoints",
    "eval_batch_size",
    "grad_accum_steps",
  ]
  errors += [f"config.{k} = {c[k]} must be >= 1" for k in positive if c[k] < 1]
  if c.learning_rate <= 0:
    errors.append(f"config.learning_rate = {c.learning_rate} must be > 0")
  if c.warmup_steps < 0:
    errors.append(f"config.warmup_steps = {c.warmup_steps} must be >= 0")
  errors += _optimizer_problems(c)
  if not 0 <= c.seed < 2**31 - 1:
    errors.append(f"config.seed = {c.seed} must be in [0, 2**31 - 1)")
  if c.max_consecutive_skips < 0:
    errors.append(f"config.max_consecutive_skips = {c.max_consecutive_skips} must be >= 0")
  # The model's own settings are checked where they are defined (vocab_size: from the data).
  try:
    errors += [f"config.{e}" for e in ModelConfig(vocab_size=1, **m).problems()]
  except ValueError as e:  # a dtype that is no dtype
    errors.append(f"config.{e}")
  if c.seq_len > m.max_len:
    errors.append(f"config.seq_len = {c.seq_len} exceeds config.model.max_len = {m.max_len}")
  if c.data.dataset not in DATASETS:
    errors.append(f"config.data.dataset = {c.data.dataset!r} is not one of {', '.join(DATASETS)}")
  if c.data.official not in ("auto", "yes", "no"):
    errors.append(f"config.data.official = {c.data.official!r} is not 'auto', 'yes' or 'no'")
  if c.data.dataset == "enwik8" and c.data.tokenizer != "byte":
    errors.append(f"config.data.tokenizer = {c.data.tokenizer!r}: enwik8 is bytes ('byte')")
  if c.data.tokenizer not in ("byte", "word"):
    errors.append(f"config.data.tokenizer = {c.data.tokenizer!r} is not 'byte' or 'word'")
  if c.nonfinite not in ("skip", "stop"):
    errors.append(f"config.nonfinite = {c.nonfinite!r} is not 'skip' or 'stop'")
  for key in ("eval_stride", "final_eval_stride"):
    if c[key] < 0 or c[key] > c.seq_len:
      errors.append(f"config.{key} = {c[key]} must be in [0, seq_len = {c.seq_len}]")
  if c.sample.length < 0:
    errors.append(f"config.sample.length = {c.sample.length} must be >= 0")
  if c.sample.temperature < 0:
    errors.append(f"config.sample.temperature = {c.sample.temperature} must be >= 0 (0: greedy)")
  if c.sample.top_k < 0:
    errors.append(f"config.sample.top_k = {c.sample.top_k} must be >= 0 (0: all tokens)")
  steps = c.get("profile_steps") or ()
  if steps and (
    len(steps) != 2 or not all(isinstance(x, int) for x in steps) or not 0 <= steps[0] < steps[1]
  ):
    errors.append(
      f"config.profile_steps = {tuple(steps)} must be (start, stop) with 0 <= start < stop, or "
      "() for no trace"
    )
  if errors:
    raise ValueError("invalid config: " + "; ".join(errors))


def _optimizer_problems(c) -> list[str]:
  errors = []
  # A negative clip norm flips the gradient's sign: training would ascend the loss.
  if not c.grad_clip_norm > 0:
    errors.append(f"config.grad_clip_norm = {c.grad_clip_norm} must be > 0")
  for name in ("b1", "b2"):
    if not 0 <= c[name] < 1:
      errors.append(f"config.{name} = {c[name]} must be in [0, 1)")
  if c.weight_decay < 0:
    errors.append(f"config.weight_decay = {c.weight_decay} must be >= 0")
  return errors


def resume_conflicts(saved: dict, current: dict) -> list[str]:
  """Differences between two configs (as dicts) that make resuming one as the other wrong."""
  a, b = flatten(saved), flatten(current)
  out = []
  for key in sorted(set(a) | set(b)):
    if any(key == r or key.startswith(r + ".") for r in RESUMABLE):
      continue
    va, vb = a.get(key), b.get(key)
    if isinstance(va, list):
      va = tuple(va)
    if isinstance(vb, list):
      vb = tuple(vb)
    if va != vb:
      why = " (the learning-rate schedule is built from it)" if key in SCHEDULE else ""
      out.append(f"{key}: {va!r} in the workdir, {vb!r} now{why}")
  return out
