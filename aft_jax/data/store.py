"""The token store, `<data_dir>/prepared/<name>/`: its files, its lock and the checks of a
complete one (docs/data.md, "Where the data goes")."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from aft_jax import files

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
MARKER = "COMPLETE"
# Keys of summary.json (and TFDS metadata): the source's ``fingerprint``, the builder's version.
FINGERPRINT_KEY, VERSION_KEY = "source_fingerprint", "builder_version"
SUMMARY = "summary.json"
# What each version of each dataset's builder makes, the last entry being today's: a change to a
# builder's tokens adds a version (tests/data/test_builder_versions.py).
BUILDERS = {
  "pydoc": ("the whole pydoc text", "the pydoc text without its tables, rules and grammar"),
  "text": ("documents, each followed by the boundary",),
  "wikitext103": ("the release's articles",),
  "enwik8": ("the file's bytes, 90M / 5M / 5M",),
}


def version(dataset: str) -> int:
  """Today's version of the builder of ``dataset``."""
  return len(BUILDERS[dataset])


class DamagedCorpusError(ValueError):
  """A split file of a complete prepared corpus is not what summary.json says."""


def prepared_dir(data_dir: str, name: str) -> str:
  return os.path.join(os.path.expanduser(data_dir), "prepared", name)


@contextlib.contextmanager
def lock(path: str, what: str) -> Iterator[None]:
  """Holds the flock `<path>.lock` for the block, waiting for another holder; the file stays (a
  waiter would lock a removed one while a newcomer locks a new one)."""
  lock_file = f"{path}.lock"
  os.makedirs(os.path.dirname(lock_file), exist_ok=True)
  with open(lock_file, "a") as f:
    try:
      try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holds = f"Another process is preparing {what} (it holds {lock_file})"
        log.warning("%s; waiting for it to finish.", holds)
        fcntl.flock(f, fcntl.LOCK_EX)
    except OSError as e:  # e.g. a file system without locks: the bare error names no file
      raise OSError(e.errno, f"cannot lock {lock_file}: {e.strerror}") from e
    yield  # closing the file releases the lock


def is_complete(path: str) -> bool:
  return os.path.isfile(os.path.join(path, MARKER))


def start(path: str) -> None:
  """Clears `path` and creates it empty."""
  marker = os.path.join(path, MARKER)
  if os.path.exists(marker):
    os.remove(marker)  # first, so a crash below cannot leave a stale "done"
  shutil.rmtree(path, ignore_errors=True)
  os.makedirs(path)


def write_tokens(path: str, split: str, chunks: Iterable[np.ndarray]) -> int:
  """Writes the chunks as `<split>.npy` (uint32[n]); returns n. Plain writes (a memory map dies of
  SIGBUS on a full disk): a full disk is one `files.DiskFullError`, no temporary file left."""
  chunks = [np.asarray(c) for c in chunks]
  n = int(sum(c.size for c in chunks))
  file = os.path.join(path, f"{split}.npy")
  header = {"descr": np.lib.format.dtype_to_descr(np.dtype("<u4")), "fortran_order": False}
  need = 4 * n + 4096  # the ids and the header (at most a few hundred bytes)
  files.check_space(file, need)
  with files.atomic_path(file, suffix=".npy") as tmp:
    try:
      with open(tmp, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {**header, "shape": (n,)})
        for c in chunks:
          f.write(np.ascontiguousarray(c.reshape(-1), dtype="<u4").tobytes())
    except OSError as e:
      if e.errno == errno.ENOSPC:  # filled meanwhile (another writer)
        raise files.DiskFullError(file, need) from None
      raise
  return n


def finish(path: str, summary: dict) -> None:
  """Writes summary.json, then the COMPLETE marker."""
  files.atomic_write_json(os.path.join(path, SUMMARY), summary, indent=1)
  files.atomic_write(os.path.join(path, MARKER), "ok\n")


def read_summary(path: str) -> dict:
  with open(os.path.join(path, SUMMARY)) as f:
    return json.load(f)


def load_tokens(path: str, split: str, expected: int | None = None) -> np.ndarray:
  """A split's uint32[n] ids, memory-mapped; a DamagedCorpusError naming the file unless whole."""
  file = os.path.join(path, f"{split}.npy")
  again = f"delete {path} and prepare again (a rerun of prepare rebuilds it)"
  try:
    ids = np.load(file, mmap_mode="r")
  except FileNotFoundError:
    raise DamagedCorpusError(f"{file} is missing; {again}") from None
  except (ValueError, OSError, EOFError, SyntaxError) as e:  # cut in the header or the ids
    raise DamagedCorpusError(f"{file} is truncated or not a .npy file ({e}); {again}") from None
  if ids.dtype != np.uint32 or ids.ndim != 1:
    raise DamagedCorpusError(f"{file} holds {ids.dtype}{list(ids.shape)}, not uint32[n]; {again}")
  if expected is not None and ids.shape[0] != expected:
    raise DamagedCorpusError(
      f"{file} has {ids.shape[0]} tokens, summary.json says {expected}; {again}"
    )
  if ids.offset + ids.nbytes != os.path.getsize(file):
    raise DamagedCorpusError(f"{file} is longer than prepare wrote it; {again}")
  return ids


_END_BYTES = 1 << 20
_FINGERPRINT = "size+ends-sha256:"


def fingerprint(paths: Sequence[str]) -> str:
  """sha256 over each file's name, size, first and last MiB: cheap enough for every start."""
  h = hashlib.sha256()
  for path in paths:
    size = os.path.getsize(path)
    h.update(f"{os.path.basename(path)}\0{size}\0".encode())
    with open(path, "rb") as f:
      h.update(f.read(_END_BYTES))
      if size > _END_BYTES:
        f.seek(max(_END_BYTES, size - _END_BYTES))
        h.update(f.read())
  return _FINGERPRINT + h.hexdigest()


def file_digest(path: str) -> str:
  """One file's fingerprint (the same rule), shortened to 16 hex digits."""
  return fingerprint([path]).removeprefix(_FINGERPRINT)[:16]


def _stale(out: str, summary: dict, dataset: str, fingerprint_now, needs) -> str | None:
  """Why the complete corpus ``out`` cannot be reused; None: it can."""
  if summary.get(VERSION_KEY, 1) != version(dataset):
    return f"{out} was prepared by another version of its builder"
  if needs and needs not in summary:  # (a corpus prepared before the key existed)
    return f"{out} has no {needs}"
  try:
    for split, n in summary["tokens"].items():
      load_tokens(out, split, n)
  except DamagedCorpusError as e:
    return str(e)
  now, was = fingerprint_now(), summary.get(FINGERPRINT_KEY)
  if now is not None and now != was:  # (None: no source now, the corpus is all there is)
    return (
      f"{out} was prepared from other source files than the ones found now (fingerprint {was}, "
      f"now {now})"
    )
  return None


def prepare(out: str, what: str, dataset: str, fingerprint_now, write, needs=None) -> dict:
  """Under ``out``'s lock, the summary of the corpus there unless incomplete or ``_stale``; else of
  the one ``write()`` writes there (from ``start(out)`` on), then marked complete."""
  with lock(out, what):
    if is_complete(out):
      summary = read_summary(out)
      why = _stale(out, summary, dataset, fingerprint_now, needs)
      if why is None:
        log.info("Reusing %s", out)
        return summary
      log.warning("%s; preparing it again.", why)
    summary = {**write(), VERSION_KEY: version(dataset)}
    finish(out, summary)
    log.info("Prepared %s: %s", out, summary["tokens"])
    return summary
