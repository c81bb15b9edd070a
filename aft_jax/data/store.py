"""On-disk layout of a prepared corpus, written so that a crash never looks done.

    <data_dir>/prepared/<name>/
        train.npy, validation.npy, test.npy   uint32[n] token ids
        vocab.txt                             word vocabularies only
        summary.json                          {"vocab_size", "tokens", "source_fingerprint", ...}
        COMPLETE                              written last

Every file is written to a temporary name and renamed into place; `COMPLETE`
is created only after all of them, and removed before any rewrite, so a
directory without it is always rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable

import numpy as np

from aft_jax import files

MARKER = "COMPLETE"
# summary.json key (and TFDS metadata key) of the source files' fingerprint (sources.fingerprint).
FINGERPRINT_KEY = "source_fingerprint"
SUMMARY = "summary.json"


def prepared_dir(data_dir: str, name: str) -> str:
  return os.path.join(os.path.expanduser(data_dir), "prepared", name)


def is_complete(path: str) -> bool:
  return os.path.isfile(os.path.join(path, MARKER))


def start(path: str) -> None:
  """Clears `path` (incomplete or being rebuilt) and creates it empty."""
  marker = os.path.join(path, MARKER)
  if os.path.exists(marker):
    os.remove(marker)  # first, so a crash below cannot leave a stale "done"
  shutil.rmtree(path, ignore_errors=True)
  os.makedirs(path)


def write_tokens(path: str, split: str, chunks: Iterable[np.ndarray]) -> int:
  """Writes the concatenated chunks as `<split>.npy` (uint32[n]); returns n."""
  chunks = [np.asarray(c) for c in chunks]
  n = int(sum(c.size for c in chunks))
  with files.atomic_path(os.path.join(path, f"{split}.npy"), suffix=".npy") as tmp:
    # Fill a memory-mapped file chunk by chunk: the split is never held twice.
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint32, shape=(n,))
    pos = 0
    for c in chunks:
      out[pos : pos + c.size] = c.reshape(-1)
      pos += c.size
    out.flush()
    del out
  return n


def finish(path: str, summary: dict) -> None:
  """Writes summary.json, then the COMPLETE marker."""
  files.atomic_write_json(os.path.join(path, SUMMARY), summary, indent=1)
  files.atomic_write(os.path.join(path, MARKER), "ok\n")


def read_summary(path: str) -> dict:
  with open(os.path.join(path, SUMMARY)) as f:
    return json.load(f)


def load_tokens(path: str, split: str, expected: int | None = None) -> np.ndarray:
  """uint32[n] ids of a split, memory-mapped (WikiText-103 train is 400 MB)."""
  arr = np.load(os.path.join(path, f"{split}.npy"), mmap_mode="r")
  if arr.dtype != np.uint32 or arr.ndim != 1:
    raise ValueError(f"{path}/{split}.npy holds {arr.dtype}{list(arr.shape)}, expected uint32[n]")
  if expected is not None and arr.shape[0] != expected:
    raise ValueError(
      f"{path}/{split}.npy has {arr.shape[0]} tokens, summary.json says {expected}; "
      f"delete {path} and prepare again"
    )
  return arr
