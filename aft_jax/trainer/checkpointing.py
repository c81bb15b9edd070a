"""The workdir's checkpoints (Orbax, saved in the background): the state, the data position, the
config and corpus record, and the checksums of all of it (``checksum``). A restore reads and
verifies the JSON items before a run is compared with them, then the state; a damaged checkpoint
is skipped for the newest intact one and set aside once the run passed every check. Docs:
docs/training.md, "Reliability".
"""

from __future__ import annotations

import contextlib
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
  """The workdir's checkpoints (the latest ``keep_checkpoints`` kept; saves asynchronous, see
  ``save``); creating it writes nothing. Orbax logs an ERROR for a step whose metadata does not
  parse: the restore's to judge, so kept ``Quiet``."""
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
  """What a failed save leaves behind, as the end of its error message (``mngr``'s steps: those
  on disk, no save in flight)."""
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
  """The one guard for Orbax's and TensorStore's noise on stderr: a failed write or read fails in
  several of their threads, which print tracebacks for a while (and at exit) and leave
  "never awaited" coroutines, burying our one-line error. ``on()`` keeps it off stderr until
  ``off()``; as a context manager, for the block (a Ctrl-C leaves it on: ``aft_jax.ctrl_c``)."""

  def on(self) -> Quiet:
    self.loggers = [logging.getLogger(n) for n in ("absl", "asyncio", "concurrent.futures")]
    self.saved = threading.excepthook, sys.unraisablehook, sys.stderr
    self.levels = [lg.level for lg in self.loggers]
    threading.excepthook = sys.unraisablehook = lambda args: None
    sys.stderr = _MainThreadOnly(sys.stderr)
    for lg in self.loggers:
      lg.setLevel(logging.CRITICAL)
    return self

  def off(self) -> None:
    threading.excepthook, sys.unraisablehook, sys.stderr = self.saved
    for lg, level in zip(self.loggers, self.levels):
      lg.setLevel(level)

  def __enter__(self) -> Quiet:
    return self.on()

  def __exit__(self, kind, *_):
    if kind is not KeyboardInterrupt:
      self.off()

  @staticmethod
  @contextlib.contextmanager
  def unawaited_ignored():
    """Ignores what the unfinished coroutines of a failed read or write say when collected
    ("coroutine ... was never awaited"), and nothing else."""
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)
      yield

  @staticmethod
  def wind_down() -> None:
    """After a failure (its exception dropped: its frames hold the unfinished coroutines): a
    second for the failing threads to finish, then what they left collected."""
    with Quiet.unawaited_ignored():
      time.sleep(1.0)
      gc.collect()


def one_line(e: BaseException, limit: int = 200) -> str:
  """``e`` as the one line our errors quote: its type and its message's first line."""
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  text = text.split(" See full TensorStore details")[0]
  text = text if len(text) <= limit else text[: limit - 3] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _quietly(read):
  """(``read()``, None), or (None, its error's ``one_line``) if it raised an Exception, quiet
  (``Quiet``) also after the failure. A Ctrl-C is no damage: raised as the KeyboardInterrupt it
  is, also where Orbax wraps it in an Exception of its own."""
  with Quiet(), Quiet.unawaited_ignored():
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
  """Saves the state, data position, ``config``, ``corpus`` record (None: not saved) and their
  checksums atomically in the background: returns once Orbax holds a host copy of the state.
  Refuses non-finite parameters. A failed write is one OSError naming the step and what is left,
  raised here or by the next wait (``save``, ``finish_saving``), the writers ``Quiet`` till then."""
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
  raise _save_failed(mngr, step, error)


def finish_saving(mngr: ocp.CheckpointManager) -> None:
  """Waits until the save in flight, if any (``save``), is on disk; where its write failed,
  the OSError ``save`` describes, naming that save's step."""
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
  """The error of the save at ``step`` that failed with ``error`` (its first line)."""
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
  """The JSON items of the checkpoint at ``step`` ("config", "data", "corpus", "checksums"),
  verified (a DamagedCheckpointError names the first that does not match, or lost checksums);
  without "checksums" only where it predates them. {}: none there."""
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
  """A DamagedCheckpointError naming the first of ``bad`` (what does not match its checksum)
  and how many more, if there are any."""
  if bad:
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    raise DamagedCheckpointError(
      f"its contents do not match the checksums saved with them ({bad[0]}{more})"
    )


