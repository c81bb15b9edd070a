"""`python -m aft_jax.data.prepare` and `load_corpus` on fake WikiText-103."""

import collections
import errno
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.support import prefork
from tests.support import fake_wikitext as fw
from aft_jax.data import corpus as corpus_lib
from aft_jax.data import prepare
from aft_jax.data import sources, store
from aft_jax.data import wikitext103
from aft_jax.data.config import DataConfig

SPLITS = ("train", "validation", "test")


@pytest.fixture(autouse=True)
def _no_network(monkeypatch, tmp_path):
  monkeypatch.setattr(wikitext103, "MIRRORS", [f"file://{tmp_path}/no-mirror/{{filename}}"])


def _protocol_tokens(text):
  """Independent reference: lines split on '\\n', each split on whitespace + <eos>."""
  assert text.endswith("\n")
  return [tok for line in text.split("\n")[:-1] for tok in line.split() + ["<eos>"]]


def _expected_word_summary(variant):
  texts = fw.texts(variant)
  vocab = set(_protocol_tokens(texts["train"])) | {"<eos>"}
  if variant == "raw_v1":
    vocab.add("<unk>")
  return {"vocab_size": len(vocab), "tokens": {s: len(_protocol_tokens(texts[s])) for s in SPLITS}}


def _args(tmp_path, *extra):
  folders = ["--data_dir", str(tmp_path / "data"), "--manual_dir", str(tmp_path / "manual")]
  return ["--dataset", "wikitext103", *folders, "--nodownload", "--quiet", *extra]


def _run(tmp_path, *extra):
  """main() in-process; returns the summary it printed."""
  return prepare.main(_args(tmp_path, *extra))


def _path(tmp_path, name="wikitext103-v1-word"):
  return store.prepared_dir(str(tmp_path / "data"), name)


def test_cli_prints_counts_as_last_line_and_reuses(tmp_path):
  fw.write_extracted(str(tmp_path / "manual"), "v1")
  cmd = [sys.executable, "-m", "aft_jax.data.prepare", *_args(tmp_path)[:-1]]  # progress bars
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
  run = lambda: subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)  # noqa: E731
  first, second = run(), run()
  assert first.returncode == 0 and "articles" in first.stderr, first.stderr  # tqdm progress
  assert json.loads(first.stdout.splitlines()[-1]) == _expected_word_summary("v1")
  assert second.returncode == 0 and "Reusing" in second.stderr, second.stderr
  assert second.stdout.splitlines()[-1] == first.stdout.splitlines()[-1]


@pytest.mark.parametrize("variant", ["v1", "raw_v1"])
def test_word_ids_follow_the_protocol(tmp_path, capsys, variant):
  fw.write_extracted(str(tmp_path / "manual"), variant)
  summary = _run(tmp_path, "--variant", variant)
  assert summary == _expected_word_summary(variant)
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
  path = _path(tmp_path, f"wikitext103-{variant}-word")
  c = corpus_lib.load_prepared(path)
  assert c.unit == "word" and c.vocab.size == summary["vocab_size"] and c.bos_id == c.vocab.eos_id
  vocab_file = open(os.path.join(path, "vocab.txt"), encoding="utf-8").read().split("\n")[:-1]
  assert vocab_file == c.vocab.tokens
  # Frequency order with ties by string.
  counts = collections.Counter(_protocol_tokens(fw.texts(variant)["train"]))
  ranked = [t for t in c.vocab.tokens if t in counts]
  assert ranked == sorted(counts, key=lambda t: (-counts[t], t))
  for s in SPLITS:
    ids = c.splits[s]
    assert ids.dtype == np.uint32 and ids.ndim == 1
    words = [c.vocab.tokens[i] for i in ids]
    ref = _protocol_tokens(fw.texts(variant)[s])
    if variant == "v1":
      assert words == ref
    else:  # raw: held-out words unseen in train become <unk>
      train_vocab = set(c.vocab.tokens)
      assert words == [w if w in train_vocab else "<unk>" for w in ref]
  if variant == "raw_v1":
    assert "<unk>" in [c.vocab.tokens[i] for i in c.splits["test"]]  # 'Herons' is not in train


def test_byte_tokenizer_uses_raw_text(tmp_path):
  fw.write_extracted(str(tmp_path / "manual"), "raw_v1")
  summary = _run(tmp_path, "--tokenizer", "byte")
  raw = {s: fw.split_text(s, raw=True).encode("utf-8") for s in SPLITS}
  assert summary == {"vocab_size": 256, "tokens": {s: len(raw[s]) for s in SPLITS}}
  c = corpus_lib.load_prepared(_path(tmp_path, "wikitext103-raw_v1-byte"))
  assert c.unit == "byte" and c.bos_id == ord("\n")
  for s in SPLITS:
    assert c.splits[s].astype(np.uint8).tobytes() == raw[s]
  assert not os.path.exists(os.path.join(_path(tmp_path, "wikitext103-raw_v1-byte"), "vocab.txt"))


