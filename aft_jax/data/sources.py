"""What the dataset builders share: a ``Source`` (zip members or extracted files), errors
(``DataError``, a ValueError, one line naming the file), checksums, downloads, and builds that are
made again when their source files change (``build``; docs/data.md, "Where the data goes")."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import shutil
import sys
import urllib.request
import zipfile
import zlib

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.core.constants import INCOMPLETE_PREFIX

from aft_jax.data import store

log = logging.getLogger(__name__)

SPLITS = store.SPLITS
# Errors zipfile raises on a truncated or damaged archive.
ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError)


class DataError(ValueError):
  """Source data is missing, corrupt or not what it should be."""


class ChecksumError(DataError):
  """An archive does not hash to its recorded sha256."""


class CorruptArchiveError(DataError):
  """A zip file cannot be read (truncated, damaged)."""


class MissingDataError(DataError):
  """A file the dataset needs is nowhere to be found."""


class BadSplitFileError(DataError):
  """A source file is empty, too short or not in the expected encoding."""


def sha256_of(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


@dataclasses.dataclass(frozen=True)
class Archive:
  """An official zip: its name, what it must hash to and its published size."""

  filename: str
  sha256: str
  num_bytes: int  # for messages and progress bars

  def verify(self, path: str) -> None:
    """Raises ChecksumError unless `path` hashes to the official sha256."""
    got = sha256_of(path)
    if got != self.sha256:
      raise ChecksumError(
        f"{path}: sha256 {got} ({os.path.getsize(path):,} bytes) does not match the official "
        f"{self.filename} (sha256 {self.sha256}, {self.num_bytes:,} bytes). The file is "
        "truncated, damaged or a different archive: delete it and download it again."
      )


def locate(found, message: str, archive: Archive, urls, open_zip, *, download_dir, download):
  """The first local source ``found`` yields; else the first of ``urls`` downloaded to
  ``<download_dir>/<archive>`` whose sha256 and zip (``open_zip(path) -> Source``) check; else a
  MissingDataError: ``message``, then what the downloads tried."""
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  for source in found:
    return source
  errors = []
  for url in urls if download_dir and download else ():
    os.makedirs(download_dir, exist_ok=True)
    dest = os.path.join(download_dir, archive.filename)
    tmp = f"{dest}.part-{os.getpid()}"
    try:
      with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
        total = int(r.headers.get("Content-Length") or 0) or archive.num_bytes
        with tqdm(total=total, unit="B", unit_scale=True, desc=archive.filename) as bar:
          for chunk in iter(lambda: r.read(1 << 20), b""):
            f.write(chunk)
            bar.update(len(chunk))
      archive.verify(tmp)
      open_zip(tmp)
      os.replace(tmp, dest)  # only a verified archive ever gets the real name
    except (OSError, ValueError) as e:  # URLError is an OSError
      errors.append(f"{url}: {e}")
      log.warning("Download of %s failed: %s", url, e)
    else:
      return open_zip(dest)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  message += " (manual_dir is set with --manual_dir or cfg.manual_dir)."
  if errors:
    message += "\nDownload attempts:\n  " + "\n  ".join(errors)
  elif not download:
    message += "\nDownloading was disabled."
  raise MissingDataError(message)


class SourceBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A builder of local files that records their fingerprint; a subclass sets FEATURES (one),
  HOMEPAGE and CITATION, and implements `locate` and `examples` (a split's values, in order)."""

  # TFDS derives this through `importlib_resources`, which it does not declare.
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(sys.modules[cls.__module__].__file__)

  def __init__(self, *, download: bool = True, **kwargs):
    self._allow_download = download
    super().__init__(file_format="array_record", **kwargs)

  @classmethod
  @abc.abstractmethod
  def locate(cls, config: str, *, manual_dir, download_dir, download: bool, verify=True) -> Source:
    """The source of `config`; `verify=False` skips full-file checksums."""

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=self.__doc__,
      features=tfds.features.FeaturesDict(self.FEATURES),
      homepage=self.HOMEPAGE,
      citation=self.CITATION,
      metadata=tfds.core.MetadataDict(),
      disable_shuffling=True,
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    try:
      manual_dir = os.fspath(dl_manager.manual_dir)
    except AssertionError:
      # Not given, missing or empty; a given path stays for the error message.
      given = getattr(dl_manager, "_manual_dir", None)
      manual_dir = os.fspath(given) if given else None
    source = self.locate(
      self.builder_config.name,
      manual_dir=manual_dir,
      download_dir=os.fspath(dl_manager.download_dir),
      download=self._allow_download,
    )
    self.info.metadata[store.FINGERPRINT_KEY] = store.fingerprint(source.paths())
    return {split: self._generate_examples(source, split) for split in SPLITS}

  def _generate_examples(self, source: Source, split: str):
    (feature,) = self.FEATURES
    for i, value in enumerate(self.examples(source, split)):
      yield i, {feature: value}


