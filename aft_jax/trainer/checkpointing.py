"""The workdir's durable state: Orbax checkpoints of the state (params, opt_state, step), the
data-iterator position and the config they were written with, which a resume is checked
against. Where they live in the workdir: ``aft_jax.workdir``.

Orbax writes each checkpoint into a temporary directory and renames it when complete, so a
crash mid-save leaves the previous checkpoint usable; a checkpoint damaged later (a truncated
or garbled file) is skipped on resume in favour of the newest intact one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import threading
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jax.experimental import multihost_utils

from aft_jax.typed_config import TypedConfig, flatten, positive
from aft_jax.workdir import Workdir


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(TypedConfig):
  """Keys at the top of the config tree (``config.checkpoint_every_steps``, ...)."""

  checkpoint_every_steps: int = 500  # Orbax checkpoints (also at the end and on SIGTERM)
  keep_checkpoints: int = 2  # how many recent checkpoints to keep

  def _value_problems(self) -> list[str]:
    return positive(self, "checkpoint_every_steps", "keep_checkpoints")


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


def checkpoint_manager(workdir: str | Workdir, keep: int) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
    Workdir.of(workdir).checkpoints_dir,
    options=ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, enable_async_checkpointing=False
    ),
  )


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [
    jnp.all(jnp.isfinite(x))
    for x in jax.tree_util.tree_leaves(tree)
    if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _intact_note(mngr: ocp.CheckpointManager) -> str:
  """What a failed save leaves behind, as the end of its error message."""
  previous = mngr.latest_step()
  if previous is None:
    return "there is no earlier checkpoint, so a rerun starts from the beginning"
  return f"the previous checkpoint (step {previous}) is intact"


class _MainThreadOnly:
  """A stand-in for sys.stderr that drops what other threads write to it."""

  def __init__(self, stream):
    self.stream = stream

  def write(self, text):
    if threading.current_thread() is threading.main_thread():
      return self.stream.write(text)
    return len(text)

  def __getattr__(self, name):
    return getattr(self.stream, name)


def _silence_background_errors():
  """Stops tracebacks and ERROR logs of background threads from reaching stderr; returns the
  function that undoes it."""
  loggers = [logging.getLogger(n) for n in ("absl", "asyncio", "concurrent.futures")]
  levels = [lg.level for lg in loggers]
  saved = threading.excepthook, sys.unraisablehook, sys.stderr
  threading.excepthook = sys.unraisablehook = lambda args: None
  sys.stderr = _MainThreadOnly(sys.stderr)
  for lg in loggers:
    lg.setLevel(logging.CRITICAL)

  def undo():
    threading.excepthook, sys.unraisablehook, sys.stderr = saved
    for lg, level in zip(loggers, levels):
      lg.setLevel(level)

  return undo


@contextlib.contextmanager
def _quiet_orbax_threads(stay_quiet_on_error: bool):
  """Keeps Orbax's and TensorStore's background threads from printing their own tracebacks.

  A failed write (a full disk) or read (a damaged checkpoint) fails in several threads at once,
  their callbacks keep failing against closed event loops for a while afterwards, and their
  coroutines again at exit; each prints a traceback (through logging, the thread or unraisable
  hook, or from the thread to stderr), burying the one error that says what happened. With
  ``stay_quiet_on_error`` (the process is about to stop) they stay quiet after a failure;
  otherwise they are given a moment to wind down first.
  """
  undo = _silence_background_errors()
  try:
    yield
  except BaseException:
    if not stay_quiet_on_error:
      time.sleep(1.0)
      undo()
    raise
  undo()


def _first_line(e: BaseException, limit: int = 200) -> str:
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  text = text.split(" See full TensorStore details")[0]
  text = text if len(text) <= limit else text[: limit - 3] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def save(mngr: ocp.CheckpointManager, step: int, state, data_iter, config=None) -> None:
  """Saves state + data position + ``config`` (what a resume is checked against) atomically.

  The trainer always passes its config; ``None`` (tools that only move state) saves none.

  Never writes non-finite parameters or optimizer state, and turns a failed write (a full
  disk, say) into one error that says what is left to resume from.
  """
  if not bool(_all_finite((state.params, state.opt_state))):
    raise FloatingPointError(
      f"refusing to checkpoint non-finite parameters at step {step}; {_intact_note(mngr)}"
    )
  try:
    with _quiet_orbax_threads(stay_quiet_on_error=True):
      items = dict(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_iter.get_state())
      )
      if config is not None:
        items["config"] = ocp.args.JsonSave(config_dict(config))
      mngr.save(step, args=ocp.args.Composite(**items), force=True)
      mngr.wait_until_finished()
  except Exception as e:
    raise OSError(
      f"saving the checkpoint at step {step} failed ({_first_line(e)}); {_intact_note(mngr)}: "
      "free disk space and rerun the same command to resume"
    ) from None  # Orbax's internal chain says nothing more to the user


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state, *, with_data: bool = True):
  """(state, data-iterator state or None) of the checkpoint at ``step``.

  ``abstract_state`` (ShapeDtypeStructs with shardings) says where each array goes, so a run
  saved on one mesh restores onto another.
  """
  args = {"state": ocp.args.StandardRestore(abstract_state)}
  if with_data:
    args["data"] = ocp.args.JsonRestore()
  restored = mngr.restore(step, args=ocp.args.Composite(**args))
  return restored["state"], restored["data"] if with_data else None


def config_dict(config) -> dict:
  """A config (ConfigDict or dict) as plain JSON data."""
  if isinstance(config, dict):
    return json.loads(json.dumps(config))
  return json.loads(config.to_json_best_effort())


def saved_config(mngr: ocp.CheckpointManager, step: int) -> dict | None:
  """The config the checkpoint at ``step`` was written with (None: written before checkpoints
  carried one)."""
  if not os.path.isdir(os.path.join(str(mngr.directory), str(step), "config")):
    return None
  return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]


def check_resume_config(
  saved: dict | None,
  config,
  workdir: str | Workdir,
  allow_config_change: bool,
  defaults: dict | None = None,
):
  """Refuses to continue ``saved`` (the config of the checkpoint, else of the workdir) as
  ``config`` when they differ in what is computed, unless ``allow_config_change``; a key that
  ``saved`` lacks (added to the package since) compares as its value in ``defaults``."""
  where = "the checkpoint"
  if saved is None:
    saved, where = Workdir.of(workdir).read_config(), "config.json"
  if saved is None:
    return
  conflicts = resume_conflicts(saved, config_dict(config), defaults)
  if conflicts and allow_config_change:
    if jax.process_index() == 0:
      print(f"Resuming with a changed config (--allow_config_change): {'; '.join(conflicts)}")
  elif conflicts:
    raise ValueError(
      f"workdir {workdir} holds a run with a different config ({'; '.join(conflicts)}; "
      f"compared with {where}); use another --workdir, or pass --allow_config_change to "
      "resume it anyway"
    )


def write_workdir_config(config, workdir: str | Workdir) -> None:
  """config.json: the config the run continues with (written once a restore succeeded)."""
  if jax.process_index() == 0:
    Workdir.of(workdir).write_config(config_dict(config))


def restore_newest_intact(mngr: ocp.CheckpointManager, abstract_state, check_config):
  """(step, state, data state) of the newest checkpoint that restores, or None if there is none.

  ``check_config(saved config or None)`` runs before each restore and raises to refuse it.
  A checkpoint that fails to restore (a truncated or garbled file, an empty folder) is skipped
  with one line saying why, and moved to ``damaged_checkpoints/`` once an older one restored,
  so later saves and rotation never meet it. If none restores, nothing is moved and the error
  lists why each failed.
  """
  failed = []
  for step in sorted(mngr.all_steps(), reverse=True):
    if not os.listdir(os.path.join(str(mngr.directory), str(step))):
      failed.append((step, FileNotFoundError("the folder is empty")))
      continue
    try:
      with _quiet_orbax_threads(stay_quiet_on_error=False):
        saved = saved_config(mngr, step)
    except Exception as e:
      failed.append((step, e))
      continue
    check_config(saved)
    try:
      with _quiet_orbax_threads(stay_quiet_on_error=False):
        state, data_state = restore(mngr, step, abstract_state)
    except Exception as e:
      failed.append((step, e))
      continue
    for bad, err in failed:
      _set_aside(mngr, bad, f"{_first_line(err)}; resuming from step {step}")
    if failed:
      mngr.reload()
    return step, state, data_state
  if failed:
    _silence_background_errors()  # the run stops here: only this error is worth reading
    raise RuntimeError(
      f"no checkpoint in {mngr.directory} can be restored ("
      + "; ".join(f"step {s}: {_first_line(e)}" for s, e in failed)
      + "); a changed model cannot resume them (use another --workdir), and damaged ones can "
      "be moved away to start afresh"
    )
  return None


def restore_readable(mngr: ocp.CheckpointManager, steps, abstract_state):
  """(step, state, skipped) of the first of ``steps`` whose state restores, for reading a run
  (sampling, evaluating, exporting): nothing is moved aside. ``skipped``: [(step, why)] of the
  ones before it that did not restore. A one-line ValueError naming each step and why, if none
  does."""
  failed = []
  for step in steps:
    try:
      with _quiet_orbax_threads(stay_quiet_on_error=False):
        state, _ = restore(mngr, step, abstract_state, with_data=False)
    except Exception as e:  # noqa: BLE001 (a damaged file fails in Orbax, TensorStore, msgpack)
      failed.append((step, _first_line(e)))
      continue
    return step, state, failed
  _silence_background_errors()  # the command stops here: only this error is worth reading
  raise ValueError(
    "the checkpoint cannot be read: "
    + "; ".join(f"step {s}: {why}" for s, why in failed)
    + f" (in {mngr.directory})"
  )


def _set_aside(mngr: ocp.CheckpointManager, step: int, why: str) -> None:
  src = os.path.join(str(mngr.directory), str(step))
  dst_dir = Workdir(os.path.dirname(str(mngr.directory))).damaged_checkpoints_dir
  dst = os.path.join(dst_dir, str(step))
  n = 1
  while os.path.exists(dst):
    dst, n = os.path.join(dst_dir, f"{step}.{n}"), n + 1
  if jax.process_index() == 0:
    print(f"Skipped the damaged checkpoint at step {step} ({why}); moved to {dst}", flush=True)
    os.makedirs(dst_dir, exist_ok=True)
    shutil.move(src, dst)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"set aside checkpoint {step}")


def resume_conflicts(saved: dict, current: dict, defaults: dict | None = None) -> list[str]:
  """Differences between two configs (as dicts) that make resuming one as the other wrong. A
  key that ``saved`` lacks takes its value in ``defaults`` (a config written before the key
  existed ran with what is now its default), else None."""
  a, b, d = flatten(saved), flatten(current), flatten(defaults or {})
  out = []
  for key in sorted(set(a) | set(b)):
    if any(key == r or key.startswith(r + ".") for r in RESUMABLE):
      continue
    va, vb = a.get(key, d.get(key)), b.get(key)
    if isinstance(va, list):
      va = tuple(va)
    if isinstance(vb, list):
      vb = tuple(vb)
    if va != vb:
      why = " (the learning-rate schedule is built from it)" if key in SCHEDULE else ""
      out.append(f"{key}: {va!r} in the workdir, {vb!r} now{why}")
  return out
