"""The workdir's checkpoints (Orbax, saved in the background): the state, the data position, the
config and corpus record, and their checksums; a damaged checkpoint is skipped for the newest
intact one and set aside. Docs: docs/training.md, "Reliability" and "Checkpoint integrity".

Checksums: one per array of the state, two 32-bit sums computed on its devices, whatever its
sharding:

    s = sum_i mix(bits_i ^ mix(i ^ seed))   (mod 2**32), for two seeds

``bits_i``: element i's bit pattern as uint32 words, i its row-major position, ``mix`` the
MurmurHash3 finaliser (a bijection: a change within one word changes both sums for certain;
changes to several cancel with a chance of about 2**-64). JSON items: SHA-256 of canonical JSON.
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import hashlib
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
import numpy as np
import orbax.checkpoint as ocp

from jax import lax
from jax.experimental import multihost_utils

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


CHECKSUMS_VERSION = 1
_SEEDS = (0x9E3779B9, 0x7F4A7C15)  # two lanes: 64 bits of checksum per array


def _mix(h):
  """MurmurHash3's 32-bit finaliser (lax on NumPy scalars: jnp's checks were slow to trace)."""
  shr = lambda h, n: lax.shift_right_logical(h, np.uint32(n))
  h = lax.mul(lax.bitwise_xor(h, shr(h, 16)), np.uint32(0x85EBCA6B))
  h = lax.mul(lax.bitwise_xor(h, shr(h, 13)), np.uint32(0xC2B2AE35))
  return lax.bitwise_xor(h, shr(h, 16))


def _words(x):
  """The bits of ``x`` as uint32: one word per element ([..., k] for 8-byte dtypes)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return lax.convert_element_type(x, np.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size < 4:
    narrow = lax.bitcast_convert_type(x, np.dtype(f"uint{8 * size}"))
    return lax.convert_element_type(narrow, np.uint32)
  return lax.bitcast_convert_type(x, np.uint32)


def _sums(x):
  w = _words(x)
  position = lax.full(w.shape, np.uint32(0))
  for d, n in enumerate(w.shape):  # row-major index, built per axis: no reshape of a sharded x
    position = lax.add(lax.mul(position, np.uint32(n)), lax.broadcasted_iota(np.uint32, w.shape, d))
  return jnp.stack(
    [
      jnp.sum(
        _mix(lax.bitwise_xor(w, _mix(lax.bitwise_xor(position, np.uint32(s))))), dtype=jnp.uint32
      )
      for s in _SEEDS
    ]
  )


_tree_sums = jax.jit(lambda tree: jax.tree_util.tree_map(_sums, tree))


def array_checksums(tree) -> dict[str, str]:
  """{path: "dtype[shape]:sums"} of every array of ``tree`` (path: ``jax.tree_util.keystr``)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  sums = jax.device_get(_tree_sums([x for _, x in leaves]))
  return {
    jax.tree_util.keystr(p): f"{x.dtype}{list(x.shape)}:{int(s[0]):08x}{int(s[1]):08x}"
    for (p, x), s in zip(leaves, sums)
  }


def json_checksum(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


class DamagedCheckpointError(ValueError):
  """A checkpoint's contents do not match the checksums saved with them."""


def checkpoint_manager(workdir: str | Workdir, cfg: CheckpointConfig) -> ocp.CheckpointManager:
  """The workdir's checkpoints (the latest ``keep_checkpoints``); creating it writes nothing."""
  with Quiet():  # Orbax logs an ERROR for a step whose metadata does not parse
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
  """Orbax's and TensorStore's threads' noise off stderr, from ``on()`` to ``off()`` or a block."""

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
  """Saves a checkpoint in the background; a failed write: an OSError (or in ``finish_saving``)."""
  finish_saving(mngr)
  if not bool(_all_finite((state.params, state.opt_state))):
    raise FloatingPointError(
      f"refusing to checkpoint non-finite parameters at step {step}; {_intact_note(mngr)}"
    )
  items = {"data": data_iter.get_state(), "config": config, "corpus": corpus}
  items = {k: json.loads(json.dumps(v)) for k, v in items.items() if v is not None}
  sums = {
    "version": CHECKSUMS_VERSION,
    "arrays": array_checksums(state),
    "json": {name: json_checksum(obj) for name, obj in items.items()},
  }
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
  # Outside the except block the failed write's coroutines are collected now, not at exit (where
  # each printed "coroutine ... was never awaited" after our error).
  if getattr(mngr, "quiet_while_saving", None) is None:
    Quiet().on()  # for good: the failed threads go on failing, and again at exit
  mngr.quiet_while_saving = None  # (stays on: the process stops with this one error)
  Quiet.wind_down()
  # Its temporary folder, left by Orbax, would keep the disk full for the rerun.
  tmp = f"{step}{ocp.path.atomicity_types.TMP_DIR_SUFFIX}*"
  for path in glob.glob(os.path.join(glob.escape(str(mngr.directory)), tmp)):
    shutil.rmtree(path, ignore_errors=True)
  # What is on disk: not the failed step; a step Orbax dropped from its list for after it, still.
  mngr.reload()
  return OSError(
    f"saving the checkpoint at step {step} failed ({error}); {_intact_note(mngr)}: "
    "free disk space and rerun the same command to resume"
  )  # (not chained: Orbax's internal chain says nothing more to the user)


def read_items(mngr: ocp.CheckpointManager, step: int) -> dict:
  """The verified JSON items of the checkpoint at ``step``, {} if none (DamagedCheckpointError)."""
  folder = os.path.join(str(mngr.directory), str(step))
  names = [n for n in (*JSON_ITEMS, "checksums") if os.path.isdir(os.path.join(folder, n))]
  if not names:
    return {}
  args = ocp.args.Composite(**{n: ocp.args.JsonRestore() for n in names})
  items = dict(mngr.restore(step, args=args))
  saved = items.get("checksums")
  if saved is None:
    # Whether the step predates checksums: its Orbax metadata reads and lists no "checksums".
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
  now = {k: json_checksum(items[k]) for k in JSON_ITEMS if k in items}
  _raise_mismatches(saved.get("json", {}), now)  # a lost item too
  return items


def _raise_mismatches(was: dict, now: dict) -> None:
  bad = [k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
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
  """(the first of ``steps`` that restores and verifies, [(step, why)] of those before it)."""

  def restore_state(step, items):  # verified against ``items``' sums
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
    state = mngr.restore(step, args=args)["state"]
    if "checksums" in items:
      _raise_mismatches(items["checksums"].get("arrays", {}), array_checksums(state))
    return state

  failed = []
  for step in steps:
    if not os.listdir(os.path.join(str(mngr.directory), str(step))):
      failed.append((step, "FileNotFoundError: the folder is empty"))
      continue
    items, why = _quietly(lambda s=step: read_items(mngr, s))
    if why is None:
      if check is not None:
        check(step, items)
      state, why = _quietly(lambda s=step: restore_state(s, items))
    if why is not None:
      failed.append((step, why))
      continue
    return Restored(step, state, items, failed), failed
  return None, failed


def _failures(failed: list) -> str:
  return "; ".join(f"step {s}: {why}" for s, why in failed)


def restore_newest_intact(mngr: ocp.CheckpointManager, abstract_state, check) -> Restored | None:
  """The newest checkpoint that restores and verifies (reads only); None if there is none."""
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
  """``_newest_readable`` for reading a run (nothing moved aside); a ValueError if none reads."""
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
