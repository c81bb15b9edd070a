"""The enwik8 TFDS builder and `prepare --dataset enwik8`, offline on fake archives."""

import json
import logging
import os
import zipfile

import numpy as np
import pytest

from tests.support import fake_enwik8 as fe
from aft_jax.data import corpus as corpus_lib
from aft_jax.data import enwik8, prepare, sources, store
from aft_jax.data.config import DataConfig

SPLITS = enwik8.SPLITS
N = 5_003  # fake file size: not a multiple of 20, so N // 20 rounds down


@pytest.fixture(autouse=True)
def _no_network(monkeypatch, tmp_path):
  monkeypatch.setattr(enwik8, "MIRRORS", [f"file://{tmp_path}/no-mirror/enwik8.zip"])
  monkeypatch.setattr(enwik8, "CHUNK_BYTES", 1_000)  # several examples per split


def _build(tmp_path, manual_dir, download=False):
  manual_dir = manual_dir and str(manual_dir)
  return enwik8.build(data_dir=str(tmp_path / "tfds"), manual_dir=manual_dir, download=download)


def _split_bytes(builder, split):
  ds = builder.as_data_source(split)
  return [ds[i]["bytes"] for i in range(len(ds))]


def _prepare(tmp_path, *extra):
  data, manual = str(tmp_path / "data"), str(tmp_path / "manual")
  flags = ["--data_dir", data, "--manual_dir", manual, "--nodownload", "--quiet"]
  return prepare.main(["--dataset", "enwik8", *flags, *extra])


def _prepared(tmp_path):
  return store.prepared_dir(str(tmp_path / "data"), "enwik8-byte")


@pytest.mark.parametrize("n", [20, 39, 40, 5_003, 100_000_000])
def test_standard_split_sizes(n):
  ranges = enwik8.split_ranges(n)
  sizes = {s: stop - start for s, (start, stop) in ranges.items()}
  assert sizes["validation"] == sizes["test"] == n // 20 and sum(sizes.values()) == n
  assert ranges["train"][0] == 0 and ranges["test"][1] == n
  assert (
    ranges["train"][1] == ranges["validation"][0] and ranges["validation"][1] == ranges["test"][0]
  )
  if n == 100_000_000:  # the real file: computed, not built
    assert sizes == {"train": 90_000_000, "validation": 5_000_000, "test": 5_000_000}


@pytest.mark.parametrize("form", ["zip", "file"])
def test_build_keeps_every_byte_in_order(tmp_path, form):
  data = fe.content(N)
  write = fe.write_zip if form == "zip" else fe.write_file
  write(str(tmp_path / "manual"), data)
  builder = _build(tmp_path, tmp_path / "manual")
  assert builder.info.disable_shuffling
  got = {}
  for split in SPLITS:
    chunks = _split_bytes(builder, split)
    assert all(0 < len(c) <= 1_000 for c in chunks)
    got[split] = b"".join(chunks)
  assert {s: len(b) for s, b in got.items()} == {"train": 4_503, "validation": 250, "test": 250}
  assert got["train"] + got["validation"] + got["test"] == data and got["test"] == data[-250:]
  source = os.path.join(tmp_path / "manual", "enwik8.zip" if form == "zip" else "enwik8")
  assert builder.info.metadata[sources.FINGERPRINT_KEY] == sources.fingerprint([source])


def test_prepare_prints_counts_and_warns_custom(tmp_path, capsys, caplog):
  data = fe.content(N)
  fe.write_zip(str(tmp_path / "manual"), data)
  with caplog.at_level(logging.WARNING):
    summary = _prepare(tmp_path)
  expected = {"vocab_size": 256, "tokens": {"train": 4_503, "validation": 250, "test": 250}}
  assert summary == expected
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == expected
  assert "custom byte corpus" in caplog.text and "5,003 bytes" in caplog.text
  assert store.read_summary(_prepared(tmp_path))["official"] is False
  c = corpus_lib.load_corpus(DataConfig(dataset="enwik8", data_dir=str(tmp_path / "data")))
  assert c.name == "enwik8-byte" and c.unit == "byte" and c.vocab.size == 256 and c.bos_id == 10
  assert b"".join(c.splits[s].astype(np.uint8).tobytes() for s in SPLITS) == data


def test_real_size_is_official_and_yes_requires_it(tmp_path, monkeypatch, caplog):
  data = fe.content(N)
  fe.write_file(str(tmp_path / "manual"), data)
  with pytest.raises(prepare.CountMismatchError, match="5,003 bytes, not the 100,000,000"):
    _prepare(tmp_path, "--official", "yes")
  assert not store.is_complete(_prepared(tmp_path))
  monkeypatch.setattr(enwik8, "NUM_BYTES", N)  # the fake file "is" the real one
  with caplog.at_level(logging.WARNING):
    assert _prepare(tmp_path, "--official", "yes")["tokens"]["test"] == 250
  assert "custom" not in caplog.text
  assert store.read_summary(_prepared(tmp_path))["official"] is True


