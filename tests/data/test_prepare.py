"""`aft-prepare` and `load_corpus` on fake WikiText-103 and enwik8: counts, reuse, the official
checks, the store's files, its lock and damaged or killed runs."""

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
N = 5_003  # fake enwik8 size: not a multiple of 20, so N // 20 rounds down
EXPECTED = {"vocab_size": 256, "tokens": {"train": 4_503, "validation": 250, "test": 250}}


def _protocol_tokens(text):
  """Independent reference: lines split on '\\n', each split on whitespace + <eos>."""
  return [tok for line in text.split("\n")[:-1] for tok in line.split() + ["<eos>"]]


def _word_summary(variant):
  texts = fw.texts(variant)
  vocab = set(_protocol_tokens(texts["train"])) | ({"<unk>"} if variant == "raw_v1" else set())
  return {"vocab_size": len(vocab), "tokens": {s: len(_protocol_tokens(texts[s])) for s in SPLITS}}


def _main(tmp_path, dataset, *extra):
  """main() in-process on the fake files in tmp_path/manual; returns the summary it printed."""
  flags = ["--manual_dir", str(tmp_path / "manual"), "--data_dir", str(tmp_path / "data")]
  return prepare.main(["--dataset", dataset, *flags, "--nodownload", *extra])


def _path(tmp_path, name="wikitext103-v1-word", data="data"):
  return store.prepared_dir(str(tmp_path / data), name)


def _assert_bytes_right(path, data=fe.content(N)):
  c = corpus_lib.load_prepared(path)
  assert b"".join(c.splits[s].astype(np.uint8).tobytes() for s in SPLITS) == data


@pytest.mark.parametrize("variant", ["v1", "raw_v1"])
def test_word_ids_follow_the_protocol_and_a_rerun_reuses(tmp_path, capsys, caplog, variant):
  fw.write_extracted(str(tmp_path / "manual"), variant)
  summary = _main(tmp_path, "wikitext103", "--variant", variant)
  out, err = capsys.readouterr()
  assert summary == _word_summary(variant) and "articles" in err  # tqdm's bars
  assert json.loads(out.strip().splitlines()[-1]) == summary  # the last line
  with caplog.at_level(logging.INFO):
    assert _main(tmp_path, "wikitext103", "--variant", variant) == summary
  assert "Reusing" in caplog.text
  c = corpus_lib.load_prepared(_path(tmp_path, f"wikitext103-{variant}-word"))
  assert c.unit == "word" and c.bos_id == c.vocab.eos_id
  known = set(c.vocab.tokens)
  for s in SPLITS:  # raw_v1: held-out words unseen in train are <unk> ('Herons' in test)
    ref = [w if w in known else "<unk>" for w in _protocol_tokens(fw.texts(variant)[s])]
    assert [c.vocab.tokens[i] for i in c.splits[s]] == ref
  assert "<unk>" in ref


def test_byte_tokenizer_reads_the_raw_text_and_load_corpus_prepares_it(tmp_path, monkeypatch):
  fw.write_extracted(str(tmp_path / "manual"), "raw_v1")
  folders = dict(data_dir=str(tmp_path / "data"), manual_dir=str(tmp_path / "manual"))
  c = corpus_lib.load_corpus(DataConfig("wikitext103", "byte", variant="v1", **folders))
  assert c.name == "wikitext103-raw_v1-byte" and c.unit == "byte" and c.bos_id == ord("\n")
  raw = {s: fw.split_text(s, raw=True).encode("utf-8") for s in SPLITS}
  assert {s: c.splits[s].astype(np.uint8).tobytes() for s in SPLITS} == raw
  monkeypatch.setattr(sources, "build", None)  # the same folder: reused
  assert _main(tmp_path, "wikitext103", "--tokenizer", "byte")["tokens"]["test"] == len(raw["test"])


def test_interrupted_prepare_is_not_complete_and_is_redone(tmp_path, monkeypatch):
  fw.write_extracted(str(tmp_path / "manual"), "v1")
  with monkeypatch.context() as m:
    m.setattr(prepare, "_check_official", None)  # a crash once every split is written
    with pytest.raises(TypeError):
      _main(tmp_path, "wikitext103")
  path = _path(tmp_path)
  assert os.path.exists(os.path.join(path, "test.npy")) and not store.is_complete(path)
  with pytest.raises(FileNotFoundError, match="not a complete prepared corpus"):
    corpus_lib.load_prepared(path)
  assert _main(tmp_path, "wikitext103") == _word_summary("v1") and store.is_complete(path)


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