def newest_items(mngr: ocp.CheckpointManager) -> tuple[int, dict] | None:
  """(step, ``read_items``) of the newest checkpoint whose JSON items read and verify; None if
  none does. A damaged one is passed over quietly here: the restore skips it and says so."""
  for step in sorted(mngr.all_steps(), reverse=True):
    items, _ = _quietly(lambda s=step: read_items(mngr, s))
    if items:  # None: unreadable; {}: an empty folder
      return step, items
  return None


def restore_state(mngr: ocp.CheckpointManager, step: int, abstract_state, items: dict):
  """The state of the checkpoint at ``step`` placed as ``abstract_state`` (its shardings: a run
  saved on one mesh restores onto another), verified against the checksums among ``items``; a
  DamagedCheckpointError names the arrays that do not match."""
  args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
  state = mngr.restore(step, args=args)["state"]
  if "checksums" in items:
    _raise_mismatches(checksum.array_mismatches(items["checksums"], state))
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
  as_written=None,
) -> list[str]:
  """Refuses to continue ``saved`` (the checkpoint's config, else config.json) as ``config`` where
  they differ in what is computed, unless ``allow_config_change``; returns the differences
  allowed. ``as_written(saved)``: ``saved`` with keys added since at the values it ran with; a
  refusal names the flags that resume such a run as written."""
  where = "the checkpoint"
  if saved is None:
    saved, where = Workdir.of(workdir).read_config(), "config.json"
  if saved is None:
    return []
  written = saved if as_written is None else as_written(saved)
  conflicts = resume_conflicts(written, config)
  vocabulary = [c for c in conflicts if c.split(":")[0] in VOCABULARY]
  if vocabulary:
    raise ValueError(
      f"workdir {workdir} holds a run trained on another vocabulary ({'; '.join(vocabulary)}; "
      f"compared with {where}): a model cannot resume on another vocabulary, not even with "
      "--allow_config_change; use another --workdir"
    )
  if conflicts and not allow_config_change:
    raise ValueError(
      f"workdir {workdir} holds a run with a different config ({'; '.join(conflicts)}; "
      f"compared with {where}){_as_written_hint(saved, written, conflicts)}; use another "
      "--workdir, or pass --allow_config_change to resume it anyway"
    )
  return conflicts


def _as_written_hint(saved: dict, written: dict, conflicts: list[str]) -> str:
  """What a refusal adds where conflicting keys were added since ``saved`` was written: the
  flags that give them the values the run was trained with (``written``'s)."""
  a, b = flatten(saved), flatten(written)
  keys = [c.split(":")[0] for c in conflicts]
  older = [k for k in keys if k in b and k not in a]
  if not older:
    return ""
  flags = " ".join(f"--config.{k}={b[k] if isinstance(b[k], str) else repr(b[k])}" for k in older)
  return (
    f"; it was written before {', '.join(older)} existed, by a version that ran as {flags}: "
    "pass that to resume the run as it was written"
  )


@dataclasses.dataclass
class Restored:
  """A checkpoint read back: its step, verified state and JSON items (``read_items``), and the
  newer checkpoints that could not be read: [(step, why: one line)]."""

  step: int
  state: object
  items: dict
  damaged: list

  @property
  def unverified(self) -> str | None:
    """Why the checkpoint could not be verified (written before checkpoints carried
    checksums: ``read_items``), as a clause for a one-line note; None where it was verified."""
    if "checksums" in self.items:
      return None
    return "written before checkpoints carried checksums, so it is loaded unverified"


def _newest_readable(mngr, steps, abstract_state, check) -> tuple[Restored | None, list]:
  """The first of ``steps`` whose items and state restore and verify (``check(step, items)``
  runs once its items verified, before its state is read, and raises to refuse it), and
  [(step, why)] of the ones before it that did not."""
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
  ``check(step, items)`` runs once a checkpoint's items verified, before its state is read, and
  raises to refuse it. Those that fail to restore are listed in ``Restored.damaged`` (for
  ``set_aside``); if none restores, one error lists why each failed."""
  steps = sorted(mngr.all_steps(), reverse=True)
  restored, failed = _newest_readable(mngr, steps, abstract_state, check)
  if restored is None and failed:
    Quiet().on()  # for good: the run stops here: only this error is worth reading
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
  """(Restored, [(step, why)] skipped before it) of the first of ``steps`` that restores and
  verifies, for reading a run: nothing moved aside; a one-line ValueError if none does."""
  restored, failed = _newest_readable(mngr, steps, abstract_state, check)
  if restored is not None:
    return restored, failed
  Quiet().on()  # for good: the command stops here: only this error is worth reading
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


def resume_conflicts(saved: dict, current: dict) -> list[str]:
  """Differences between two configs (as dicts) that make resuming one as the other wrong
  (a key one of them lacks: None)."""
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
