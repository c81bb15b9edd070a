"""Files whole or absent (written under a temporary name, then renamed); disk and path checks."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
from collections.abc import Iterator


class DiskFullError(OSError):
  def __init__(self, path: str, num_bytes: int):
    super().__init__(
      errno.ENOSPC, f"no space left on device: needs ~{math.ceil(num_bytes / 1e6):,} MB at {path}"
    )
    self.path, self.num_bytes = path, num_bytes

  def __str__(self) -> str:
    return self.strerror


def check_space(path: str, num_bytes: int) -> None:
  """DiskFullError unless ``path``'s disk has ``num_bytes`` free (else a memmap dies of SIGBUS)."""
  if shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free < num_bytes:
    raise DiskFullError(path, num_bytes)


def check_file_path(flag: str, path: str) -> None:
  """A one-line ValueError naming ``flag`` unless ``path`` can be written as a file."""
  if not path:
    raise ValueError(f"{flag} is empty: give a file name")
  real = os.path.realpath(path)
  if os.path.isdir(real):
    raise ValueError(f"{flag} {path} is a directory: give a file name")
  if os.path.exists(real) and not os.path.isfile(real):
    raise ValueError(f"{flag} {path} is not a regular file (a device or a pipe): give a file name")
  if not os.path.isdir(os.path.dirname(real)):
    raise ValueError(f"{flag} {path}: folder {os.path.dirname(real)} does not exist")


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
  """A temporary path beside ``path``, renamed to it if the block succeeds, else removed."""
  path = os.path.realpath(path)
  tmp = f"{path}.tmp-{os.getpid()}{suffix}"
  try:
    yield tmp
    os.replace(tmp, path)
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)


@contextlib.contextmanager
def output_path(flag: str, path: str, suffix: str = "") -> Iterator[str]:
  """``atomic_path`` for a command's output: a failed write (a full disk) is one line."""
  try:
    with atomic_path(path, suffix) as tmp:
      yield tmp
  except OSError as e:
    raise ValueError(f"{flag} {path}: cannot write it: {e.strerror or e}") from None


def cannot_write(path: str, e: OSError) -> OSError:
  return OSError(e.errno, f"cannot write {path}: {e.strerror or e}")


def atomic_write(path: str, text: str) -> None:
  try:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
      f.write(text)
  except OSError as e:
    raise cannot_write(path, e) from None


def atomic_write_json(path: str, obj, indent: int = 2, allow_nan: bool = True) -> None:
  text = json.dumps(obj, indent=indent, sort_keys=True, allow_nan=allow_nan)
  atomic_write(path, text + "\n")
