"""The workdir's durable state: Orbax checkpoints of the state (params, opt_state, step), the
data-iterator position, the config and the corpus record (``aft_jax.data.record``) they were
written with, which a resume and the tools are checked against, and the checksums of all of it
(``aft_jax.trainer.checksum``). Where they live in the workdir: ``aft_jax.workdir``.

Orbax writes each checkpoint into a temporary directory and renames it when complete, so a
crash mid-save leaves the previous checkpoint usable; a checkpoint damaged later (a truncated
or garbled file, or bytes that still parse but no longer match their checksums) is skipped on
resume in favour of the newest intact one, and never loaded.

Restoring only reads: the small JSON items first (what a run is checked against before any
array is read), then the state, verified. Moving damaged checkpoints aside (``set_aside``) is
left to the caller, for once every check of the run has passed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import shutil
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jax.experimental import multihost_utils

from aft_jax.trainer import checksum
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


# Keys whose change no --allow_config_change resumes: they define the vocabulary, so the
# checkpoint's embedding would be read as other tokens.
VOCABULARY = ("data.dataset", "data.tokenizer", "data.vocab_size", "data.variant", "data.encoding")

JSON_ITEMS = ("config", "data", "corpus")  # beside the state; each one's SHA-256 in "checksums"


class DamagedCheckpointError(ValueError):
  """A checkpoint's contents do not match the checksums saved with them."""


