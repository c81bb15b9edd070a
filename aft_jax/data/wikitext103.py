"""WikiText-103 (Merity et al., 2016) as a TFDS dataset of whole articles, in file order
(docs/data.md, "WikiText-103")."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator

import tensorflow_datasets as tfds

from aft_jax.data import sources

SPLITS = sources.SPLITS
# Split name in this library -> the word used in the official file names.
_FILE_SPLIT = {"train": "train", "validation": "valid", "test": "test"}


@dataclasses.dataclass(frozen=True)
class Archive(sources.Archive):
  """An official archive and where its split files are in it."""

  folder: str  # top folder inside the zip, e.g. 'wikitext-103'
  extension: str  # 'tokens' or 'raw'

  def split_file(self, split: str) -> str:
    return f"wiki.{_FILE_SPLIT[split]}.{self.extension}"


# The sha256 of the archives Salesforce research published (the same bytes on both mirrors).
_V1_SHA256 = "242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590"
_RAW_V1_SHA256 = "91c00ae287f0d699e18605c84afc9e45c192bc6b7797ff8837e5474655a33794"
ARCHIVES: dict[str, Archive] = {
  "v1": Archive("wikitext-103-v1.zip", _V1_SHA256, 190_229_076, "wikitext-103", "tokens"),
  "raw_v1": Archive(
    "wikitext-103-raw-v1.zip", _RAW_V1_SHA256, 191_984_949, "wikitext-103-raw", "raw"
  ),
}

# Tried in turn; the original S3 bucket is gone in some regions.
MIRRORS: list[str] = [
  "https://wikitext.smerity.com/{filename}",
  "https://s3.amazonaws.com/research.metamind.io/wikitext/{filename}",
]

# A top-level title ' = Title = ', not ' = = Section = = '.
_TITLE = re.compile(r" = [^=\n](?:[^\n]*[^=\n])? = \n?")


def is_title_line(line: str) -> bool:
  """True for a top-level article title line ` = Title = ` (newline optional)."""
  return _TITLE.fullmatch(line) is not None


def split_articles(lines: Iterator[str]) -> Iterator[str]:
  """Lines grouped into articles, each from a title line on (what precedes the first title is in
  the first): `''.join(output) == ''.join(lines)`."""
  buf, seen_title = [], False
  for line in lines:
    if is_title_line(line):
      if seen_title:
        yield "".join(buf)
        buf = []
      seen_title = True
    buf.append(line)
  if buf:
    yield "".join(buf)


def lines(source: sources.Source, split: str) -> Iterator[str]:
  """The split's lines (with '\\n'), decoded strictly as UTF-8 (DataErrors naming the file)."""
  file = source.files[SPLITS.index(split)]
  empty = True
  with source.open(file) as f:
    for lineno, raw in enumerate(f, start=1):
      empty = False
      try:
        yield raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise sources.BadSplitFileError(
          f"{source.name(file)} line {lineno} is not valid UTF-8 ({e.reason} at byte {e.start} "
          f"of the line: {raw[max(0, e.start - 10) : e.start + 10]!r}); the file is damaged."
        ) from None
  if empty:
    raise sources.BadSplitFileError(f"{source.name(file)} is empty.")


def locate_source(variant: str, *, manual_dir, download_dir, download=True, verify=True):
  """The data of `variant`: manual_dir's zip or extracted files, an earlier download, the mirrors;
  `verify=False` skips the sha256 of a zip found locally."""
  archive = ARCHIVES[variant]
  files = [archive.split_file(s) for s in SPLITS]
  source = lambda **where: sources.Source(  # noqa: E731
    archive.filename, files, prefix=f"{archive.folder}/", **where
  )

  def found():
    for i, folder in enumerate(d for d in (manual_dir, download_dir) if d):
      if os.path.isfile(zip_path := os.path.join(folder, archive.filename)):
        if verify:
          archive.verify(zip_path)
        yield source(zip_path=zip_path)
      if i == 0 and manual_dir:  # then the extracted files in manual_dir
        for extracted in (os.path.join(manual_dir, archive.folder), manual_dir):
          present = [f for f in files if os.path.isfile(os.path.join(extracted, f))]
          if len(present) == len(files):
            yield source(folder=extracted)
          if present:
            absent = [os.path.join(extracted, f) for f in files if f not in present]
            raise sources.MissingDataError(
              f"WikiText-103 split file(s) missing: {', '.join(absent)}."
            )

  where = manual_dir or "<manual_dir>"
  return sources.locate(
    found(),
    f"WikiText-103 ({variant}) not found. Put {archive.filename} (sha256 {archive.sha256}, "
    f"{archive.num_bytes:,} bytes, from {MIRRORS[0].format(filename=archive.filename)}) into "
    f"{where}, or extract it there so that {os.path.join(where, archive.folder, files[0])}, "
    f"{files[1]} and {files[2]} exist",
    archive,
    [template.format(filename=archive.filename) for template in MIRRORS],
    lambda p: source(zip_path=p),
    download_dir=download_dir,
    download=download,
  )


class Wikitext103(sources.SourceBuilder):
  """WikiText-103, one example per article, in file order."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "One example per article; texts concatenate to the official files."}
  BUILDER_CONFIGS = [
    tfds.core.BuilderConfig(
      name="v1", description="wikitext-103-v1: tokenised, rare words are <unk>."
    ),
    tfds.core.BuilderConfig(
      name="raw_v1", description="wikitext-103-raw-v1: the same text without <unk>."
    ),
  ]
  DEFAULT_CONFIG_NAME = "v1"
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
    "Put wikitext-103-v1.zip / wikitext-103-raw-v1.zip (or their extracted folders "
    "wikitext-103/ / wikitext-103-raw/) into manual_dir. Mirrors: " + ", ".join(MIRRORS)
  )
  FEATURES = {"text": tfds.features.Text()}
  HOMEPAGE = "https://blog.salesforceairesearch.com/the-wikitext-long-term-dependency-language-modeling-dataset/"
  CITATION = (
    "@inproceedings{merity2017pointer, title={Pointer Sentinel Mixture Models}, "
    "author={Merity, Stephen and Xiong, Caiming and Bradbury, James and Socher, Richard}, "
    "booktitle={ICLR}, year={2017}}"
  )

  @classmethod
  def locate(cls, config: str, **where) -> sources.Source:
    return locate_source(config, **where)

  def examples(self, source: sources.Source, split: str) -> Iterator[str]:
    return split_articles(lines(source, split))