def current_fingerprint(cls, config: str, manual_dir: str | None, download_dir: str) -> str | None:
  """Fingerprint of the source `cls.locate` finds now (no download, no checksum); None: none."""
  manual_dir = manual_dir or os.path.join(download_dir, "manual")  # TFDS's default
  try:
    source = cls.locate(
      config, manual_dir=manual_dir, download_dir=download_dir, download=False, verify=False
    )
  except MissingDataError:
    return None
  return store.fingerprint(source.paths())


def build(cls: type[SourceBuilder], config: str, *, data_dir: str, manual_dir=None, download=True):
  """Builds (or reuses, unless from other source files than the ones found now) `cls`'s dataset
  under `data_dir`, under its lock, after removing killed builds' `incomplete.*_<version>/`."""
  download_dir = os.path.join(data_dir, "downloads")
  data_path = os.path.join(data_dir, cls.name, config, str(cls.VERSION))
  parent, version = os.path.split(data_path)
  stale = re.compile(re.escape(INCOMPLETE_PREFIX) + r"[A-Za-z0-9]+_" + re.escape(version))
  with store.lock(data_path, f"the TFDS build {data_path}"):
    for name in sorted(filter(stale.fullmatch, os.listdir(parent))):
      log.warning("Removing %s, left by a build that did not finish.", os.path.join(parent, name))
      shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    # Made under the lock: a builder made before it would not see a build finished meanwhile.
    builder = cls(config=config, data_dir=data_dir, download=download)
    if builder.is_prepared():
      recorded = (builder.info.metadata or {}).get(store.FINGERPRINT_KEY)
      current = current_fingerprint(cls, config, manual_dir, download_dir)
      if current is not None and current != recorded:
        what = f"{data_path} was built from other source files than the ones found now"
        log.warning("%s (fingerprint %s, now %s); building it again.", what, recorded, current)
        shutil.rmtree(data_path)
        builder = cls(config=config, data_dir=data_dir, download=download)
    # try_download_gcs: never look for a prebuilt copy on GCS
    dl_config = tfds.download.DownloadConfig(manual_dir=manual_dir or None, try_download_gcs=False)
    builder.download_and_prepare(download_dir=download_dir, download_config=dl_config)
  assert os.path.abspath(builder.data_path) == os.path.abspath(data_path), builder.data_path
  return builder


class Source:
  """A dataset's files: members `<prefix><file>` of the zip `zip_path`, or `<folder>/<file>`."""

  def __init__(self, zip_name: str, files, *, zip_path=None, folder=None, prefix=""):
    assert (zip_path is None) != (folder is None)
    self.zip_name, self.files, self.zip_path, self.folder = zip_name, files, zip_path, folder
    self.prefix = prefix
    if zip_path is not None:
      try:
        with zipfile.ZipFile(zip_path) as zf:
          names = set(zf.namelist())
      except (*ZIP_ERRORS, OSError) as e:
        raise CorruptArchiveError(
          f"{zip_path} is not a readable zip file ({e}); it is probably truncated: "
          f"delete it and fetch {zip_name} again."
        ) from e
      lacks = [prefix + f for f in files if prefix + f not in names]
      if lacks:
        raise MissingDataError(f"{zip_path} lacks {', '.join(lacks)}; it is not {zip_name}.")

  def name(self, file: str) -> str:
    if self.zip_path is None:
      return os.path.join(self.folder, file)
    return f"{self.zip_path}:{self.prefix}{file}"

  def paths(self) -> list[str]:
    """The files this source reads (for its fingerprint)."""
    return [self.zip_path] if self.zip_path else [self.name(f) for f in self.files]

  def size(self, file: str) -> int:
    if self.zip_path is None:
      return os.path.getsize(self.name(file))
    with zipfile.ZipFile(self.zip_path) as zf:
      return zf.getinfo(self.prefix + file).file_size

  @contextlib.contextmanager
  def open(self, file: str):
    """The file, binary; a damaged zip is a CorruptArchiveError naming it."""
    try:
      if self.zip_path is None:
        with open(self.name(file), "rb") as f:
          yield f
      else:
        with zipfile.ZipFile(self.zip_path) as zf, zf.open(self.prefix + file) as f:
          yield f
    except ZIP_ERRORS as e:
      raise CorruptArchiveError(
        f"{self.name(file)} cannot be decompressed ({e}); the zip is damaged: delete it and "
        f"fetch {self.zip_name} again."
      ) from e