def checkpoint_manager(workdir: str | Workdir, cfg: CheckpointConfig) -> ocp.CheckpointManager:
  """The workdir's checkpoints (``cfg.keep_checkpoints`` of them kept); creating it writes
  nothing (the first save makes the folder).

  Orbax reads each step's metadata here and logs an ERROR, with the file's bytes, for one it
  cannot parse; that is the restore's to judge (it skips a damaged step with one line), so the
  log is kept off stderr."""
  with _quiet_orbax_threads(stay_quiet_on_error=False):
    return ocp.CheckpointManager(
      Workdir.of(workdir).checkpoints_dir,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep_checkpoints, create=False, enable_async_checkpointing=False
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


def _wind_down() -> None:
  """After a read or write failed inside Orbax or TensorStore (their noise kept off stderr by
  the caller): a second for their threads to finish failing, then the coroutines they left
  unfinished collected, with their "never awaited" warnings ignored. Collected later (with the
  error's frames, or at the interpreter's exit) each prints a page after our one-line error."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    time.sleep(1.0)
    gc.collect()


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


def _quietly(read):
  """(``read()``, None), or (None, its error's first line) if it raised an Exception; with the
  reading threads' noise kept off stderr (``_quiet_orbax_threads``), also after a failure.

  Only the line is kept, not the exception: its frames hold the coroutines TensorStore left
  unfinished, which print a page each ("coroutine ... was never awaited", with the whole array
  spec) whenever they are collected. So they are collected here, before stderr is given back.

  A Ctrl-C is no damage: it is raised as the KeyboardInterrupt it is, also where Orbax wraps it
  in an Exception of its own, and the reading threads stay quiet: they go on failing against
  the event loop the interrupt closed until the process ends (``aft_jax.ctrl_c``).
  """
  undo = _silence_background_errors()
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      try:
        return read(), None
      except DamagedCheckpointError as e:
        # Raised by the checksums after a read that completed: no reading thread or
        # unfinished coroutine is left behind.
        return None, _first_line(e)
      except Exception as e:  # noqa: BLE001 (a damaged file fails in Orbax, TensorStore, json)
        if _interrupted(e):
          raise KeyboardInterrupt from e
        error = _first_line(e)
    _wind_down()  # (without the exception, whose frames hold the reading coroutines)
  except KeyboardInterrupt:
    undo = None
    raise
  finally:
    if undo is not None:
      undo()
  return None, error


def _interrupted(e: BaseException) -> bool:
  """Whether ``e`` was raised because of a KeyboardInterrupt (one of its causes is one)."""
  while e is not None:
    if isinstance(e, KeyboardInterrupt):
      return True
    e = e.__cause__ or e.__context__
  return False


def _first_line(e: BaseException, limit: int = 200) -> str:
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  text = text.split(" See full TensorStore details")[0]
  text = text if len(text) <= limit else text[: limit - 3] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def save(
  mngr: ocp.CheckpointManager, step: int, state, data_iter, config=None, corpus=None
) -> None:
  """Saves state + data position + ``config`` (``RunConfig.tree``) and ``corpus`` (the corpus
  record: what a resume and the tools are checked against) + the checksums of all of them,
  atomically.

  The trainer always passes its config and corpus record; ``None`` (tools that only move
  state) saves none.

  Never writes non-finite parameters or optimizer state, and turns a failed write (a full
  disk, say) into one error that says what is left to resume from.
  """
  if not bool(_all_finite((state.params, state.opt_state))):
    raise FloatingPointError(
      f"refusing to checkpoint non-finite parameters at step {step}; {_intact_note(mngr)}"
    )
  items = {"data": data_iter.get_state(), "config": config, "corpus": corpus}
  items = {k: json.loads(json.dumps(v)) for k, v in items.items() if v is not None}
  sums = checksum.record(state, items)
  try:
    with _quiet_orbax_threads(stay_quiet_on_error=True):
      args = {k: ocp.args.JsonSave(v) for k, v in items.items()}
      args.update(state=ocp.args.StandardSave(state), checksums=ocp.args.JsonSave(sums))
      mngr.save(step, args=ocp.args.Composite(**args), force=True)
      mngr.wait_until_finished()
  except Exception as e:  # noqa: BLE001 (a full disk fails in Orbax, TensorStore or the OS)
    error = _first_line(e)
  else:
    return
  # The failed write's coroutines live as long as the error's frames: outside the except block
  # they are collected now (left to the interpreter's exit, on a busy machine after the warnings
  # module was gone, each printed "coroutine ... was never awaited" after our error).
  _wind_down()
  raise OSError(
    f"saving the checkpoint at step {step} failed ({error}); {_intact_note(mngr)}: "
    "free disk space and rerun the same command to resume"
  )  # (not chained: Orbax's internal chain says nothing more to the user)


def read_items(mngr: ocp.CheckpointManager, step: int) -> dict:
  """The JSON items the checkpoint at ``step`` has ("config", "data", "corpus", "checksums";
  a checkpoint written by an older version lacks some): small, read before any array."""
  folder = os.path.join(str(mngr.directory), str(step))
  names = [n for n in (*JSON_ITEMS, "checksums") if os.path.isdir(os.path.join(folder, n))]
  if not names:
    return {}
  args = ocp.args.Composite(**{n: ocp.args.JsonRestore() for n in names})
  return dict(mngr.restore(step, args=args))


def newest_items(mngr: ocp.CheckpointManager) -> tuple[int, dict] | None:
  """(step, ``read_items``) of the newest checkpoint whose JSON items read; None if none does.
  A damaged one is passed over quietly here: the restore skips it and says so."""
  for step in sorted(mngr.all_steps(), reverse=True):
    items, _ = _quietly(lambda s=step: read_items(mngr, s))
    if items:  # None: unreadable; {}: an empty folder
      return step, items
  return None


def restore_state(mngr: ocp.CheckpointManager, step: int, abstract_state, items: dict):
  """The state of the checkpoint at ``step``, verified against its checksums together with its
  JSON ``items`` (``read_items``'s); a DamagedCheckpointError naming what does not match.

  ``abstract_state`` (ShapeDtypeStructs with shardings) says where each array goes, so a run
  saved on one mesh restores onto another. A checkpoint written before checkpoints carried
  checksums is restored unverified.
  """
  args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
  state = mngr.restore(step, args=args)["state"]
  saved = items.get("checksums")
  if saved is None:
    return state
  bad = checksum.mismatches(saved, state, {k: v for k, v in items.items() if k in JSON_ITEMS})
  if bad:
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    raise DamagedCheckpointError(
      f"its contents do not match the checksums saved with them ({bad[0]}{more})"
    )
  return state


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state):
  """(state, data-iterator state or None) of the checkpoint at ``step``, verified."""
  items = read_items(mngr, step)
  return restore_state(mngr, step, abstract_state, items), items.get("data")


def check_resume_config(
  saved: dict | None,
  config: dict,
  workdir: str | Workdir,
  allow_config_change: bool,
  defaults: dict | None = None,
):
  """Refuses to continue ``saved`` (the config of the checkpoint, else of the workdir) as
  ``config`` (``RunConfig.tree``) when they differ in what is computed, unless
  ``allow_config_change``; a key that ``saved`` lacks (added to the package since) compares as
  its value in ``defaults``."""
  where = "the checkpoint"
  if saved is None:
    saved, where = Workdir.of(workdir).read_config(), "config.json"
  if saved is None:
    return
  conflicts = resume_conflicts(saved, config, defaults)
  vocabulary = [c for c in conflicts if c.split(":")[0] in VOCABULARY]
  if vocabulary:
    raise ValueError(
      f"workdir {workdir} holds a run trained on another vocabulary ({'; '.join(vocabulary)}; "
      f"compared with {where}): a model cannot resume on another vocabulary, not even with "
      "--allow_config_change; use another --workdir"
    )
  if conflicts and allow_config_change:
    if jax.process_index() == 0:
      print(f"Resuming with a changed config (--allow_config_change): {'; '.join(conflicts)}")
  elif conflicts:
    raise ValueError(
      f"workdir {workdir} holds a run with a different config ({'; '.join(conflicts)}; "
      f"compared with {where}); use another --workdir, or pass --allow_config_change to "
      "resume it anyway"
    )


def write_workdir_config(tree: dict, workdir: str | Workdir) -> None:
  """config.json: the config (``RunConfig.tree``) the run continues with (written once a
  restore succeeded)."""
  if jax.process_index() == 0:
    Workdir.of(workdir).write_config(tree)


@dataclasses.dataclass
class Restored:
  """A checkpoint read back: its step, verified state and JSON items (``read_items``), and the
  newer checkpoints that could not be read: [(step, why: one line)]."""

  step: int
  state: object
  items: dict
  damaged: list


def _newest_readable(mngr, steps, abstract_state, check) -> tuple[Restored | None, list]:
  """The first of ``steps`` whose items and state restore and verify (``check(step, items)``
  runs before its state is read, and raises to refuse it), and [(step, why)] of the ones
  before it that did not."""
  failed = []
  for step in steps:
    if not os.listdir(os.path.join(str(mngr.directory), str(step))):
      failed.append((step, "FileNotFoundError: the folder is empty"))
      continue
    items, why = _quietly(lambda s=step: read_items(mngr, s))
    if why is None:
      if check is not None:
        check(step, items)
      state, why = _quietly(lambda s=step: restore_state(mngr, s, abstract_state, items))
    if why is not None:
      failed.append((step, why))
      continue
    return Restored(step, state, items, failed), failed
  return None, failed


def restore_newest_intact(mngr: ocp.CheckpointManager, abstract_state, check) -> Restored | None:
  """The newest checkpoint that restores and verifies, or None if there is none. Reads only.

  ``check(step, items)`` runs before each restore (the checkpoint's config, corpus record and
  data position) and raises to refuse it. A checkpoint that fails to restore (a truncated or
  garbled file, an empty folder, contents that do not match their checksums) is listed in
  ``Restored.damaged``; ``set_aside`` moves those away once the run has passed every check. If
  none restores, the error lists why each failed.
  """
  steps = sorted(mngr.all_steps(), reverse=True)
  restored, failed = _newest_readable(mngr, steps, abstract_state, check)
  if restored is None and failed:
    _silence_background_errors()  # the run stops here: only this error is worth reading
    raise RuntimeError(
      f"no checkpoint in {mngr.directory} can be restored ("
      + "; ".join(f"step {s}: {why}" for s, why in failed)
      + "); a changed model cannot resume them (use another --workdir), and damaged ones can "
      "be moved away to start afresh"
    )
  return restored


def set_aside(mngr: ocp.CheckpointManager, restored: Restored) -> None:
  """Moves the checkpoints newer than ``restored`` that could not be read to
  ``damaged_checkpoints/`` (saying so in one line each), so later saves and rotation never
  meet them."""
  for bad, why in restored.damaged:
    _set_aside(mngr, bad, f"{why}; resuming from step {restored.step}")
  if restored.damaged:
    mngr.reload()


def restore_readable(mngr: ocp.CheckpointManager, steps, abstract_state, check=None):
  """(Restored, skipped) of the first of ``steps`` that restores and verifies, for reading a run
  (sampling, evaluating, exporting): nothing is moved aside. ``check(step, items)`` as in
  ``restore_newest_intact``. ``skipped``: [(step, why)] of the ones before it that did not
  restore. A one-line ValueError naming each step and why, if none does."""
  restored, failed = _newest_readable(mngr, steps, abstract_state, check)
  if restored is not None:
    return restored, failed
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