def test_rerun_reuses_without_source_or_tfds(tmp_path, monkeypatch, capsys):
  fw.write_extracted(str(tmp_path / "manual"), "v1")
  first, path = _run(tmp_path), _path(tmp_path)
  mtimes = {p: os.path.getmtime(os.path.join(path, p)) for p in os.listdir(path)}
  monkeypatch.setattr(wikitext103, "build", None)  # never built again
  assert _run(tmp_path) == first
  assert {p: os.path.getmtime(os.path.join(path, p)) for p in os.listdir(path)} == mtimes


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


def _data_config(tmp_path, tokenizer: str, variant: str):
  folders = dict(data_dir=str(tmp_path / "data"), manual_dir=str(tmp_path / "manual"))
  return DataConfig(dataset="wikitext103", tokenizer=tokenizer, variant=variant, **folders)


def test_partial_npy_is_never_visible(tmp_path):
  path = str(tmp_path / "p")
  store.start(path)

  def chunks():
    yield np.arange(5, dtype=np.uint32)
    raise RuntimeError("crash while encoding")

  with pytest.raises(RuntimeError):
    store.write_tokens(path, "train", chunks())
  assert os.listdir(path) == []


def test_a_split_is_written_as_numpy_saves_it(tmp_path):
  path = str(tmp_path / "p")
  store.start(path)
  chunks = [np.arange(5, dtype=np.uint32), np.frombuffer(b"ab", np.uint8), np.zeros(0, np.uint32)]
  assert store.write_tokens(path, "train", chunks) == 7
  np.save(tmp_path / "want.npy", np.concatenate([c.astype(np.uint32) for c in chunks]))
  assert open(os.path.join(path, "train.npy"), "rb").read() == (tmp_path / "want.npy").read_bytes()


def test_a_full_disk_is_one_error_naming_the_size_and_leaves_no_temporary_file(
  tmp_path, monkeypatch
):
  """Too little space up front, or a disk that fills meanwhile (the temporary file is /dev/full,
  where every write fails with ENOSPC): one DiskFullError, and the folder holds nothing."""
  from aft_jax import files

  path = str(tmp_path / "p")
  store.start(path)
  chunks = [np.arange(1_000_000, dtype=np.uint32)]
  want = f"no space left on device: needs ~5 MB at {path}/train.npy"
  usage = shutil.disk_usage(path)
  monkeypatch.setattr(files.shutil, "disk_usage", lambda p: usage._replace(free=3_000_000))
  with pytest.raises(files.DiskFullError) as e:
    store.write_tokens(path, "train", chunks)
  assert str(e.value) == want and e.value.errno == errno.ENOSPC and os.listdir(path) == []
  monkeypatch.undo()
  os.symlink("/dev/full", os.path.join(path, f"train.npy.tmp-{os.getpid()}.npy"))
  with pytest.raises(files.DiskFullError, match=want):
    store.write_tokens(path, "train", chunks)
  assert os.listdir(path) == []


DISK_FULL = """
import shutil, sys
from aft_jax.data import prepare
usage = shutil.disk_usage(sys.argv[1])
shutil.disk_usage = lambda path: usage._replace(free=1000)  # a full disk, without filling one
data_dir, train_files = sys.argv[1:]
sys.argv[1:] = ["--dataset", "text", "--train_files", train_files, "--data_dir", data_dir]
sys.argv.append("--quiet")
prepare.cli()
"""


def test_aft_prepare_on_a_full_disk_is_one_line(tmp_path):
  data = tmp_path / "data"
  data.mkdir()
  files = os.path.join(os.path.dirname(os.__file__), "json", "*.py")
  cmd = [sys.executable, "-c", DISK_FULL, str(data), files]
  done = prefork.run(cmd, capture_output=True, text=True, timeout=120)
  lines = [line for line in done.stderr.splitlines() if line.strip()]
  assert done.returncode == 1 and len(lines) == 1, done.stderr[-2000:]
  assert lines[0].startswith("error: DiskFullError: no space left on device: needs ~"), lines[0]
  assert not [f for _, _, fs in os.walk(data) for f in fs if ".tmp-" in f]


def test_load_corpus_prepares_when_missing(tmp_path):
  fw.write_extracted(str(tmp_path / "manual"), "raw_v1")
  c = corpus_lib.load_corpus(_data_config(tmp_path, "byte", "v1"))
  assert c.name == "wikitext103-raw_v1-byte" and c.unit == "byte" and c.vocab.size == 256
  assert set(c.splits) == set(SPLITS)
  assert c.vocab.decode(c.splits["validation"]) == fw.split_text("validation", raw=True)


def _patch_official(monkeypatch, summary, lines):
  monkeypatch.setattr(prepare, "OFFICIAL_VOCAB_SIZE", summary["vocab_size"])
  monkeypatch.setattr(prepare, "OFFICIAL_TOKENS", dict(summary["tokens"]))
  monkeypatch.setattr(prepare, "OFFICIAL_LINES", dict(lines))


