"""enwik8 (the first 10^8 bytes of an English Wikipedia dump) as a TFDS dataset of byte chunks
in the standard 90/5/5 split (docs/data.md, "enwik8")."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds

from aft_jax.data import sources

SPLITS = sources.SPLITS
FILENAME = "enwik8"
NUM_BYTES = 100_000_000
ZIP = sources.Archive(
  "enwik8.zip", "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc", 36_445_475
)
# Tried in turn (Matt Mahoney's page, then a copy public training scripts fetch), then checked.
MIRRORS: list[str] = [
  "http://mattmahoney.net/dc/enwik8.zip",
  "https://data.deepai.org/enwik8.zip",
]
CHUNK_BYTES = 1 << 20
HELD_OUT_FRACTION = 20  # validation and test are each N // 20 bytes


def split_ranges(num_bytes: int) -> dict[str, tuple[int, int]]:
  """[start, stop) byte offsets of each split in a file of `num_bytes` bytes."""
  held = num_bytes // HELD_OUT_FRACTION
  train, valid = num_bytes - 2 * held, num_bytes - held
  return {"train": (0, train), "validation": (train, valid), "test": (valid, num_bytes)}


def open_source(*, zip_path: str | None = None, path: str | None = None) -> sources.Source:
  """The enwik8 file in its zip or unzipped; a BadSplitFileError when it is too short to split."""
  if zip_path is None:
    folder, name = os.path.split(path)
    source = sources.Source(ZIP.filename, [name], folder=folder)
  else:
    source = sources.Source(ZIP.filename, [FILENAME], zip_path=zip_path)
  size = source.size(source.files[0])
  if size < HELD_OUT_FRACTION:
    what = "is empty" if size == 0 else f"has only {size} bytes"
    raise sources.BadSplitFileError(
      f"{source.name(source.files[0])} {what}; it needs at least {HELD_OUT_FRACTION} bytes to "
      f"give every split one byte: put the real {FILENAME} ({NUM_BYTES:,} bytes) there."
    )
  return source


def chunks(source: sources.Source, split: str) -> Iterator[bytes]:
  """The split's bytes in chunks of at most CHUNK_BYTES (DataErrors naming the file)."""
  file = source.files[0]
  name, size = source.name(file), source.size(file)
  start, stop = split_ranges(size)[split]
  with source.open(file) as f:
    f.seek(start)  # a zip member seeks forward by decompressing (and CRC-checking) bytes
    pos = start
    while pos < stop:
      chunk = f.read(min(CHUNK_BYTES, stop - pos))
      if not chunk:
        raise sources.BadSplitFileError(
          f"{name} ended at byte {pos:,} instead of {size:,}; it changed while being read: "
          "prepare again."
        )
      pos += len(chunk)
      yield chunk
    if stop == size and f.read(1):  # reading to the end also checks a zip's CRC
      raise sources.BadSplitFileError(
        f"{name} is longer than {size:,} bytes; it changed while being read."
      )


def locate_source(*, manual_dir, download_dir, download=True, verify=True) -> sources.Source:
  """enwik8: manual_dir's zip or file, an earlier download, the mirrors; `verify=False` skips the
  sha256 of a zip found locally."""

  def found():
    for kind, folder, name in (
      ("zip_path", manual_dir, ZIP.filename),
      ("path", manual_dir, FILENAME),
      ("zip_path", download_dir, ZIP.filename),
    ):
      if folder and os.path.isfile(path := os.path.join(folder, name)):
        source = open_source(**{kind: path})
        # A custom size has no sha256 to check.
        if verify and kind == "zip_path" and source.size(FILENAME) == NUM_BYTES:
          ZIP.verify(path)
        yield source

  where = manual_dir or "<manual_dir>"
  return sources.locate(
    found(),
    f"enwik8 not found. Put {ZIP.filename} (sha256 {ZIP.sha256}, {ZIP.num_bytes:,} bytes, from "
    f"{MIRRORS[0]}) or the unzipped {os.path.join(where, FILENAME)} ({NUM_BYTES:,} bytes) into "
    f"{where}",
    ZIP,
    MIRRORS,
    lambda p: open_source(zip_path=p),
    download_dir=download_dir,
    download=download,
  )


class Enwik8(sources.SourceBuilder):
  """enwik8 bytes in the standard 90/5/5 split, as chunks in file order."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Chunks of at most 1 MiB; a split's chunks concatenate to its bytes."}
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="bytes", description="The raw bytes.")]
  DEFAULT_CONFIG_NAME = "bytes"
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
    f"Put {ZIP.filename} (or the unzipped {FILENAME}) into manual_dir. Mirrors: "
    + ", ".join(MIRRORS)
  )
  FEATURES = {"bytes": tfds.features.Tensor(shape=(), dtype=np.object_)}
  HOMEPAGE = "http://mattmahoney.net/dc/textdata.html"
  CITATION = (
    "@misc{hutter2006prize, title={The Human Knowledge Compression Prize}, "
    "author={Hutter, Marcus}, year={2006}, url={http://prize.hutter1.net}}"
  )

  @classmethod
  def locate(cls, config: str, **where) -> sources.Source:
    return locate_source(**where)

  def examples(self, source: sources.Source, split: str) -> Iterator[bytes]:
    return chunks(source, split)
