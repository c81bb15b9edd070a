"""The workdir's checkpoints (Orbax, saved in the background): the state, the data position, the
config and corpus record, and their checksums (``checksum``); a damaged checkpoint is skipped for
the newest intact one and set aside. Docs: docs/training.md, "Reliability".
"""

from __future__ import annotations

import dataclasses
import gc
import glob
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
from aft_jax.typed_config import TypedConfig, positive
from aft_jax.workdir import Workdir


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(TypedConfig):
  """Keys at the top of the config tree (``config.checkpoint_every_steps``, ...)."""

  checkpoint_every_steps: int = 500  # Orbax checkpoints (also at the end and on SIGTERM)
  keep_checkpoints: int = 2  # how many recent checkpoints to keep

  def _value_problems(self) -> list[str]:
    return positive(self, "checkpoint_every_steps", "keep_checkpoints")


JSON_ITEMS = ("config", "data", "corpus")  # beside the state; each one's SHA-256 in "checksums"


class DamagedCheckpointError(ValueError):
  """A checkpoint's contents do not match the checksums saved with them."""


def checkpoint_manager(workdir: str | Workdir, cfg: CheckpointConfig) -> ocp.CheckpointManager:
  """The workdir's checkpoints (the latest ``keep_checkpoints`` kept); creating it writes
  nothing. ``Quiet``: Orbax logs an ERROR for a step whose metadata does not parse."""
  with Quiet():
    return ocp.CheckpointManager(
      Workdir.of(workdir).checkpoints_dir,
      options=ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(cfg.keep_checkpoints), create=False
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


class Quiet:
  """Orbax's and TensorStore's threads' noise (tracebacks, logs, never-awaited coroutines) kept off
  stderr from ``on()`` to ``off()``, or for a block (a Ctrl-C leaves it on: ``aft_jax.ctrl_c``)."""

  def on(self) -> Quiet:
    self.loggers = [logging.getLogger(n) for n in ("absl", "asyncio", "concurrent.futures")]
    self.saved = threading.excepthook, sys.unraisablehook, sys.stderr
    self.levels = [lg.level for lg in self.loggers]
    threading.excepthook = sys.unraisablehook = lambda args: None
    self.warnings = warnings.catch_warnings()
    self.warnings.__enter__()
    warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)
    sys.stderr = _MainThreadOnly(sys.stderr)
    for lg in self.loggers:
      lg.setLevel(logging.CRITICAL)
    return self

  def off(self) -> None:
    threading.excepthook, sys.unraisablehook, sys.stderr = self.saved
    self.warnings.__exit__(None, None, None)
    for lg, level in zip(self.loggers, self.levels):
      lg.setLevel(level)

  def __enter__(self) -> Quiet:
    return self.on()

  def __exit__(self, kind, *_):
    if kind is not KeyboardInterrupt:
      self.off()

  @staticmethod
  def wind_down() -> None:
    """After a failure, while quiet: a second for the failing threads, then their leftovers."""
    time.sleep(1.0)
    gc.collect()


def one_line(e: BaseException, limit: int = 200) -> str:
  """``e`` as the one line our errors quote: its type and its message's first line."""
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  text = text.split(" See full TensorStore details")[0]
  text = text if len(text) <= limit else text[: limit - 3] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _quietly(read):
  """(``read()``, None), or (None, its error's ``one_line``); a Ctrl-C, even wrapped, re-raised."""
  with Quiet():
    try:
      return read(), None
    except DamagedCheckpointError as e:  # raised after a read that completed: nothing to wind down
      return None, one_line(e)
    except Exception as e:  # noqa: BLE001 (a damaged file fails in Orbax, TensorStore, json)
      cause = e
      while cause is not None and not isinstance(cause, KeyboardInterrupt):
        cause = cause.__cause__ or cause.__context__
      if cause is not None:
        raise KeyboardInterrupt from e
      error = one_line(e)
    Quiet.wind_down()
  return None, error


