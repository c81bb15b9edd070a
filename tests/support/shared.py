"""Read-only fixtures made once per session by the first xdist worker that asks; cache trimming."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
from collections.abc import Callable


def once(tmp_path_factory, name: str, build: Callable[[pathlib.Path], object]):
  """(folder, ``build(folder)``'s JSON value), built by the first process that asks."""
  root = tmp_path_factory.getbasetemp()  # an xdist worker's is in the session's
  root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
  folder, done = root / name, root / f"{name}.json"
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not done.exists():
      shutil.rmtree(folder, ignore_errors=True)
      folder.mkdir()
      value = build(folder)
      tmp = done.with_suffix(".tmp")
      tmp.write_text(json.dumps(value))
      tmp.rename(done)  # whole or not there: a reader never sees half of it
  return folder, json.loads(done.read_text())


def trim_cache(folder: str, keep: int) -> None:
  """Past ``keep`` bytes, the least recently written files of ``folder`` deleted down to half."""
  if not os.path.isdir(folder):
    return
  files = [(e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(folder)]
  if sum(size for _, size, _ in files) <= keep:
    return
  kept = 0
  for _, size, path in sorted(files, reverse=True):  # the newest first
    kept += size
    if kept > keep // 2:
      with contextlib.suppress(FileNotFoundError):  # another session trimmed it first
        os.remove(path)
