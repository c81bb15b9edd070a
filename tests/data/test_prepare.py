"""`aft-prepare` (``prepare.main`` / ``cli``) and `load_corpus` on fake WikiText-103 and enwik8:
counts, reuse, the official checks, the store's files, its lock and damaged or killed runs."""

import collections
import errno
import io
import json
import logging
import os
import shutil
import sys
import threading

import numpy as np
import pytest

from aft_jax import files
from aft_jax.data import corpus as corpus_lib
from aft_jax.data import enwik8, prepare, sources, store
from aft_jax.data.config import DataConfig
from tests.support import fake_enwik8 as fe
from tests.support import fake_wikitext as fw

pytestmark = pytest.mark.usefixtures("offline")
SPLITS = ("train", "validation", "test")


def _protocol_tokens(text):
  """Independent reference: lines split on '\\n', each split on whitespace + <eos>."""
  assert text.endswith("\n")
  return [tok for line in text.split("\n")[:-1] for tok in line.split() + ["<eos>"]]


def _expected_word_summary(variant):
  texts = fw.texts(variant)
  vocab = set(_protocol_tokens(texts["train"])) | {"<eos>"}
  vocab |= {"<unk>"} if variant == "raw_v1" else set()
  return {"vocab_size": len(vocab), "tokens": {s: len(_protocol_tokens(texts[s])) for s in SPLITS}}


def _run(tmp_path, *extra, quiet=True):
  """main() in-process on WikiText-103 in tmp_path/manual; returns the summary it printed."""
  folders = ["--data_dir", str(tmp_path / "data"), "--manual_dir", str(tmp_path / "manual")]
  quiet = ["--quiet"] if quiet else []
  return prepare.main(["--dataset", "wikitext103", *folders, "--nodownload", *quiet, *extra])


def _path(tmp_path, name="wikitext103-v1-word"):
  return store.prepared_dir(str(tmp_path / "data"), name)


def _data_config(tmp_path, tokenizer: str, variant: str):
  folders = dict(data_dir=str(tmp_path / "data"), manual_dir=str(tmp_path / "manual"))
  return DataConfig(dataset="wikitext103", tokenizer=tokenizer, variant=variant, **folders)


@pytest.mark.parametrize("variant", ["v1", "raw_v1"])
def test_word_ids_follow_the_protocol_and_a_rerun_reuses(tmp_path, capsys, caplog, variant):
  fw.write_extracted(str(tmp_path / "manual"), variant)
  summary = _run(tmp_path, "--variant", variant, quiet=False)
  out, err = capsys.readouterr()
  assert summary == _expected_word_summary(variant) and "articles" in err  # tqdm's bars
  assert json.loads(out.strip().splitlines()[-1]) == summary  # the last line
  with caplog.at_level(logging.INFO):
    assert _run(tmp_path, "--variant", variant) == summary and "Reusing" in caplog.text
  path = _path(tmp_path, f"wikitext103-{variant}-word")
  c = corpus_lib.load_prepared(path)
  assert c.unit == "word" and c.vocab.size == summary["vocab_size"] and c.bos_id == c.vocab.eos_id
  vocab_file = open(os.path.join(path, "vocab.txt"), encoding="utf-8").read().split("\n")[:-1]
  assert vocab_file == c.vocab.tokens
  # Frequency order with ties by string.
  counts = collections.Counter(_protocol_tokens(fw.texts(variant)["train"]))
  ranked = [t for t in c.vocab.tokens if t in counts]
  assert ranked == sorted(counts, key=lambda t: (-counts[t], t))
  known = set(c.vocab.tokens)
  for s in SPLITS:
    ids, ref = c.splits[s], _protocol_tokens(fw.texts(variant)[s])
    assert ids.dtype == np.uint32 and ids.ndim == 1
    if variant == "raw_v1":  # held-out words unseen in train become <unk>
      ref = [w if w in known else "<unk>" for w in ref]
    assert [c.vocab.tokens[i] for i in ids] == ref
  if variant == "raw_v1":
    assert "<unk>" in [c.vocab.tokens[i] for i in c.splits["test"]]  # 'Herons' is not in train