def test_a_full_disk_is_one_error_naming_the_size_and_leaves_no_temporary_file(
  tmp_path, monkeypatch, capsys
):
  """Too little space up front, or a disk that fills meanwhile: `aft-prepare` says one line."""
  path, chunks = str(tmp_path / "p"), [np.arange(1_000_000, dtype=np.uint32)]
  store.start(path)
  usage = shutil.disk_usage(path)
  with monkeypatch.context() as m:
    m.setattr(files.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    data, json_files = tmp_path / "data", os.path.join(os.path.dirname(json.__file__), "*.py")
    argv = ["--dataset", "text", "--train_files", json_files, "--data_dir", str(data), "--quiet"]
    m.setattr(sys, "argv", ["aft-prepare", *argv])
    with pytest.raises(SystemExit) as exit_:
      prepare.cli()
  message = str(exit_.value.code)  # sys.exit(str): printed on stderr, exit status 1
  assert message.startswith("error: DiskFullError: no space left on device: needs ~")
  assert "\n" not in message and not capsys.readouterr().err.strip()
  assert not [f for _, _, fs in os.walk(data) for f in fs if ".tmp-" in f]

  class FullDisk(io.FileIO):  # a disk that filled meanwhile
    def write(self, data):
      raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(store, "open", FullDisk, raising=False)
  with pytest.raises(files.DiskFullError, match=f"needs ~5 MB at {path}/train.npy") as e:
    store.write_tokens(path, "train", chunks)
  assert e.value.errno == errno.ENOSPC and os.listdir(path) == []


def _patch_official(monkeypatch, summary):
  """Makes the fake data "the official release": its counts the published ones."""
  monkeypatch.setattr(prepare, "OFFICIAL_VOCAB_SIZE", summary["vocab_size"])
  monkeypatch.setattr(prepare, "OFFICIAL_TOKENS", dict(summary["tokens"]))
  monkeypatch.setattr(prepare, "OFFICIAL_LINES", {s: fw.texts("v1")[s].count("\n") for s in SPLITS})


def test_official_counts_are_checked_where_the_files_look_official(tmp_path, monkeypatch):
  assert prepare.OFFICIAL_VOCAB_SIZE == 267_735
  assert prepare.OFFICIAL_TOKENS == {"train": 103_227_021, "validation": 217_646, "test": 245_569}
  fw.write_extracted(str(tmp_path / "manual"), "v1")
  expected, path = _word_summary("v1"), _path(tmp_path)
  with pytest.raises(prepare.CountMismatchError, match="expected 1,801,350"):
    _main(tmp_path, "wikitext103", "--official", "yes")
  assert _main(tmp_path, "wikitext103") == expected  # unflagged, the fake data is not the real
  assert store.read_summary(path)["official"] is False
  _patch_official(monkeypatch, expected)  # line counts identify it, counts agree
  shutil.rmtree(path)
  assert _main(tmp_path, "wikitext103") == expected and store.read_summary(path)["official"]
  _patch_official(monkeypatch, {**expected, "tokens": {**expected["tokens"], "test": 245_569}})
  shutil.rmtree(path)
  with pytest.raises(prepare.CountMismatchError, match="test: .* tokens, expected 245,569"):
    _main(tmp_path, "wikitext103")
  assert not store.is_complete(path)
  # A truncated wiki.train.tokens beside intact valid/test files is not a custom corpus.
  _patch_official(monkeypatch, expected)
  train = tmp_path / "manual" / "wikitext-103" / "wiki.train.tokens"
  text = train.read_bytes()
  train.write_bytes(text[: text.index(b"\n", len(text) // 2) + 1])  # cut at a line end
  with pytest.raises(prepare.CountMismatchError, match="look truncated or modified") as info:
    _main(tmp_path, "wikitext103")
  assert "--official no" in str(info.value) and "train: " in str(info.value)
  assert not store.is_complete(path)
  # Asked for explicitly, the same files are a custom corpus in the official layout.
  train_tokens = _main(tmp_path, "wikitext103", "--official", "no")["tokens"]["train"]
  assert 0 < train_tokens < expected["tokens"]["train"] and not store.read_summary(path)["official"]


def test_pydoc_cli_and_the_command_line_is_checked_as_a_config_is(tmp_path, capsys):
  summary = prepare.main(["--dataset", "pydoc"])
  c = corpus_lib.pydoc_corpus("byte")
  assert summary == {"vocab_size": 256, "tokens": {s: int(c.splits[s].size) for s in SPLITS}}
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
  flags = ["--tokenizer", "subword", "--vocab_size", "10", "--data_dir", str(tmp_path)]
  with pytest.raises(ValueError, match="vocab_size = 10 must be"):
    prepare.main(["--dataset", "wikitext103", *flags])
  assert not os.listdir(tmp_path)


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
  path = _path(tmp_path, prepare.ENWIK8_NAME, "cache")
  assert store.is_complete(path) and not store.read_summary(path)["official"]
  _assert_bytes_right(path)
  monkeypatch.setattr(sources, "build", None)  # reused: never built again
  flags = ["--manual_dir", str(tmp_path / "manual"), "--nodownload", "--quiet"]
  assert prepare.main(["--dataset", "enwik8", *flags]) == EXPECTED
  out, err = capsys.readouterr()
  assert json.loads(out.strip().splitlines()[-1]) == EXPECTED and path in err


def test_real_size_is_official_and_yes_requires_it_and_a_changed_source_is_prepared_again(
  tmp_path, monkeypatch, caplog
):
  fe.write_file(str(tmp_path / "manual"), fe.content(N))
  with pytest.raises(prepare.CountMismatchError, match="5,003 bytes, not the 100,000,000"):
    _main(tmp_path, "enwik8", "--official", "yes")
  assert not store.is_complete(_path(tmp_path, prepare.ENWIK8_NAME))
  with monkeypatch.context() as m, caplog.at_level(logging.WARNING):
    m.setattr(enwik8, "NUM_BYTES", N)  # the fake file "is" the real one
    assert _main(tmp_path, "enwik8", "--official", "yes") == EXPECTED
  assert "custom" not in caplog.text
  assert store.read_summary(_path(tmp_path, prepare.ENWIK8_NAME))["official"] is True
  fe.write_file(str(tmp_path / "manual"), fe.content(2 * N))  # a new file, same place
  assert _main(tmp_path, "enwik8")["tokens"]["test"] == 2 * N // 20
  os.remove(tmp_path / "manual" / "enwik8")  # no source: the prepared data is reused
  assert _main(tmp_path, "enwik8")["tokens"]["test"] == 2 * N // 20


def test_prepare_waits_for_the_lock_held_through_another_open_file(tmp_path):
  fe.write_file(str(tmp_path / "manual"), fe.content(N))
  path, done = _path(tmp_path, prepare.ENWIK8_NAME), threading.Event()

  def run():
    _main(tmp_path, "enwik8")
    done.set()

  thread = threading.Thread(target=run)
  with store.lock(path, "x"):
    thread.start()
    assert not done.wait(timeout=0.5)
  thread.join(timeout=60)
  listing = sorted(os.listdir(tmp_path / "data" / "prepared"))
  assert done.is_set() and listing == ["enwik8-byte", "enwik8-byte.lock"]  # no lock folder
  _assert_bytes_right(path)


# Where the cut falls (inside the ids, the .npy header, nothing left, no file), or a zero id more.
CUTS = {"ids": -100, "header": 50, "empty": 0, "missing": None, "longer": 4}  # size, or change


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_truncated_split_names_the_file_and_prepare_rebuilds_it(tmp_path, caplog, cut):
  fe.write_file(str(tmp_path / "manual"), fe.content(N))
  assert _main(tmp_path, "enwik8") == EXPECTED
  path = _path(tmp_path, prepare.ENWIK8_NAME)
  split = os.path.join(path, "validation.npy")
  if cut == "missing":
    os.remove(split)
  else:
    size = CUTS[cut] if cut in ("header", "empty") else os.path.getsize(split) + CUTS[cut]
    os.truncate(split, size)
  with pytest.raises(store.DamagedCorpusError) as info:
    corpus_lib.load_prepared(path)
  msg = str(info.value)
  assert isinstance(info.value, ValueError) and "\n" not in msg
  assert split in msg and f"delete {path}" in msg and ("is missing" in msg) == (cut == "missing")
  with caplog.at_level(logging.WARNING):
    assert _main(tmp_path, "enwik8") == EXPECTED  # a rerun prepares it again
  assert "validation.npy" in caplog.text and "preparing it again" in caplog.text
  _assert_bytes_right(path)


def test_stale_incomplete_builds_are_removed(tmp_path):
  """A build killed mid-way leaves TFDS's temporary folder; the next build removes it."""
  fe.write_file(str(tmp_path / "manual"), fe.content(N))
  config_dir = tmp_path / "data" / "tfds" / "enwik8" / "bytes"
  # TFDS's name (tensorflow_datasets.core.utils.file_utils._get_incomplete_dir).
  stale = config_dir / "incomplete.Q7ZK2B_1.0.0"
  other_version = config_dir / "incomplete.Q7ZK2B_0.9.0"
  for d in (stale, other_version):
    d.mkdir(parents=True)
    (d / "enwik8-train.array_record-00000-of-00001").write_bytes(b"x" * 1_000)
  assert _main(tmp_path, "enwik8") == EXPECTED
  assert sorted(p.name for p in config_dir.iterdir()) == ["1.0.0", "1.0.0.lock", other_version.name]
  _assert_bytes_right(_path(tmp_path, prepare.ENWIK8_NAME))
