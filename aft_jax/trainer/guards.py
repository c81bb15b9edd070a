"""What guards a running trainer: the workdir's lock (one trainer per workdir; a stale one taken
over) and ``Preemption``, SIGTERM / Ctrl-C as a flag the training loop checks after each step
(docs/training.md, "Reliability").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from aft_jax import files
from aft_jax.workdir import Workdir


class WorkdirInUse(RuntimeError):
  """Another live trainer holds the workdir."""


def _read(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError):
    return {}  # unreadable: treated as held by an unknown process


def _create(path: str, holder: dict) -> bool:
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    with open(tmp, "w") as f:
      json.dump(holder, f)
    os.link(tmp, path)  # fails if path exists, and never leaves a half-written lock
    return True
  except FileExistsError:
    return False
  except OSError as e:  # a full disk, a read-only folder
    raise files.cannot_write(path, e) from None
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)


def acquire(workdir: str) -> str:
  """Takes the workdir's lock (taking over a stale one); raises WorkdirInUse if it is held."""
  os.makedirs(workdir, exist_ok=True)
  path = Workdir.of(workdir).lock_file
  host = socket.gethostname()
  me = {"pid": os.getpid(), "host": host, "since": time.strftime("%Y-%m-%d %H:%M:%S")}
  for _ in range(3):  # a stale lock removed by us (or a racing trainer), then created again
    if _create(path, me):
      return path
    holder = _read(path)
    if holder is None:
      continue  # released in between
    pid = holder.get("pid")
    if holder.get("host") == host and isinstance(pid, int):
      try:
        os.kill(pid, 0)
      except ProcessLookupError:  # stale: its process is gone
        with contextlib.suppress(FileNotFoundError):
          os.remove(path)
        continue
      except PermissionError:  # someone else's process: it exists
        pass
    raise WorkdirInUse(
      f"workdir {workdir} is in use by another trainer (pid {pid} on {holder.get('host')}, "
      f"since {holder.get('since')}); wait for it to finish, or delete {path} if that process "
      "is gone"
    )
  raise WorkdirInUse(f"could not take the lock {path}: other trainers keep taking it")


@contextlib.contextmanager
def hold(workdir: str | Workdir, enabled: bool = True) -> Iterator[None]:
  """Holds the workdir's lock for the block (``enabled=False``: processes other than 0)."""
  if not enabled:
    yield
    return
  workdir = os.fspath(workdir)
  created = not os.path.exists(workdir)
  path = acquire(workdir)
  try:
    yield
  finally:
    holder = _read(path)  # released if this process still holds it
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
      with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    if created:  # a run refused before it wrote anything leaves no empty workdir behind
      with contextlib.suppress(OSError):
        os.rmdir(workdir)


class Preemption:
  """A context manager that records SIGTERM / SIGINT instead of dying on them."""

  def __init__(self):
    self.signal, self._old, self._synced = None, {}, False

  def __enter__(self):
    # Whether JAX's preemption sync manager handles SIGTERM in this run (several processes).
    self._synced = jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)
    # JAX's notifier installed its own SIGTERM handler; a Python one would replace it.
    sigs = (signal.SIGINT,) if self._synced else (signal.SIGTERM, signal.SIGINT)
    for sig in sigs:
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread
        pass
    return self

  def _handle(self, signum, frame):
    if self.signal is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C stops at once
    self.signal = signum

  def should_stop(self, i: int, every: int, synced: bool = True) -> bool:
    """Whether to stop after step ``i`` (several processes: at a sync point, or every ``every``)."""
    if jax.process_count() == 1:
      return self.signal is not None
    if synced and self._synced and multihost_utils.reached_preemption_sync_point(i):
      self.signal = "SIGTERM, preemption notice to one or more processes"
      return True
    if i % every:
      return False
    flags = multihost_utils.process_allgather(np.int32(self.signal is not None))
    if np.any(flags) and self.signal is None:
      self.signal = "from another process"
    return bool(np.any(flags))

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