def test_byte_tokenizer_reads_the_raw_text_and_load_corpus_prepares_it(tmp_path):
  fw.write_extracted(str(tmp_path / "manual"), "raw_v1")
  c = corpus_lib.load_corpus(_data_config(tmp_path, "byte", "v1"))  # not prepared yet
  assert c.name == "wikitext103-raw_v1-byte" and c.unit == "byte" and c.vocab.size == 256
  assert c.bos_id == ord("\n")
  raw = {s: fw.split_text(s, raw=True).encode("utf-8") for s in SPLITS}
  assert {s: c.splits[s].astype(np.uint8).tobytes() for s in SPLITS} == raw
  assert not os.path.exists(os.path.join(_path(tmp_path, "wikitext103-raw_v1-byte"), "vocab.txt"))
  summary = _run(tmp_path, "--tokenizer", "byte")  # the same folder: reused
  assert summary == {"vocab_size": 256, "tokens": {s: len(raw[s]) for s in SPLITS}}


def test_interrupted_prepare_is_not_complete_and_is_redone(tmp_path, monkeypatch):
  fw.write_extracted(str(tmp_path / "manual"), "v1")
  real_write = store.write_tokens

  def crash_on_validation(path, split, chunks):
    if split == "validation":
      raise KeyboardInterrupt("simulated crash")
    return real_write(path, split, chunks)

  monkeypatch.setattr(store, "write_tokens", crash_on_validation)
  with pytest.raises(KeyboardInterrupt):
    _run(tmp_path)
  path = _path(tmp_path)
  assert os.path.exists(os.path.join(path, "train.npy")) and not store.is_complete(path)
  with pytest.raises(FileNotFoundError, match="not a complete prepared corpus"):
    corpus_lib.load_prepared(path)
  monkeypatch.setattr(store, "write_tokens", real_write)
  c = corpus_lib.load_corpus(_data_config(tmp_path, "word", "v1"))  # no marker: prepares again
  assert store.is_complete(path)
  assert {s: int(c.splits[s].size) for s in SPLITS} == _expected_word_summary("v1")["tokens"]


def test_a_split_is_written_as_numpy_saves_it_and_a_partial_one_is_never_visible(tmp_path):
  path = str(tmp_path / "p")
  store.start(path)

  def crashing():
    yield np.arange(5, dtype=np.uint32)
    raise RuntimeError("crash while encoding")

  with pytest.raises(RuntimeError):
    store.write_tokens(path, "train", crashing())
  assert os.listdir(path) == []
  chunks = [np.arange(5, dtype=np.uint32), np.frombuffer(b"ab", np.uint8), np.zeros(0, np.uint32)]
  assert store.write_tokens(path, "train", chunks) == 7
  np.save(tmp_path / "want.npy", np.concatenate([c.astype(np.uint32) for c in chunks]))
  assert open(os.path.join(path, "train.npy"), "rb").read() == (tmp_path / "want.npy").read_bytes()


