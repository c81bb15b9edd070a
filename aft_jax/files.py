"""Files that are either whole or absent: written under a temporary name, then renamed.

``os.replace`` is atomic on POSIX file systems, so a reader (or a rerun after a crash) sees the
old file or the complete new one, never a half-written one. Used for every file the project
writes outside Orbax checkpoints: configs, results, vocabularies, prepared token arrays.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
  """Yields a temporary path beside ``path``; renames it to ``path`` if the block succeeds.

  ``suffix`` ends the temporary name (``.npy`` for ``np.lib.format.open_memmap``, which adds
  it otherwise). On an exception the temporary file is removed and ``path`` is untouched.
  """
  tmp = f"{path}.tmp-{os.getpid()}{suffix}"
  try:
    yield tmp
    os.replace(tmp, path)
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)


def atomic_write(path: str, text: str) -> None:
  """Writes ``text`` (UTF-8, '\\n' line ends) to ``path`` atomically."""
  with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
    f.write(text)


def atomic_write_json(path: str, obj, indent: int = 2, allow_nan: bool = True) -> None:
  """Writes ``obj`` as JSON (keys sorted) to ``path`` atomically; ``allow_nan=False``: strict
  JSON, a ValueError for a NaN or infinite float."""
  text = json.dumps(obj, indent=indent, sort_keys=True, allow_nan=allow_nan)
  atomic_write(path, text + "\n")