def _fake_lines():
  return {s: fw.texts("v1")[s].count("\n") for s in SPLITS}


def test_official_counts_are_checked_where_the_files_look_official(tmp_path, monkeypatch):
  assert prepare.OFFICIAL_VOCAB_SIZE == 267_735
  assert prepare.OFFICIAL_TOKENS == {"train": 103_227_021, "validation": 217_646, "test": 245_569}
  fw.write_extracted(str(tmp_path / "manual"), "v1")
  expected = _expected_word_summary("v1")
  with pytest.raises(prepare.CountMismatchError, match="expected 1,801,350"):
    _run(tmp_path, "--official", "yes")
  assert _run(tmp_path) == expected  # unflagged, the small fake data is not the real data
  assert store.read_summary(_path(tmp_path))["official"] is False
  # The fake data "is" the official release: line counts identify it, counts agree.
  _patch_official(monkeypatch, expected, _fake_lines())
  shutil.rmtree(_path(tmp_path))
  assert _run(tmp_path) == expected
  assert store.read_summary(_path(tmp_path))["official"] is True
  wrong = {"vocab_size": expected["vocab_size"], "tokens": {**expected["tokens"], "test": 245_569}}
  _patch_official(monkeypatch, wrong, _fake_lines())
  shutil.rmtree(_path(tmp_path))
  with pytest.raises(prepare.CountMismatchError, match="test: .* tokens, expected 245,569"):
    _run(tmp_path)
  assert not store.is_complete(_path(tmp_path))


def test_bad_source_data_propagates(tmp_path):
  fw.write_extracted(str(tmp_path / "manual"), "v1", {"test": b""})
  with pytest.raises(sources.BadSplitFileError, match="empty"):
    _run(tmp_path)
  assert not os.path.exists(_path(tmp_path))


def test_pydoc_cli(capsys):
  summary = prepare.main(["--dataset", "pydoc"])
  c = corpus_lib.pydoc_corpus("byte")
  assert summary == {"vocab_size": 256, "tokens": {s: int(c.splits[s].size) for s in SPLITS}}
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary


@pytest.mark.parametrize("keep_prepared", [True, False])
def test_changed_source_is_prepared_again(tmp_path, keep_prepared):
  """Neither prepared/ nor the TFDS build under tfds/ is reused once the source changed."""
  fw.write_extracted(str(tmp_path / "manual"), "v1")
  first, path = _run(tmp_path), _path(tmp_path)
  if not keep_prepared:
    shutil.rmtree(path)
  extra = " = Added = \n \n a new line of test text . \n"
  fw.write_extracted(str(tmp_path / "manual"), "v1", {"test": fw.texts("v1")["test"] + extra})
  second = _run(tmp_path)
  assert second["tokens"]["test"] == first["tokens"]["test"] + len(_protocol_tokens(extra))
  assert store.read_summary(path)["source_fingerprint"].startswith("size+ends-sha256:")


def test_half_truncated_official_file_is_an_error_under_auto(tmp_path, monkeypatch):
  """A truncated wiki.train.tokens beside intact valid/test files is not a custom corpus."""
  fw.write_extracted(str(tmp_path / "manual"), "v1")
  _patch_official(monkeypatch, _expected_word_summary("v1"), _fake_lines())  # fake == official
  train = tmp_path / "manual" / "wikitext-103" / "wiki.train.tokens"
  text = train.read_bytes()
  train.write_bytes(text[: text.index(b"\n", len(text) // 2) + 1])  # cut at a line end
  with pytest.raises(prepare.CountMismatchError, match="look truncated or modified") as info:
    _run(tmp_path)
  assert "--official no" in str(info.value) and "train: " in str(info.value)
  path = _path(tmp_path)
  assert not store.is_complete(path)
  # Asked for explicitly, the same files are a custom corpus in the official layout.
  full = _expected_word_summary("v1")["tokens"]["train"]
  assert 0 < _run(tmp_path, "--official", "no")["tokens"]["train"] < full
  assert store.read_summary(path)["official"] is False


@pytest.mark.parametrize(
  "flags, message",
  [
    (
      ["wikitext103", "--tokenizer", "subword", "--vocab_size", "10"],
      r"vocab_size = 10 must be in",
    ),
    (["pydoc", "--tokenizer", "subword"], r"tokenizer = 'subword': pydoc is bytes or words"),
    (["text", "--train_files", " , "], r"config\.data\.train_files is empty"),
  ],
)
def test_the_command_line_is_checked_as_a_config_is(tmp_path, flags, message):
  with pytest.raises(ValueError, match=message) as e:
    prepare.main(["--dataset", *flags, "--data_dir", str(tmp_path)])
  assert "\n" not in str(e.value) and not os.listdir(tmp_path)