def _damaged_zip(manual, case):
  path = fe.write_zip(str(manual), fe.content(N), stored=case == "bad_crc")
  raw = bytearray(open(path, "rb").read())
  if case == "bad_crc":
    raw[raw.index(b"Construction")] ^= 0x01  # a clean CRC error: the member is not compressed
  open(path, "wb").write(bytes(raw if case == "bad_crc" else raw[: len(raw) // 2]))


BAD_CASES = {
  "truncated_zip": (sources.CorruptArchiveError, "enwik8.zip is not a readable zip"),
  "bad_crc": (sources.CorruptArchiveError, "cannot be decompressed"),
  "zip_without_enwik8": (sources.MissingDataError, "lacks the file enwik8"),
  "empty_file": (sources.BadSplitFileError, "is empty"),
  "too_short": (sources.BadSplitFileError, "has only 11 bytes"),
  "missing": (sources.MissingDataError, "enwik8 not found"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_data_is_a_one_line_error_and_nothing_is_complete(tmp_path, case):
  error, message = BAD_CASES[case]
  manual = tmp_path / "manual"
  if case in ("truncated_zip", "bad_crc"):
    _damaged_zip(manual, case)
  elif case == "zip_without_enwik8":
    fe.write_zip(str(manual), fe.content(N), member="enwik9")
  elif case == "missing":
    manual.mkdir()
  else:
    fe.write_file(str(manual), b"" if case == "empty_file" else b"<mediawiki>")
  with pytest.raises(error, match=message) as info:
    _prepare(tmp_path)
  msg = str(info.value)
  assert isinstance(info.value, ValueError) and str(manual) in msg
  assert "\n" not in msg or case == "missing"  # the missing case lists what it tried
  assert not (tmp_path / "data" / "tfds" / "enwik8" / "bytes" / "1.0.0").exists()
  assert not store.is_complete(_prepared(tmp_path))
  if case == "missing":
    assert "enwik8.zip" in msg and os.path.join(str(manual), "enwik8") in msg
    assert "Downloading was disabled" in msg and "--manual_dir" in msg


def test_checksum_checked_when_the_zip_holds_the_real_size(tmp_path, monkeypatch):
  path = fe.write_zip(str(tmp_path / "manual"), fe.content(N))
  monkeypatch.setattr(enwik8, "NUM_BYTES", N)
  with pytest.raises(sources.ChecksumError, match="does not match the official enwik8.zip"):
    _build(tmp_path, tmp_path / "manual")
  monkeypatch.setattr(enwik8, "ZIP_SHA256", sources.sha256_of(path))
  builder = _build(tmp_path, tmp_path / "manual")
  assert b"".join(_split_bytes(builder, "test")) == fe.content(N)[-250:]


def test_download_tries_mirrors_and_checks_the_sha256(tmp_path, monkeypatch):
  good = fe.write_zip(str(tmp_path / "good"), fe.content(N))
  bad = fe.write_zip(str(tmp_path / "bad"), fe.content(N - 1))
  monkeypatch.setattr(enwik8, "ZIP_SHA256", sources.sha256_of(good))
  monkeypatch.setattr(enwik8, "MIRRORS", [f"file://{bad}", f"file://{good}"])
  builder = _build(tmp_path, None, download=True)
  assert b"".join(_split_bytes(builder, "validation")) == fe.content(N)[-500:-250]
  downloads = tmp_path / "tfds" / "downloads"
  assert sorted(p.name for p in downloads.iterdir() if p.is_file()) == ["enwik8.zip"]


def test_changed_source_is_prepared_again(tmp_path):
  fe.write_file(str(tmp_path / "manual"), fe.content(N))
  assert _prepare(tmp_path)["tokens"]["test"] == 250
  fe.write_file(str(tmp_path / "manual"), fe.content(2 * N))  # a new file, same place
  assert _prepare(tmp_path)["tokens"]["test"] == 2 * N // 20
  os.remove(tmp_path / "manual" / "enwik8")  # no source: the prepared data is reused
  assert _prepare(tmp_path)["tokens"]["test"] == 2 * N // 20


def test_zip_member_is_read_through_its_crc(tmp_path):
  """Reading the test split reaches the end of the member, where zipfile checks the CRC."""
  path = fe.write_zip(str(tmp_path / "manual"), fe.content(N))
  with zipfile.ZipFile(path) as zf:
    assert zf.getinfo("enwik8").file_size == N
  source = enwik8.Source(zip_path=path)
  assert source.size == N and not source.is_real
  assert b"".join(source.chunks("test")) == fe.content(N)[-250:]
