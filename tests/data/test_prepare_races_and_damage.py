"""`prepare` on a fake enwik8: two runs at once (the lock), a damaged prepared split, no
`--data_dir` (the trainer's default folder) and a killed TFDS build (its `incomplete.*` folder)."""

import json
import logging
import os
import shutil
import threading

import numpy as np
import pytest

from tests.support import fake_enwik8 as fe
from aft_jax.data import corpus as corpus_lib
from aft_jax.data import enwik8, prepare, sources, store
from aft_jax.data.config import DataConfig

SPLITS = enwik8.SPLITS
N = 5_003
EXPECTED = {"vocab_size": 256, "tokens": {"train": 4_503, "validation": 250, "test": 250}}


@pytest.fixture(autouse=True)
def _no_network(monkeypatch, tmp_path):
  monkeypatch.setattr(enwik8, "MIRRORS", [f"file://{tmp_path}/no-mirror/enwik8.zip"])
  monkeypatch.setattr(enwik8, "CHUNK_BYTES", 1_000)  # several examples per split
  fe.write_file(str(tmp_path / "manual"), fe.content(N))


def _prepare(tmp_path, *extra, data_dir=True):
  flags = ["--manual_dir", str(tmp_path / "manual"), "--nodownload", "--quiet"]
  if data_dir:
    flags += ["--data_dir", str(tmp_path / "data")]
  return prepare.main(["--dataset", "enwik8", *flags, *extra])


def _prepared(tmp_path, data="data"):
  return store.prepared_dir(str(tmp_path / data), prepare.ENWIK8_NAME)


def _assert_bytes_right(path):
  c = corpus_lib.load_prepared(path)
  assert b"".join(c.splits[s].astype(np.uint8).tobytes() for s in SPLITS) == fe.content(N)


def test_two_prepares_at_once_build_once_and_agree(tmp_path, monkeypatch):
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


def test_a_lock_held_elsewhere_is_waited_for(tmp_path):
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
def test_truncated_split_names_the_file_and_prepare_rebuilds_it(tmp_path, caplog, cut):
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


def test_cli_defaults_to_the_trainer_data_dir(tmp_path, monkeypatch, capsys):
  """`aft-prepare` without --data_dir writes where `aft-train` looks when data_dir is ''."""
  monkeypatch.setenv(corpus_lib.DATA_DIR_ENV, str(tmp_path / "cache"))
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
def test_stale_incomplete_builds_are_removed(tmp_path, when):
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
