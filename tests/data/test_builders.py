"""The WikiText-103 and enwik8 TFDS builders on fake files: bytes, checksums, mirrors, damage."""

import dataclasses
import os
import zipfile

import pytest

from aft_jax.data import enwik8, prepare, sources, store
from aft_jax.data import wikitext103 as wt
from tests.support import fake_enwik8 as fe
from tests.support import fake_wikitext as fw

pytestmark = pytest.mark.usefixtures("offline")
SPLITS = sources.SPLITS
N = 5_003  # fake enwik8 size: not a multiple of 20, so N // 20 rounds down


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
  monkeypatch.setattr(enwik8, "CHUNK_BYTES", 1_000)  # several examples per split


def _build(tmp_path, variant, manual_dir, download=False):
  cls, config = (enwik8.Enwik8, "bytes") if variant == "enwik8" else (wt.Wikitext103, variant)
  manual_dir = manual_dir and str(manual_dir)
  data_dir = str(tmp_path / "data" / "tfds")
  return sources.build(cls, config, data_dir=data_dir, manual_dir=manual_dir, download=download)


def _records(builder, split):
  ds = builder.as_data_source(split)
  return [ds[i].get("text", ds[i].get("bytes")) for i in range(len(ds))]


def _text(builder, split):
  return b"".join(_records(builder, split)).decode("utf-8")


TITLES = [" = Valkyria Chronicles III = \n", " = Naïve art = \n", " = A = \n", " = x = y = \n"]
NOT_TITLES = [" = = Gameplay = = \n", " = = = C = = = \n", " = Title =\n", "= Title = \n", " \n"]


@pytest.mark.parametrize("line", TITLES + NOT_TITLES + [" The score was 2 = 3 . \n"])
def test_title_lines(line):
  assert wt.is_title_line(line) is (line in TITLES)


@pytest.mark.parametrize("variant, form", [("v1", "zip"), ("raw_v1", "extracted")])
def test_wikitext_build_one_example_per_article(tmp_path, monkeypatch, variant, form):
  manual, raw = tmp_path / "manual", variant == "raw_v1"
  if form == "zip":
    fw.trust(monkeypatch, variant, fw.write_zip(str(manual), variant))
  else:
    fw.write_extracted(str(manual), variant)
  builder = _build(tmp_path, variant, manual)
  assert builder.info.disable_shuffling
  for split in SPLITS:
    arts = [t.decode("utf-8") for t in _records(builder, split)]
    assert "".join(arts) == fw.split_text(split, raw=raw)  # in order
    titles = fw.titles(split, raw=raw)
    assert arts[0].split("\n")[:2] == [" ", f" = {titles[0]} = "]  # the leading blank line too
    assert [art.split("\n")[0] for art in arts[1:]] == [f" = {t} = " for t in titles[1:]]
    assert ("<unk>" in arts[-1] + arts[0]) == (variant == "v1")
  assert "東京" in _text(builder, "train")
  assert " = = = Construction = = = " in _records(builder, "train")[1].decode()  # sections stay


@pytest.mark.parametrize("n", [20, 39, 40, 5_003, 100_000_000])
def test_enwik8_standard_split_sizes(n):
  ranges = enwik8.split_ranges(n)
  sizes = {s: stop - start for s, (start, stop) in ranges.items()}
  assert sizes["validation"] == sizes["test"] == n // 20 and sum(sizes.values()) == n
  assert [ranges[s][0] for s in SPLITS] == [0, ranges["train"][1], ranges["validation"][1]]
  if n == 100_000_000:  # the real file: computed, not built
    assert sizes == {"train": 90_000_000, "validation": 5_000_000, "test": 5_000_000}


@pytest.mark.parametrize("form", ["zip", "file"])
def test_enwik8_build_keeps_every_byte_in_order(tmp_path, form):
  """From the zip, reading the test split reaches the end of the member: its CRC is checked."""
  data = fe.content(N)
  path = (fe.write_zip if form == "zip" else fe.write_file)(str(tmp_path / "manual"), data)
  assert enwik8.open_source(**{"zip_path" if form == "zip" else "path": path}).size("enwik8") == N
  builder = _build(tmp_path, "enwik8", tmp_path / "manual")
  assert builder.info.disable_shuffling
  chunks = {split: _records(builder, split) for split in SPLITS}
  assert all(0 < len(c) <= 1_000 for split in SPLITS for c in chunks[split])
  got = {s: b"".join(c) for s, c in chunks.items()}
  assert {s: len(b) for s, b in got.items()} == {"train": 4_503, "validation": 250, "test": 250}
  assert got["train"] + got["validation"] + got["test"] == data
  assert builder.info.metadata[store.FINGERPRINT_KEY] == store.fingerprint([path])