class _FullDisk(io.FileIO):
  """A file on a disk that filled meanwhile: every write fails with ENOSPC."""

  def write(self, data):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_one_error_naming_the_size_and_leaves_no_temporary_file(
  tmp_path, monkeypatch, capsys
):
  """Too little space up front, or a disk that fills meanwhile: one DiskFullError, and the
  folder holds nothing; `aft-prepare` says it in one line, exit status 1."""
  path = str(tmp_path / "p")
  store.start(path)
  chunks = [np.arange(1_000_000, dtype=np.uint32)]
  want = f"no space left on device: needs ~5 MB at {path}/train.npy"
  usage = shutil.disk_usage(path)
  with monkeypatch.context() as m:
    m.setattr(files.shutil, "disk_usage", lambda p: usage._replace(free=3_000_000))
    with pytest.raises(files.DiskFullError) as e:
      store.write_tokens(path, "train", chunks)
    assert str(e.value) == want and e.value.errno == errno.ENOSPC and os.listdir(path) == []
    m.setattr(files.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    data, json_files = tmp_path / "data", os.path.join(os.path.dirname(json.__file__), "*.py")
    argv = ["--dataset", "text", "--train_files", json_files, "--data_dir", str(data), "--quiet"]
    m.setattr(sys, "argv", ["aft-prepare", *argv])
    with pytest.raises(SystemExit) as exit_:
      prepare.cli()
  message = str(exit_.value.code)  # sys.exit(str): printed on stderr, exit status 1
  assert message.startswith("error: DiskFullError: no space left on device: needs ~"), message
  assert "\n" not in message and not capsys.readouterr().err.strip()
  assert not [f for _, _, fs in os.walk(data) for f in fs if ".tmp-" in f]
  monkeypatch.setattr(store, "open", _FullDisk, raising=False)
  with pytest.raises(files.DiskFullError, match=want):
    store.write_tokens(path, "train", chunks)
  assert os.listdir(path) == []


def _patch_official(monkeypatch, summary):
  """Makes the fake data "the official release": its counts the published ones."""
  monkeypatch.setattr(prepare, "OFFICIAL_VOCAB_SIZE", summary["vocab_size"])
  monkeypatch.setattr(prepare, "OFFICIAL_TOKENS", dict(summary["tokens"]))
  lines = {s: fw.texts("v1")[s].count("\n") for s in SPLITS}
  monkeypatch.setattr(prepare, "OFFICIAL_LINES", lines)


def test_official_counts_are_checked_where_the_files_look_official(tmp_path, monkeypatch):
  assert prepare.OFFICIAL_VOCAB_SIZE == 267_735
  assert prepare.OFFICIAL_TOKENS == {"train": 103_227_021, "validation": 217_646, "test": 245_569}
  fw.write_extracted(str(tmp_path / "manual"), "v1")
  expected, path = _expected_word_summary("v1"), _path(tmp_path)
  with pytest.raises(prepare.CountMismatchError, match="expected 1,801,350"):
    _run(tmp_path, "--official", "yes")
  assert _run(tmp_path) == expected  # unflagged, the small fake data is not the real data
  assert store.read_summary(path)["official"] is False
  # The fake data "is" the official release: line counts identify it, counts agree.
  _patch_official(monkeypatch, expected)
  shutil.rmtree(path)
  assert _run(tmp_path) == expected and store.read_summary(path)["official"] is True
  _patch_official(monkeypatch, {**expected, "tokens": {**expected["tokens"], "test": 245_569}})
  shutil.rmtree(path)
  with pytest.raises(prepare.CountMismatchError, match="test: .* tokens, expected 245,569"):
    _run(tmp_path)
  assert not store.is_complete(path)


def test_half_truncated_official_file_is_an_error_under_auto(tmp_path, monkeypatch):
  """A truncated wiki.train.tokens beside intact valid/test files is not a custom corpus."""
  fw.write_extracted(str(tmp_path / "manual"), "v1")
  _patch_official(monkeypatch, _expected_word_summary("v1"))  # fake == official
  train = tmp_path / "manual" / "wikitext-103" / "wiki.train.tokens"
  text = train.read_bytes()
  train.write_bytes(text[: text.index(b"\n", len(text) // 2) + 1])  # cut at a line end
  with pytest.raises(prepare.CountMismatchError, match="look truncated or modified") as info:
    _run(tmp_path)
  assert "--official no" in str(info.value) and "train: " in str(info.value)
  assert not store.is_complete(_path(tmp_path))
  # Asked for explicitly, the same files are a custom corpus in the official layout.
  full = _expected_word_summary("v1")["tokens"]["train"]
  assert 0 < _run(tmp_path, "--official", "no")["tokens"]["train"] < full
  assert store.read_summary(_path(tmp_path))["official"] is False


def test_pydoc_cli(capsys):
  summary = prepare.main(["--dataset", "pydoc"])
  c = corpus_lib.pydoc_corpus("byte")
  assert summary == {"vocab_size": 256, "tokens": {s: int(c.splits[s].size) for s in SPLITS}}
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary


@pytest.mark.parametrize("keep_prepared", [True, False])
def test_a_rerun_reuses_but_not_once_the_source_changed(tmp_path, monkeypatch, keep_prepared):
  """A rerun rebuilds nothing; neither prepared/ nor the TFDS build under tfds/ is reused once
  the source changed."""
  fw.write_extracted(str(tmp_path / "manual"), "v1")
  first, path = _run(tmp_path), _path(tmp_path)
  mtimes = {p: os.path.getmtime(os.path.join(path, p)) for p in os.listdir(path)}
  with monkeypatch.context() as m:
    m.setattr(sources, "build", None)  # never built again
    assert _run(tmp_path) == first
  assert {p: os.path.getmtime(os.path.join(path, p)) for p in os.listdir(path)} == mtimes
  if not keep_prepared:
    shutil.rmtree(path)
  extra = " = Added = \n \n a new line of test text . \n"
  fw.write_extracted(str(tmp_path / "manual"), "v1", {"test": fw.texts("v1")["test"] + extra})
  second = _run(tmp_path)
  assert second["tokens"]["test"] == first["tokens"]["test"] + len(_protocol_tokens(extra))
  assert store.read_summary(path)["source_fingerprint"].startswith("size+ends-sha256:")


@pytest.mark.parametrize(
  "flags, message",
  [
    (["wikitext103", "--tokenizer", "subword", "--vocab_size", "10"], "vocab_size = 10 must be"),
    (["pydoc", "--tokenizer", "subword"], r"tokenizer = 'subword': pydoc is bytes or words"),
    (["text", "--train_files", " , "], r"config\.data\.train_files is empty"),
  ],
)
def test_the_command_line_is_checked_as_a_config_is(tmp_path, flags, message):
  with pytest.raises(ValueError, match=message) as e:
    prepare.main(["--dataset", *flags, "--data_dir", str(tmp_path)])
  assert "\n" not in str(e.value) and not os.listdir(tmp_path)


# enwik8, on a fake file of N bytes (not a multiple of 20: N // 20 rounds down).
N = 5_003
EXPECTED = {"vocab_size": 256, "tokens": {"train": 4_503, "validation": 250, "test": 250}}


def _prepare_enwik8(tmp_path, *extra, data_dir=True):
  flags = ["--manual_dir", str(tmp_path / "manual"), "--nodownload", "--quiet"]
  flags += ["--data_dir", str(tmp_path / "data")] if data_dir else []
  return prepare.main(["--dataset", "enwik8", *flags, *extra])


def _enwik8_path(tmp_path, data="data"):
  return store.prepared_dir(str(tmp_path / data), prepare.ENWIK8_NAME)


def _assert_bytes_right(path, data=fe.content(N)):
  c = corpus_lib.load_prepared(path)
  assert b"".join(c.splits[s].astype(np.uint8).tobytes() for s in SPLITS) == data


def test_enwik8_load_corpus_and_aft_prepare_default_to_one_data_dir_and_warn_custom(
  tmp_path, monkeypatch, capsys, caplog
):
  """`load_corpus` with data_dir '' prepares where `aft-prepare` without --data_dir looks."""
  fe.write_zip(str(tmp_path / "manual"), fe.content(N))
  monkeypatch.setenv("AFT_JAX_DATA", str(tmp_path / "cache"))
  with caplog.at_level(logging.WARNING):
    c = corpus_lib.load_corpus(DataConfig(dataset="enwik8", manual_dir=str(tmp_path / "manual")))
  assert c.name == "enwik8-byte" and c.unit == "byte" and c.vocab.size == 256 and c.bos_id == 10
  assert "custom byte corpus" in caplog.text and "5,003 bytes" in caplog.text
  path = _enwik8_path(tmp_path, "cache")
  assert store.is_complete(path) and not store.read_summary(path)["official"]
  _assert_bytes_right(path)
  monkeypatch.setattr(sources, "build", None)  # reused: never built again
  assert _prepare_enwik8(tmp_path, data_dir=False) == EXPECTED
  out, err = capsys.readouterr()
  assert json.loads(out.strip().splitlines()[-1]) == EXPECTED and path in err


def test_real_size_is_official_and_yes_requires_it(tmp_path, monkeypatch, caplog):
  fe.write_file(str(tmp_path / "manual"), fe.content(N))
  with pytest.raises(prepare.CountMismatchError, match="5,003 bytes, not the 100,000,000"):
    _prepare_enwik8(tmp_path, "--official", "yes")
  assert not store.is_complete(_enwik8_path(tmp_path))
  monkeypatch.setattr(enwik8, "NUM_BYTES", N)  # the fake file "is" the real one
  with caplog.at_level(logging.WARNING):
    assert _prepare_enwik8(tmp_path, "--official", "yes")["tokens"]["test"] == 250
  assert "custom" not in caplog.text
  assert store.read_summary(_enwik8_path(tmp_path))["official"] is True


def test_enwik8_changed_source_is_prepared_again(tmp_path):
  fe.write_file(str(tmp_path / "manual"), fe.content(N))
  assert _prepare_enwik8(tmp_path)["tokens"]["test"] == 250
  fe.write_file(str(tmp_path / "manual"), fe.content(2 * N))  # a new file, same place
  assert _prepare_enwik8(tmp_path)["tokens"]["test"] == 2 * N // 20
  os.remove(tmp_path / "manual" / "enwik8")  # no source: the prepared data is reused
  assert _prepare_enwik8(tmp_path)["tokens"]["test"] == 2 * N // 20


def test_two_prepares_at_once_build_once_and_agree(tmp_path, monkeypatch):
  """The second run waits for the first one's lock, then reuses what it prepared."""
  fe.write_file(str(tmp_path / "manual"), fe.content(N))
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
  results, cfg = {}, DataConfig(dataset="enwik8", manual_dir=str(tmp_path / "manual"))

  def run(name):
    try:
      data = str(tmp_path / "data")
      results[name] = prepare.prepare_corpus(data, cfg, download=False, progress=False)[1]
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
  _assert_bytes_right(_enwik8_path(tmp_path))


def test_a_lock_held_elsewhere_is_waited_for(tmp_path):
  """The lock is a file lock: one taken through another open file blocks, and is released."""
  path, done = str(tmp_path / "prepared" / "x"), threading.Event()

  def other():
    with store.lock(path, "x"):
      done.set()

  with store.lock(path, "x"):
    t = threading.Thread(target=other)
    t.start()
    assert not done.wait(timeout=0.5)
  t.join(timeout=10)
  assert done.is_set()
  assert os.listdir(tmp_path / "prepared") == ["x.lock"]  # never a folder of its own


# Where the cut falls (inside the ids, the .npy header, nothing left, no file), or a zero id more.
CUTS = {"ids": -100, "header": 50, "empty": 0, "missing": None, "longer": 4}  # size, or change


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_truncated_split_names_the_file_and_prepare_rebuilds_it(tmp_path, caplog, cut):
  fe.write_file(str(tmp_path / "manual"), fe.content(N))
  assert _prepare_enwik8(tmp_path) == EXPECTED
  path = _enwik8_path(tmp_path)
  split = os.path.join(path, "validation.npy")
  if cut == "missing":
    os.remove(split)
  else:
    os.truncate(
      split, CUTS[cut] if cut in ("header", "empty") else os.path.getsize(split) + CUTS[cut]
    )
  with pytest.raises(store.DamagedCorpusError) as info:
    corpus_lib.load_prepared(path)
  msg = str(info.value)
  assert isinstance(info.value, ValueError) and "\n" not in msg
  assert split in msg and f"delete {path}" in msg and "prepare" in msg
  assert ("is missing" in msg) == (cut == "missing")
  # A rerun does not trust it: it prepares the corpus again.
  with caplog.at_level(logging.WARNING):
    assert _prepare_enwik8(tmp_path) == EXPECTED
  assert "validation.npy" in caplog.text and "preparing it again" in caplog.text
  _assert_bytes_right(path)


@pytest.mark.parametrize("when", ["before_the_first_build", "beside_a_finished_build"])
def test_stale_incomplete_builds_are_removed(tmp_path, when):
  """A build killed mid-way leaves TFDS's temporary folder; the next build removes it."""
  fe.write_file(str(tmp_path / "manual"), fe.content(N))
  config_dir = tmp_path / "data" / "tfds" / "enwik8" / "bytes"
  if when == "beside_a_finished_build":
    _prepare_enwik8(tmp_path)
    shutil.rmtree(_enwik8_path(tmp_path))  # so that prepare calls the builder again
  # TFDS's name (tensorflow_datasets.core.utils.file_utils._get_incomplete_dir).
  stale = config_dir / "incomplete.Q7ZK2B_1.0.0"
  other_version = config_dir / "incomplete.Q7ZK2B_0.9.0"
  for d in (stale, other_version):
    d.mkdir(parents=True)
    (d / "enwik8-train.array_record-00000-of-00001").write_bytes(b"x" * 1_000)
  assert _prepare_enwik8(tmp_path) == EXPECTED
  assert not stale.exists() and other_version.exists()  # another version's: left alone
  assert sorted(p.name for p in config_dir.iterdir()) == ["1.0.0", "1.0.0.lock", other_version.name]
  _assert_bytes_right(_enwik8_path(tmp_path))
