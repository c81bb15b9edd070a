"""``aft-train --dry_run --target NAME [--num_devices N]``: the recipe's steps compiled for N
devices of a GPU or TPU that is not here, and whether they fit (docs/what_fits.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax

from aft_jax import data as data_lib
from aft_jax import deviceless
from aft_jax import ops
from aft_jax import sharding
from aft_jax.trainer import train_lib
from aft_jax.trainer.run_config import RunConfig

GPU_FRACTION = 0.75  # jax's default preallocation on a GPU (XLA_PYTHON_CLIENT_MEM_FRACTION)
TPU_FRACTION = 0.95  # an allowance for the TPU runtime's own buffers
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# Exit statuses: it fits, it does not, or refused (nothing compiled; 2 as argparse's usage errors).
FITS, DOES_NOT_FIT, REFUSED = 0, 1, 2
# Bytes per token of a step's batch: inputs and targets (int32), and for evaluation the weights.
_BATCH_BYTES = {"batch_size": 8, "eval_batch_size": 12}


def usable_bytes(target: deviceless.CompileTarget) -> int:
  """The memory one device gives a program: on a GPU the share jax takes (MEM_FRACTION)."""
  if target.kind == "cpu":
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  if target.kind != "cuda":
    return int(target.memory_bytes * TPU_FRACTION)
  text = os.environ.get(MEM_FRACTION, str(GPU_FRACTION))
  try:
    fraction = float(text)
  except ValueError:
    fraction = math.nan
  if not 0.0 < fraction <= 1.0:  # NaN too
    raise ValueError(
      f"{MEM_FRACTION} = {text!r} must be a number in (0, 1]: the share of a GPU's memory "
      f"jax takes (unset: {GPU_FRACTION})"
    )
  return int(target.memory_bytes * fraction)


def check(cfg: RunConfig, target: deviceless.CompileTarget, num_devices: int) -> int:
  """The usable bytes per device, or what a dry run refuses before it restarts itself."""
  deviceless.check_num_devices(target, num_devices)
  usable = usable_bytes(target)
  sizes = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(cfg.mesh, num_devices)))
  dp = sizes["data"] * sizes["fsdp"]
  seq_len = cfg.train.seq_len
  batches = {"batch_size": cfg.train.batch_size, "eval_batch_size": cfg.eval.eval_batch_size}
  sharding.check_batch_split(dp, **batches)
  for name, size in batches.items():
    share = size // dp * seq_len * _BATCH_BYTES[name]
    if share > usable:
      raise ValueError(
        f"--config.{name} = {size:,}: one device's share of the batch alone ({size // dp:,} x "
        f"{seq_len} tokens) takes {_gib(share)}, more than the {_gib(usable)} usable on "
        f"{target.description}: it cannot fit (nothing compiled)"
      )
  return usable


@dataclasses.dataclass
class StepMemory:
  """One compiled step's per-device bytes (``compiled.memory_analysis()``)."""

  argument: int  # parameters, optimizer state, the batch
  output: int
  alias: int  # outputs written over donated arguments
  temp: int  # activations, gradients, XLA's scratch
  code: int

  @classmethod
  def of(cls, compiled) -> StepMemory:
    m = compiled.memory_analysis()
    sizes = ("argument", "output", "alias", "temp", "generated_code")
    return cls(*(getattr(m, f"{k}_size_in_bytes") for k in sizes))

  refused: str = ""  # the compiler's own out-of-memory refusal (TPU), when it gave one

  @property
  def total(self) -> int:
    return self.argument + self.output - self.alias + self.temp + self.code


_REFUSAL = re.compile(r"RESOURCE_EXHAUSTED: .*?temporaries \(([\d.]+)([KMGT])\)")


