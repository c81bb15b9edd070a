"""The enwik8 TFDS builder and `prepare --dataset enwik8`, offline on fake archives; and
`prepare` under two runs at once (the lock), a damaged prepared split, no `--data_dir` (the
trainer's default folder) and a killed TFDS build (its `incomplete.*` folder)."""

import json
import logging
import os
import shutil
import threading
import zipfile

import numpy as np
import pytest

from tests.support import fake_enwik8 as fe
from aft_jax.data import corpus as corpus_lib
from aft_jax.data import enwik8, prepare, sources, store
from aft_jax.data.config import DataConfig

SPLITS = enwik8.SPLITS
N = 5_003  # fake file size: not a multiple of 20, so N // 20 rounds down
EXPECTED = {"vocab_size": 256, "tokens": {"train": 4_503, "validation": 250, "test": 250}}


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


@pytest.fixture
def fake_file(tmp_path):
  fe.write_file(str(tmp_path / "manual"), fe.content(N))


def _prepare(tmp_path, *extra, data_dir=True):
  flags = ["--manual_dir", str(tmp_path / "manual"), "--nodownload", "--quiet"]
  flags += ["--data_dir", str(tmp_path / "data")] if data_dir else []
  return prepare.main(["--dataset", "enwik8", *flags, *extra])


def _prepared(tmp_path, data="data"):
  return store.prepared_dir(str(tmp_path / data), prepare.ENWIK8_NAME)


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
  assert summary == EXPECTED
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == EXPECTED
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


def _assert_bytes_right(path):
  c = corpus_lib.load_prepared(path)
  assert b"".join(c.splits[s].astype(np.uint8).tobytes() for s in SPLITS) == fe.content(N)


def test_two_prepares_at_once_build_once_and_agree(fake_file, tmp_path, monkeypatch):
  """The second run waits for the first one's lock, then reuses what it prepared."""
  real_build = sources.build
  builds, first_in, second_waits = [], threading.Event(), threading.Event()

  def slow_build(*args, **kwargs):
    builds.append(threading.current_thread().name)
    if len(builds) == 1:
      first_in.set()
      # Hold on until the other run is blocked on the lock (or, without one, builds as well).
      assert second_waits.wait(timeout=60)
    else:
      second_waits.set()
    return real_build(*args, **kwargs)

  class Waiting(logging.Handler):
    def emit(self, record):
      if "waiting" in record.getMessage():
        second_waits.set()

  handler = Waiting()
  logging.getLogger("aft_jax.data").addHandler(handler)
  monkeypatch.setattr(sources, "build", slow_build)
  results = {}

  def run(name):
    try:
      manual = str(tmp_path / "manual")
      results[name] = prepare.prepare_enwik8(
        str(tmp_path / "data"), manual_dir=manual, download=False, progress=False
      )
    except Exception as e:  # pylint: disable=broad-except  (checked below)
      results[name] = e

  try:
    first = threading.Thread(target=run, args=("first",), name="first")
    first.start()
    assert first_in.wait(timeout=60)
    second = threading.Thread(target=run, args=("second",), name="second")
    second.start()
    for t in (first, second):
      t.join(timeout=120)
  finally:
    logging.getLogger("aft_jax.data").removeHandler(handler)
  assert not any(isinstance(r, Exception) for r in results.values()), results
  # A reuse returns all of summary.json; main() prints these two fields.
  assert [{k: r[k] for k in EXPECTED} for r in results.values()] == [EXPECTED, EXPECTED]
  assert builds == ["first"] and len(results) == 2
  _assert_bytes_right(_prepared(tmp_path))


def test_a_lock_held_elsewhere_is_waited_for(fake_file, tmp_path):
  """The lock is a file lock: one taken through another open file blocks, and is released."""
  path = str(tmp_path / "prepared" / "x")
  with store.lock(path, "x"):
    done = threading.Event()

    def other():
      with store.lock(path, "x"):
        done.set()

    t = threading.Thread(target=other)
    t.start()
    assert not done.wait(timeout=0.5)
  t.join(timeout=10)
  assert done.is_set()
  assert os.listdir(tmp_path / "prepared") == ["x.lock"]  # never a folder of its own


# Where the cut falls: inside the ids, inside the .npy header, nothing left, or no file.
CUTS = {"ids": lambda n: n - 100, "header": lambda n: 50, "empty": lambda n: 0, "missing": None}


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_truncated_split_names_the_file_and_prepare_rebuilds_it(fake_file, tmp_path, caplog, cut):
  assert _prepare(tmp_path) == EXPECTED
  path = _prepared(tmp_path)
  split = os.path.join(path, "validation.npy")
  if cut == "missing":
    os.remove(split)
  else:
    os.truncate(split, CUTS[cut](os.path.getsize(split)))
  with pytest.raises(store.DamagedCorpusError) as info:
    corpus_lib.load_prepared(path)
  msg = str(info.value)
  assert isinstance(info.value, ValueError) and "\n" not in msg
  assert split in msg and f"delete {path}" in msg and "prepare" in msg
  assert ("is missing" in msg) == (cut == "missing")
  # A rerun does not trust it: it prepares the corpus again.
  with caplog.at_level(logging.WARNING):
    assert _prepare(tmp_path) == EXPECTED
  assert "validation.npy" in caplog.text and "preparing it again" in caplog.text
  _assert_bytes_right(path)


def test_cli_defaults_to_the_trainer_data_dir(fake_file, tmp_path, monkeypatch, capsys):
  """`aft-prepare` without --data_dir writes where `aft-train` looks when data_dir is ''."""
  monkeypatch.setenv("AFT_JAX_DATA", str(tmp_path / "cache"))
  assert _prepare(tmp_path, data_dir=False) == EXPECTED
  out, err = capsys.readouterr()
  assert json.loads(out.strip().splitlines()[-1]) == EXPECTED
  path = _prepared(tmp_path, "cache")
  assert store.is_complete(path) and path in err
  monkeypatch.setattr(enwik8, "build", None)  # reused: never built again
  cfg = DataConfig(dataset="enwik8", data_dir="", manual_dir=str(tmp_path / "manual"))
  c = corpus_lib.load_corpus(cfg)
  assert int(c.splits["test"].size) == N // 20


@pytest.mark.parametrize("when", ["before_the_first_build", "beside_a_finished_build"])
def test_stale_incomplete_builds_are_removed(fake_file, tmp_path, when):
  """A build killed mid-way leaves TFDS's temporary folder; the next build removes it."""
  config_dir = tmp_path / "data" / "tfds" / "enwik8" / "bytes"
  if when == "beside_a_finished_build":
    _prepare(tmp_path)
    shutil.rmtree(_prepared(tmp_path))  # so that prepare calls the builder again
  # TFDS's name (tensorflow_datasets.core.utils.file_utils._get_incomplete_dir).
  stale = config_dir / "incomplete.Q7ZK2B_1.0.0"
  other_version = config_dir / "incomplete.Q7ZK2B_0.9.0"
  for d in (stale, other_version):
    d.mkdir(parents=True)
    (d / "enwik8-train.array_record-00000-of-00001").write_bytes(b"x" * 1_000)
  assert _prepare(tmp_path) == EXPECTED
  assert not stale.exists() and other_version.exists()  # another version's: left alone
  assert sorted(p.name for p in config_dir.iterdir()) == ["1.0.0", "1.0.0.lock", other_version.name]
  _assert_bytes_right(_prepared(tmp_path))