def save(
  mngr: ocp.CheckpointManager, step: int, state, data_iter, config=None, corpus=None
) -> None:
  """Saves the state, data position, ``config``, ``corpus`` record and their checksums in the
  background; a failed write is one OSError, raised here or by ``finish_saving``."""
  finish_saving(mngr)
  if not bool(_all_finite((state.params, state.opt_state))):
    raise FloatingPointError(
      f"refusing to checkpoint non-finite parameters at step {step}; {_intact_note(mngr)}"
    )
  items = {"data": data_iter.get_state(), "config": config, "corpus": corpus}
  items = {k: json.loads(json.dumps(v)) for k, v in items.items() if v is not None}
  sums = checksum.record(state, items)
  if getattr(mngr, "quiet_while_saving", None) is None:
    mngr.quiet_while_saving = Quiet().on()  # off once ``finish_saving`` saw the write succeed
  try:
    args = {k: ocp.args.JsonSave(v) for k, v in items.items()}
    args.update(state=ocp.args.StandardSave(state), checksums=ocp.args.JsonSave(sums))
    mngr.save(step, args=ocp.args.Composite(**args), force=True)
  except Exception as e:  # noqa: BLE001 (a full disk fails in Orbax, TensorStore or the OS)
    error = one_line(e)
  else:
    return
  raise _save_failed(mngr, step, error)  # outside the except block: see _save_failed


def finish_saving(mngr: ocp.CheckpointManager) -> None:
  """Waits until the save in flight, if any, is on disk (its failure: ``save``'s OSError)."""
  step = mngr.latest_step()  # a save in flight is the manager's latest step
  try:
    mngr.wait_until_finished()
  except Exception as e:  # noqa: BLE001 (a full disk fails in Orbax, TensorStore or the OS)
    error = one_line(e)
  else:
    quiet = getattr(mngr, "quiet_while_saving", None)
    if quiet is not None:
      quiet.off()
      mngr.quiet_while_saving = None
    return
  raise _save_failed(mngr, step, error)


def _save_failed(mngr: ocp.CheckpointManager, step: int, error: str) -> OSError:
  # The failed write's coroutines live as long as the error's frames: outside the except block
  # they are collected now (left to the interpreter's exit, on a busy machine after the warnings
  # module was gone, each printed "coroutine ... was never awaited" after our error).
  if getattr(mngr, "quiet_while_saving", None) is None:
    Quiet().on()  # for good: the failed threads go on failing, and again at exit
  mngr.quiet_while_saving = None  # (stays on: the process stops with this one error)
  Quiet.wind_down()
  # Its temporary folder, left by Orbax, would keep the disk full for the rerun.
  tmp = f"{step}{ocp.path.atomicity_types.TMP_DIR_SUFFIX}*"
  for path in glob.glob(os.path.join(glob.escape(str(mngr.directory)), tmp)):
    shutil.rmtree(path, ignore_errors=True)
  # What is on disk: the failed step is not; a step that Orbax already dropped from its list,
  # to be deleted once that save finished, still is.
  mngr.reload()
  return OSError(
    f"saving the checkpoint at step {step} failed ({error}); {_intact_note(mngr)}: "
    "free disk space and rerun the same command to resume"
  )  # (not chained: Orbax's internal chain says nothing more to the user)


def read_items(mngr: ocp.CheckpointManager, step: int) -> dict:
  """The verified JSON items of the checkpoint at ``step`` (``JSON_ITEMS``, "checksums"): a
  DamagedCheckpointError where they do not match or checksums are lost; {}: none there."""
  folder = os.path.join(str(mngr.directory), str(step))
  names = [n for n in (*JSON_ITEMS, "checksums") if os.path.isdir(os.path.join(folder, n))]
  if not names:
    return {}
  args = ocp.args.Composite(**{n: ocp.args.JsonRestore() for n in names})
  items = dict(mngr.restore(step, args=args))
  saved = items.get("checksums")
  if saved is None:
    # Whether the step predates checksums: its Orbax metadata reads and lists no "checksums"
    # item (metadata that does not read cannot tell).
    try:
      handlers = ocp.metadata.get_step_metadata(folder).item_handlers
    except Exception:  # noqa: BLE001 (missing, or not JSON: Orbax raises ValueError or OSError)
      handlers = None
    if not (isinstance(handlers, dict) and "checksums" not in handlers):
      raise DamagedCheckpointError(
        "its checksums (the folder checksums/) are missing, and its metadata does not show it "
        "was written before checkpoints carried them"
      )
    return items
  _raise_mismatches(
    checksum.json_mismatches(saved, {k: items[k] for k in JSON_ITEMS if k in items})
  )
  return items