def _damage(variant, case, manual, monkeypatch):
  """Writes the source of ``variant`` (``DAMAGED``) damaged as ``case`` says."""
  if case == "missing":
    manual.mkdir()
  elif variant == "enwik8" and case == "checksum":  # checked where the zip holds the real size
    fe.write_zip(str(manual), fe.content(N))
    monkeypatch.setattr(enwik8, "NUM_BYTES", N)
  elif case == "truncated_zip":
    path = fe.write_zip(str(manual), fe.content(N))
    os.truncate(path, os.path.getsize(path) // 2)
  elif case == "bad_crc":  # stored, one byte of the text changed after its CRC was
    manual.mkdir()
    with zipfile.ZipFile(manual / "enwik8.zip", "w") as zf:
      zf.writestr("enwik8", fe.content(N))
    data = (manual / "enwik8.zip").read_bytes()
    (manual / "enwik8.zip").write_bytes(data.replace(b"Construction", b"Bonstruction", 1))
  elif variant == "enwik8":
    fe.write_file(str(manual), fe.content(11))
  elif case == "checksum":
    fw.write_zip(str(manual), "v1")
    monkeypatch.setitem(wt.ARCHIVES, "v1", dataclasses.replace(wt.ARCHIVES["v1"], sha256="0" * 64))
  elif case == "zip_missing_split":
    fw.trust(monkeypatch, "v1", fw.write_zip(str(manual), "v1", skip=("validation",)))
  elif case == "dir_missing_split":
    fw.write_extracted(str(manual), "v1", skip=("test",))
  else:  # an empty file, or one that is not UTF-8
    bad = b"" if case == "empty_file" else " \n = H = \n caf\xe9 \n".encode("latin-1")
    fw.write_extracted(str(manual), "v1", {"validation": bad})


# (builder, case) -> (error, message): each way a source can be damaged, once per code path.
DAMAGED = {
  ("v1", "checksum"): (sources.ChecksumError, "sha256"),
  ("v1", "zip_missing_split"): (sources.MissingDataError, "lacks wikitext-103/wiki.valid.tokens"),
  ("v1", "dir_missing_split"): (sources.MissingDataError, "wiki.test.tokens"),
  ("v1", "empty_file"): (sources.BadSplitFileError, "wiki.valid.tokens is empty"),
  ("v1", "not_utf8"): (sources.BadSplitFileError, "line 3 is not valid UTF-8"),
  ("raw_v1", "missing"): (sources.MissingDataError, r"raw-v1\.zip .*-raw/wiki\.train\.raw"),
  ("enwik8", "checksum"): (sources.ChecksumError, "does not match the official enwik8.zip"),
  ("enwik8", "truncated_zip"): (sources.CorruptArchiveError, "enwik8.zip is not a readable zip"),
  ("enwik8", "bad_crc"): (sources.CorruptArchiveError, "cannot be decompressed"),
  ("enwik8", "too_short"): (sources.BadSplitFileError, "has only 11 bytes"),
  ("enwik8", "missing"): (sources.MissingDataError, r"enwik8\.zip .*manual/enwik8 \("),
}


@pytest.mark.parametrize("variant, case", sorted(DAMAGED))
def test_damaged_source_is_one_error_and_nothing_is_prepared(tmp_path, monkeypatch, variant, case):
  manual = tmp_path / "manual"
  _damage(variant, case, manual, monkeypatch)
  error, message = DAMAGED[variant, case]
  dataset = ["enwik8"] if variant == "enwik8" else ["wikitext103", "--variant", variant]
  flags = ["--manual_dir", str(manual), "--data_dir", str(tmp_path / "data"), "--nodownload"]
  with pytest.raises(error, match=message) as info:
    prepare.main(["--dataset", *dataset, *flags, "--quiet"])
  msg = str(info.value)
  assert isinstance(info.value, ValueError) and str(manual) in msg
  assert "\n" not in msg or case == "missing"  # the missing case lists what it tried
  config, name = ("bytes", "enwik8") if variant == "enwik8" else (variant, "wikitext103")
  assert not (tmp_path / "data" / "tfds" / name / config / "1.0.0").exists()
  assert not list((tmp_path / "data").rglob("*incomplete*"))
  assert not list((tmp_path / "data").rglob(store.MARKER))  # nothing prepared
  if case == "missing":
    assert "Downloading was disabled" in msg and "--manual_dir" in msg


def test_without_manual_dir_tfds_default_is_looked_in(tmp_path):
  with pytest.raises(sources.MissingDataError, match="downloads/manual"):  # TFDS's default
    _build(tmp_path, "v1", None)
  assert not (tmp_path / "data" / "tfds" / "wikitext103" / "v1" / "1.0.0").exists()


@pytest.mark.parametrize("variant", ["v1", "enwik8"])
def test_download_tries_mirrors_in_turn_and_checks_the_sha256(tmp_path, monkeypatch, variant):
  """Mirrors are file:// URLs: a missing one, a corrupt one, then a good one."""
  if variant == "enwik8":
    good = fe.write_zip(str(tmp_path / "good"), fe.content(N))
    bad = fe.write_zip(str(tmp_path / "bad"), fe.content(N - 1))
    zip_ = dataclasses.replace(enwik8.ZIP, sha256=sources.sha256_of(good))
    monkeypatch.setattr(enwik8, "ZIP", zip_)
    urls = [f"file://{p}" for p in (tmp_path / "nowhere.zip", bad, good)]
    monkeypatch.setattr(enwik8, "MIRRORS", urls)
  else:
    good = fw.write_zip(str(tmp_path / "good"), "v1")
    bad = fw.write_zip(str(tmp_path / "bad"), "v1", {"test": " = X = \n tampered \n"})
    fw.trust(monkeypatch, "v1", good)
    folders = (tmp_path / "nowhere", *map(os.path.dirname, (bad, good)))
    monkeypatch.setattr(wt, "MIRRORS", [f"file://{d}/{{filename}}" for d in folders])
  builder = _build(tmp_path, variant, None, download=True)
  want = fe.content(N)[-250:] if variant == "enwik8" else fw.split_text("test", raw=False).encode()
  assert b"".join(_records(builder, "test")) == want
  downloads = tmp_path / "data" / "tfds" / "downloads"
  assert [p.name for p in downloads.iterdir() if p.is_file()] == [os.path.basename(good)]
  assert sources.sha256_of(str(downloads / os.path.basename(good))) == sources.sha256_of(good)
  if variant == "v1":  # all mirrors failing: the error lists each attempt
    monkeypatch.setattr(wt, "MIRRORS", [f"file://{os.path.dirname(bad)}/{{filename}}"])
    with pytest.raises(sources.MissingDataError, match="sha256") as info:
      wt.locate_source("v1", manual_dir=None, download_dir=str(tmp_path / "dl2"))
    assert "Download attempts" in str(info.value)
    assert not list((tmp_path / "dl2").iterdir())  # no partial file kept


def test_wikitext_build_is_reused_then_built_again_when_the_source_changes(tmp_path, monkeypatch):
  manual = tmp_path / "manual"
  fw.trust(monkeypatch, "v1", fw.write_zip(str(manual), "v1"))
  _build(tmp_path, "v1", manual)
  os.remove(manual / "wikitext-103-v1.zip")  # the source is no longer needed
  assert _text(_build(tmp_path, "v1", manual), "test") == fw.split_text("test", raw=False)
  changed = fw.split_text("test", raw=False).replace("illustrator", "painter")
  folder = fw.write_extracted(str(manual), "v1", {"test": changed})
  builder = _build(tmp_path, "v1", manual)
  assert _text(builder, "test") == changed
  paths = [os.path.join(folder, f"wiki.{s}.tokens") for s in ("train", "valid", "test")]
  assert builder.info.metadata[store.FINGERPRINT_KEY] == store.fingerprint(paths)


def test_fingerprint_and_file_digest_see_size_ends_and_name_not_a_deep_same_size_edit(tmp_path):
  """The same rule decides whether prepared data is stale and makes a run's digest of a file."""
  mib = 1 << 20
  data = bytes(range(256)) * (3 * mib // 256)  # 3 MiB: a middle MiB the fingerprint skips
  path = str(tmp_path / "enwik8")
  open(path, "wb").write(data)
  base, digest = store.fingerprint([path]), store.file_digest(path)
  assert base.startswith("size+ends-sha256:") and len(digest) == 16
  for other in (data[:-1], data + b"x", b"X" + data[1:], data[:-1] + b"X"):
    open(path, "wb").write(other)
    assert store.fingerprint([path]) != base and store.file_digest(path) != digest
  open(path, "wb").write(data[: 3 * mib // 2] + b"X" + data[3 * mib // 2 + 1 :])
  assert store.fingerprint([path]) == base and store.file_digest(path) == digest  # the limit
  os.rename(path, tmp_path / "other")  # the same bytes under another name: another source
  assert store.fingerprint([str(tmp_path / "other")]) != base
