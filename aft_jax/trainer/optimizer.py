"""AdamW with global-norm clipping, linear warmup then cosine decay to 10% of the peak, and
optional gradient accumulation (``optax.MultiSteps``: the schedule counts updates).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from aft_jax.typed_config import TypedConfig, positive


DECAY_ON = ("all", "matrices")  # OptimizerConfig.weight_decay_on


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(TypedConfig):
  """Keys at the top of the config tree (``config.learning_rate``, ...)."""

  # Before the key, weight decay shrank every parameter (TypedConfig.as_written).
  ADDED = {"weight_decay_on": ("bdcc2f1", "all")}

  learning_rate: float = 1e-3  # peak AdamW rate
  # linear warmup (updates), then cosine decay to 10% of the peak; a warmup as long as the run
  # is cut to its updates - 1 (the run says so)
  warmup_steps: int = 100
  weight_decay: float = 0.01  # AdamW decoupled weight decay
  # The parameters weight decay shrinks: 'all', or 'matrices' (those of rank >= 2: dense
  # kernels, embeddings, AFT's position biases; not biases, LayerNorm scales or per-head
  # scalars), as GPT-2 and nanoGPT do.
  weight_decay_on: str = "all"
  b1: float = 0.9  # AdamW first-moment decay
  b2: float = 0.98  # AdamW second-moment decay
  grad_clip_norm: float = 1.0  # clip the global gradient norm to this
  grad_accum_steps: int = 1  # > 1: optax.MultiSteps, one update every k steps

  def _value_problems(self) -> list[str]:
    errors = positive(self, "grad_accum_steps")
    if not 0 < self.learning_rate < math.inf:  # (a NaN is neither)
      errors.append(f"config.learning_rate = {self.learning_rate} must be > 0")
    if self.warmup_steps < 0:
      errors.append(f"config.warmup_steps = {self.warmup_steps} must be >= 0")
    # A negative clip norm flips the gradient's sign: training would ascend the loss.
    if not self.grad_clip_norm > 0:
      errors.append(f"config.grad_clip_norm = {self.grad_clip_norm} must be > 0")
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        errors.append(f"config.{name} = {getattr(self, name)} must be in [0, 1)")
    if self.weight_decay_on not in DECAY_ON:
      errors.append(
        f"config.weight_decay_on = {self.weight_decay_on!r} is not one of {', '.join(DECAY_ON)}"
      )
    if not 0 <= self.weight_decay < math.inf:
      errors.append(f"config.weight_decay = {self.weight_decay} must be >= 0")
    return errors


def _updates(opt: OptimizerConfig, num_train_steps: int) -> int:
  return max(1, num_train_steps // opt.grad_accum_steps)


def warmup_note(opt: OptimizerConfig, num_train_steps: int) -> str | None:
  """The note that a warmup as long as the run was cut to ``updates - 1``; None if it fits."""
  updates = _updates(opt, num_train_steps)
  if opt.warmup_steps < updates:
    return None
  return (
    f"note: warmup_steps = {opt.warmup_steps} is not shorter than the run's {updates} updates: "
    f"the learning rate warms up over {updates - 1} and then decays"
  )


def learning_rate_schedule(opt: OptimizerConfig, num_train_steps: int):
  """Linear warmup, then cosine decay to 10% of the peak, counted in updates."""
  updates = _updates(opt, num_train_steps)
  warmup = min(opt.warmup_steps, updates - 1)
  decay = optax.cosine_decay_schedule(opt.learning_rate, max(1, updates - warmup), alpha=0.1)
  if warmup == 0:
    return decay
  return optax.join_schedules(
    [optax.linear_schedule(0.0, opt.learning_rate, warmup), decay], [warmup]
  )


def make_optimizer(opt: OptimizerConfig, num_train_steps: int) -> optax.GradientTransformation:
  """The optimizer of ``opt`` for a run of ``num_train_steps`` micro-steps."""
  matrices = lambda params: jax.tree_util.tree_map(lambda p: jnp.ndim(p) >= 2, params)  # noqa: E731
  tx = optax.chain(
    optax.clip_by_global_norm(opt.grad_clip_norm),
    optax.adamw(
      learning_rate_schedule(opt, num_train_steps),
      b1=opt.b1,
      b2=opt.b2,
      weight_decay=opt.weight_decay,
      mask=matrices if opt.weight_decay_on == "matrices" else None,
    ),
  )
  if opt.grad_accum_steps > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=opt.grad_accum_steps)
  return tx