def _raise_mismatches(bad: list[str]) -> None:
  if bad:
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    raise DamagedCheckpointError(
      f"its contents do not match the checksums saved with them ({bad[0]}{more})"
    )


def newest_items(mngr: ocp.CheckpointManager) -> tuple[int, dict] | None:
  """(step, ``read_items``) of the newest checkpoint whose JSON items verify; None if none."""
  for step in sorted(mngr.all_steps(), reverse=True):
    items, _ = _quietly(lambda s=step: read_items(mngr, s))
    if items:  # None: unreadable; {}: an empty folder
      return step, items
  return None


def _restore_state(mngr: ocp.CheckpointManager, step: int, abstract_state, items: dict):
  """The state at ``step``, sharded as ``abstract_state``, verified against ``items``' sums."""
  args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
  state = mngr.restore(step, args=args)["state"]
  if "checksums" in items:
    _raise_mismatches(checksum.array_mismatches(items["checksums"], state))
  return state


@dataclasses.dataclass
class Restored:
  """A checkpoint read back, and the newer ones that could not be: [(step, why: one line)]."""

  step: int
  state: object
  items: dict
  damaged: list

  @property
  def unverified(self) -> str | None:
    """Why it is loaded unverified, as a clause for a note; None where it was verified."""
    if "checksums" in self.items:
      return None
    return "written before checkpoints carried checksums, so it is loaded unverified"


def _newest_readable(mngr, steps, abstract_state, check) -> tuple[Restored | None, list]:
  """(the first of ``steps`` that restores and verifies, [(step, why)] of those before it);
  ``check(step, items)`` runs before a state is read and raises to refuse it."""
  failed = []
  for step in steps:
    if not os.listdir(os.path.join(str(mngr.directory), str(step))):
      failed.append((step, "FileNotFoundError: the folder is empty"))
      continue
    items, why = _quietly(lambda s=step: read_items(mngr, s))
    if why is None:
      if check is not None:
        check(step, items)
      state, why = _quietly(lambda s=step: _restore_state(mngr, s, abstract_state, items))
    if why is not None:
      failed.append((step, why))
      continue
    return Restored(step, state, items, failed), failed
  return None, failed


def _failures(failed: list) -> str:
  return "; ".join(f"step {s}: {why}" for s, why in failed)


def restore_newest_intact(mngr: ocp.CheckpointManager, abstract_state, check) -> Restored | None:
  """The newest checkpoint that restores and verifies, None if none; reads only. If none
  restores, one error lists why each failed."""
  restored, failed = _newest_readable(
    mngr, sorted(mngr.all_steps(), reverse=True), abstract_state, check
  )
  if restored is None and failed:
    Quiet().on()  # for good: the run stops here: only this error is worth reading
    raise RuntimeError(
      f"no checkpoint in {mngr.directory} can be restored ({_failures(failed)}); a changed model "
      "cannot resume them (use another --workdir), and damaged ones can be moved away to start "
      "afresh"
    )
  return restored


def restore_readable(mngr: ocp.CheckpointManager, steps, abstract_state, check=None):
  """(Restored, [(step, why)] skipped before it) of the first of ``steps`` that restores and
  verifies, for reading a run: nothing moved aside; a one-line ValueError if none does."""
  restored, failed = _newest_readable(mngr, steps, abstract_state, check)
  if restored is not None:
    return restored, failed
  Quiet().on()  # for good: the command stops here: only this error is worth reading
  raise ValueError(f"the checkpoint cannot be read: {_failures(failed)} (in {mngr.directory})")


def set_aside(mngr: ocp.CheckpointManager, restored: Restored) -> None:
  """Moves the unreadable checkpoints newer than ``restored`` to ``damaged_checkpoints/``."""
  dst_dir = Workdir(os.path.dirname(str(mngr.directory))).damaged_checkpoints_dir
  for step, why in restored.damaged:
    dst, n = os.path.join(dst_dir, str(step)), 1
    while os.path.exists(dst):
      dst, n = os.path.join(dst_dir, f"{step}.{n}"), n + 1
    if jax.process_index() == 0:
      print(
        f"Skipped the damaged checkpoint at step {step} ({why}; resuming from step "
        f"{restored.step}); moved to {dst}",
        flush=True,
      )
      os.makedirs(dst_dir, exist_ok=True)
      shutil.move(os.path.join(str(mngr.directory), str(step)), dst)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
  if restored.damaged:
    mngr.reload()
