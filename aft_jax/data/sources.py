"""What the dataset builders share: errors (``DataError``, a ValueError, one line naming the
file), checksums, downloads, and builds that are made again when their source files change
(``build``; docs/data.md, "Where the data goes")."""

from __future__ import annotations

import abc
import hashlib
import logging
import os
import re
import shutil
import sys
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Sequence

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.core.constants import INCOMPLETE_PREFIX

from aft_jax.data import store

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
FINGERPRINT_KEY = store.FINGERPRINT_KEY
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
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def verify_sha256(path: str, *, expected: str, name: str, num_bytes: int) -> None:
  """Raises ChecksumError unless `path` hashes to `expected`."""
  got = sha256_of(path)
  if got != expected:
    raise ChecksumError(
      f"{path}: sha256 {got} ({os.path.getsize(path):,} bytes) does not match the official "
      f"{name} (sha256 {expected}, {num_bytes:,} bytes). The file is truncated, damaged or a "
      "different archive: delete it and download it again."
    )


# The source fingerprint (name, size, first and last MiB of each file): the store's rule.
fingerprint = store.fingerprint


def download(
  filename: str,
  urls: Sequence[str],
  download_dir: str,
  *,
  num_bytes: int,
  verify: Callable[[str], None],
) -> tuple[str | None, list[str]]:
  """Tries each URL in turn; returns (path of a verified download or None, what went wrong).
  A download gets its name `<download_dir>/<filename>` only after `verify(path)` passes."""
  os.makedirs(download_dir, exist_ok=True)
  dest = os.path.join(download_dir, filename)
  errors = []
  for url in urls:
    tmp = f"{dest}.part-{os.getpid()}"
    try:
      _fetch(url, tmp, num_bytes)
      verify(tmp)
      os.replace(tmp, dest)  # only a verified archive ever gets the real name
      return dest, errors
    except (OSError, ValueError) as e:  # URLError is an OSError
      errors.append(f"{url}: {e}")
      log.warning("Download of %s failed: %s", url, e)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  return None, errors


def _fetch(url: str, path: str, expected_bytes: int) -> None:
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  with urllib.request.urlopen(url, timeout=60) as r, open(path, "wb") as f:
    total = int(r.headers.get("Content-Length") or 0) or expected_bytes
    with tqdm(total=total, unit="B", unit_scale=True, desc=os.path.basename(path)) as bar:
      for chunk in iter(lambda: r.read(1 << 20), b""):
        f.write(chunk)
        bar.update(len(chunk))


def download_attempts(errors: list[str], download: bool) -> str:
  """The tail of a MissingDataError message: what the downloads tried, or that none was made."""
  if errors:
    return "\nDownload attempts:\n  " + "\n  ".join(errors)
  return "" if download else "\nDownloading was disabled."


class SourceBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A builder that reads local source files and records their fingerprint in its metadata;
  subclasses implement `locate()`, `_generate_examples(source, split)` and `_info()`."""

  # TFDS derives this through `importlib_resources`, which it does not declare.
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(sys.modules[cls.__module__].__file__)

  def __init__(self, *, download: bool = True, **kwargs):
    self._allow_download = download
    super().__init__(file_format="array_record", **kwargs)

  @abc.abstractmethod
  def locate(self, *, manual_dir, download_dir, download: bool, verify=True):
    """The source of this builder's config; `verify=False` skips full-file checksums."""

  def dataset_info(self, **kwargs) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self, metadata=tfds.core.MetadataDict(), disable_shuffling=True, **kwargs
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    try:
      manual_dir = os.fspath(dl_manager.manual_dir)
    except AssertionError:
      # Not given, missing or empty; keep a given path for the error message.
      given = getattr(dl_manager, "_manual_dir", None)
      manual_dir = os.fspath(given) if given else None
    source = self.locate(
      manual_dir=manual_dir,
      download_dir=os.fspath(dl_manager.download_dir),
      download=self._allow_download,
    )
    self.info.metadata[FINGERPRINT_KEY] = fingerprint(source.paths())
    return {split: self._generate_examples(source, split) for split in SPLITS}


def current_fingerprint(
  locate: Callable[..., object], manual_dir: str | None, download_dir: str
) -> str | None:
  """Fingerprint of the source `locate` finds now, without downloading or a full checksum; None
  when there is none (it may be deleted once a dataset is built)."""
  manual_dir = manual_dir or os.path.join(download_dir, "manual")  # TFDS's default
  try:
    source = locate(manual_dir=manual_dir, download_dir=download_dir, download=False, verify=False)
  except MissingDataError:
    return None
  return fingerprint(source.paths())


def build(cls: type[SourceBuilder], config: str, *, data_dir: str, manual_dir=None, download=True):
  """Builds (or reuses) `cls`'s dataset under `data_dir`; returns the builder. A build from
  other source files than the ones found now is built again. One build at a time (under the lock
  `<data_dir>/<name>/<config>/<version>.lock`), after removing killed builds' folders."""
  download_dir = os.path.join(data_dir, "downloads")
  data_path = os.path.join(data_dir, cls.name, config, str(cls.VERSION))
  with store.lock(data_path, f"the TFDS build {data_path}"):
    remove_stale_builds(data_path)
    # Made under the lock: a builder made before it would not see a build finished meanwhile.
    builder = _build_locked(cls, config, data_dir, manual_dir, download, download_dir)
  assert os.path.abspath(builder.data_path) == os.path.abspath(data_path), builder.data_path
  return builder


def remove_stale_builds(data_path: str) -> None:
  """Deletes the `incomplete.<random>_<version>/` folders TFDS's killed builds of `data_path` left
  beside it (under `data_path`'s lock: then none is live)."""
  parent, version = os.path.split(data_path)
  stale = re.compile(re.escape(INCOMPLETE_PREFIX) + r"[A-Za-z0-9]+_" + re.escape(version))
  names = os.listdir(parent) if os.path.isdir(parent) else []
  for name in sorted(n for n in names if stale.fullmatch(n)):
    log.warning("Removing %s, left by a build that did not finish.", os.path.join(parent, name))
    shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _build_locked(cls, config, data_dir, manual_dir, download, download_dir) -> SourceBuilder:
  builder = cls(config=config, data_dir=data_dir, download=download)
  if builder.is_prepared():
    recorded = builder.info.metadata.get(FINGERPRINT_KEY) if builder.info.metadata else None
    current = current_fingerprint(builder.locate, manual_dir, download_dir)
    if current is not None and current != recorded:
      what = f"{builder.data_path} was built from other source files than the ones found now"
      log.warning("%s (fingerprint %s, now %s); building it again.", what, recorded, current)
      shutil.rmtree(os.fspath(builder.data_path))
      builder = cls(config=config, data_dir=data_dir, download=download)
  builder.download_and_prepare(
    download_dir=download_dir,
    # try_download_gcs: never look for a prebuilt copy on GCS
    download_config=tfds.download.DownloadConfig(
      manual_dir=manual_dir or None, try_download_gcs=False
    ),
  )
  return builder


def zip_members(path: str, filename: str) -> set[str]:
  try:
    with zipfile.ZipFile(path) as zf:
      return set(zf.namelist())
  except (*ZIP_ERRORS, OSError) as e:
    raise CorruptArchiveError(
      f"{path} is not a readable zip file ({e}); it is probably truncated: "
      f"delete it and fetch {filename} again."
    ) from e