def _compile(lowered, args) -> tuple[object | None, StepMemory]:
  """(compiled, its memory), or (None, what XLA's TPU compiler says it refused)."""
  try:
    compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001 (jax's runtime error type is not public)
    found = _REFUSAL.search(str(e))
    if not found:  # XLA's own errors run to dozens of lines: the first says what it was
      first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
      raise RuntimeError(f"XLA could not compile the step: {first}") from e
    temp = int(float(found.group(1)) * 1024 ** (1 + "KMGT".index(found.group(2))))
    line = str(e).strip().splitlines()[0]
    argument = 0  # the arguments' shards: what the compiler would have given them
    for leaf in jax.tree_util.tree_leaves(args):
      shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
      argument += math.prod(shape) * leaf.dtype.itemsize
    return None, StepMemory(argument, 0, 0, temp, 0, refused=line)
  return compiled, StepMemory.of(compiled)


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def compile_steps(
  cfg: RunConfig, target: deviceless.CompileTarget, num_devices: int, say=print
) -> dict:
  """The report's numbers: ``cfg``'s steps compiled for ``num_devices`` of ``target``."""
  devices = deviceless.devices(target, num_devices)
  vocab, vocab_from = data_lib.vocab_size(cfg.data)
  trainer = train_lib.make_trainer(cfg, vocab, devices, say)
  state, batch = trainer.abstract_state, trainer.specs(cfg.train.batch_size)
  train, mem = _compile(trainer.lower_train_step(), (state, batch))
  eval_args = (state.params, trainer.specs(cfg.eval.eval_batch_size, True))
  with trainer.on_mesh():
    _, eval_mem = _compile(trainer._eval_step.lower(*eval_args), eval_args)
  cost = None if train is None else train.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  flops = (cost or {}).get("flops")
  return {
    "mesh": sharding.axis_sizes(trainer.mesh),
    "vocab_size": vocab,
    "vocab_from": vocab_from,
    "impl": trainer.model.cfg.impl,
    "train": mem,
    "eval": eval_mem,
    "flops_per_step": float(flops) if flops is not None and flops >= 0 else None,
    "triton_kernels": 0 if train is None else train.as_text().count(ops.KERNEL_CALLS["gpu"]),
  }


def run(cfg: RunConfig, target, num_devices: int, usable: int, say=print) -> dict:
  """Prints the report (its last line its JSON object) and returns that object."""
  res = compile_steps(cfg, target, num_devices, say)
  mem, eval_mem = res["train"], res["eval"]
  need, suggestions = max(mem.total, eval_mem.total), []
  if need > usable:  # what would fit (remat, micro-batches, fsdp), each compiled
    state = mem.argument + mem.output - mem.alias
    batch_size, accum = cfg.train.batch_size, cfg.optimizer.grad_accum_steps
    per_device = batch_size // (res["mesh"]["data"] * res["mesh"]["fsdp"])
    tries = []  # (config change, number of devices, the flags that say it)
    if mem.temp > usable - state:  # activations do not fit beside the state
      if not cfg.model.remat:
        tries.append(({"model.remat": True}, num_devices, "--config.model.remat=True"))
      factor = 2 ** max(1, math.ceil(math.log2(mem.temp / max(usable - state, 1))))
      if usable > state and factor <= per_device and batch_size % factor == 0:
        b, k = batch_size // factor, accum * factor
        flag = f"--config.batch_size={b} --config.grad_accum_steps={k} (the same global batch)"
        tries.append(({"batch_size": b, "grad_accum_steps": k}, num_devices, flag))
    if state > 0.5 * usable:  # parameters and optimizer state: shard them
      n = 2 * num_devices
      change = {"mesh.data": 1, "mesh.fsdp": n, "mesh.tensor": 1}
      tries.append((change, n, f"--num_devices {n} --config.mesh.data=1 --config.mesh.fsdp={n}"))
    for change, n, flag in tries:
      try:
        trial = cfg.with_changes(change)
        got = compile_steps(trial, target, n, say=lambda line: None)
      except (ValueError, RuntimeError) as e:
        suggestions.append(f"{flag}: not possible ({str(e).splitlines()[0][:160]})")
        continue
      then = max(got["train"].total, got["eval"].total)
      verdict = "fits" if then <= usable else "still does not fit"
      suggestions.append(f"{flag}: {_gib(then)} per device, {verdict} (compiled)")
    suggestions.append(f"more devices: --num_devices {2 * num_devices} (the batch split over them)")
  r = {
    "target": target.name,
    "device": target.description,
    "num_devices": num_devices,
    "mesh": res["mesh"],
    "impl": res["impl"],
    "fits": need <= usable,
    "temp_bytes": mem.temp,
    "argument_bytes": mem.argument,
    "output_bytes": mem.output,
    "alias_bytes": mem.alias,
    "train_step_bytes": mem.total,
    "eval_step_bytes": eval_mem.total,
    "device_memory_bytes": target.memory_bytes or usable,
    "usable_bytes": usable,
    "flops_per_step": res["flops_per_step"],
    "triton_kernels": res["triton_kernels"],
    "vocab_size": res["vocab_size"],
    "suggestions": suggestions,
    "jax_version": jax.__version__,
    "compiled_without_device": target.kind != "cpu",
  }
  flops = r["flops_per_step"]
  if flops is not None:
    flops = f"{flops:.3e} (a custom kernel's own FLOPs are not counted)"
  lines = [
    f"Dry run: {r['device']} x {num_devices}, mesh {r['mesh']}, config.model.impl={r['impl']!r} "
    f"({r['triton_kernels']} Triton kernel calls in the train step)",
    "Per device, compiled for the target without a device (XLA's buffer assignment, not a "
    "measurement):",
    f"  parameters, optimizer state and batch  {_gib(r['argument_bytes'])}",
    f"  temporaries (activations, gradients)   {_gib(r['temp_bytes'])}",
    f"  train step in all                      {_gib(r['train_step_bytes'])}",
    f"  evaluation step in all                 {_gib(r['eval_step_bytes'])}",
    f"  {'device' if r['compiled_without_device'] else 'host'} memory: "
    f"{_gib(r['device_memory_bytes'])}, usable {_gib(usable)}",
    f"  XLA's FLOPs per step: {flops or 'not reported for this target'}",
    *(
      f"  XLA's compiler for {r['target']} refused a step: {m.refused}"
      for m in (mem, eval_mem)
      if m.refused
    ),
  ]
  if r["fits"]:
    lines.append(
      f"Fits: {_gib(need)} of {_gib(usable)} ({need / usable:.0%}), margin {_gib(usable - need)}."
    )
  else:
    lines.append(
      f"Does not fit: {_gib(need)} needed, {_gib(usable)} usable ({need / usable:.1f}x)."
    )
    lines += ["What would:", *(f"  {line}" for line in r["suggestions"])]
  for line in [*lines, json.dumps(r)]:
    say(line)
  return r
