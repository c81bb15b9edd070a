"""Your own files as a corpus, subword vocabularies, and each bad input as one line naming it."""

import glob
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from aft_jax.data import corpus as corpus_lib
from aft_jax.data import load_corpus, prepare, store, subword, text
from aft_jax.data.config import DataConfig
from tests.support.helpers import STDLIB_JSON, with_default_sigint


def _load(tmp_path, **cfg):
  # Checked as the run config checks it (load_corpus itself checks no config).
  cfg = DataConfig(dataset="text", data_dir=str(tmp_path / "data"), **cfg).validate()
  return load_corpus(cfg)


def _files(**cfg):
  return text.split_files(DataConfig(dataset="text", **cfg))


def test_documents_are_split_by_file_with_a_boundary_after_each(docs, tmp_path):
  corpus = _load(tmp_path, train_files=str(docs / "*.py"), tokenizer="byte")
  files = _files(train_files=str(docs / "*.py"))
  assert {s: len(f) for s, f in files.items()} == {"train": 3, "validation": 1, "test": 1}
  for split, paths in files.items():
    want = b"".join(open(p, "rb").read() + b"\n" for p in paths)  # bytes: the boundary is '\n'
    np.testing.assert_array_equal(corpus.splits[split], np.frombuffer(want, np.uint8))
    assert corpus.num_bytes[split] == len(want)
  # The held-out documents depend on the paths below the common folder, not where it is.
  moved = tmp_path / "elsewhere" / "deeper"
  shutil.copytree(docs, moved)
  names = lambda files: {s: [os.path.basename(p) for p in f] for s, f in files.items()}  # noqa: E731
  assert names(_files(train_files=str(moved / "*.py"))) == names(files)


def test_subword_vocabulary_is_learned_on_train_only_deterministically(docs, tmp_path, capsys):
  """Prepared by `aft-prepare` (its last line the summary), then loaded as it prepared it."""
  cfg = dict(train_files=str(docs / "*.py"), tokenizer="subword", vocab_size=400)
  assert corpus_lib.vocab_size(DataConfig("text", **cfg))[0] == 400  # the dry run's
  flags = ["--tokenizer", "subword", "--vocab_size", "400", "--train_files", str(docs / "*.py")]
  summary = prepare.main(["--dataset", "text", *flags, "--data_dir", str(tmp_path / "data")])
  assert json.loads(capsys.readouterr().out.splitlines()[-1]) == summary
  corpus = _load(tmp_path, **cfg)
  assert corpus.vocab.size == summary["vocab_size"] == 400 and corpus.unit == "subword"
  assert {s: int(t.size) for s, t in corpus.splits.items()} == summary["tokens"]
  files = _files(**cfg)
  train_docs = [open(p).read() for p in files["train"]]
  assert subword.train(train_docs, 400).sha256 == corpus.vocab.sha256  # the same model bytes
  with_held_out = subword.train(train_docs + [open(p).read() for p in files["test"]], 400)
  assert with_held_out.sha256 != corpus.vocab.sha256  # so held-out text would show
  eos = corpus.vocab.eos_id
  for split, paths in files.items():
    ids = corpus.splits[split]
    assert int(np.sum(ids == eos)) == len(paths) and ids[-1] == eos  # one boundary per file
    assert corpus.vocab.decode(ids[: list(ids).index(eos)]) == open(paths[0]).read()
  model = os.path.join(os.path.dirname(corpus.splits["train"].filename), subword.MODEL_FILENAME)
  with open(model, "r+b") as f:  # a damaged prepared vocabulary is refused
    f.seek(100)
    f.write(b"\xff" * 8)
  with pytest.raises(ValueError, match=r"subword\.model is damaged: it does not match the SHA"):
    _load(tmp_path, **cfg)
  with pytest.raises(ValueError, match="is not a SentencePiece model"):
    subword.SubwordVocab(b"not a model")


def test_an_unchanged_corpus_is_reused_one_without_document_ends_or_changed_prepared_again(
  docs, tmp_path
):
  cfg = dict(train_files=str(docs / "*.py"), tokenizer="byte")
  first = _load(tmp_path, **cfg)
  out = os.path.dirname(first.splits["train"].filename)
  stamp = os.path.getmtime(os.path.join(out, store.MARKER))
  assert _load(tmp_path, **cfg).splits["train"].size == first.splits["train"].size
  assert os.path.getmtime(os.path.join(out, store.MARKER)) == stamp  # reused
  summary = store.read_summary(out)
  del summary[text.DOCUMENTS_KEY]  # as an earlier version wrote it
  store.finish(out, summary)
  again = _load(tmp_path, **cfg)  # prepares it again: packing needs the ends
  assert store.read_summary(out)[text.DOCUMENTS_KEY] is True
  np.testing.assert_array_equal(again.documents["train"], first.documents["train"])
  with open(_files(**cfg)["train"][0], "a") as f:
    f.write("# one more line\n")
  assert _load(tmp_path, **cfg).splits["train"].size == first.splits["train"].size + 16


def test_encoding_reads_files_that_are_not_utf8(tmp_path):
  for i in range(3):
    (tmp_path / f"{i}.txt").write_bytes(f"caf\xe9 num\xe9ro {i}\n".encode("latin-1"))
  splits = {
    f"{s}_files": str(tmp_path / f"{i}.txt") for i, s in enumerate(("train", "valid", "test"))
  }
  corpus = _load(tmp_path, encoding="latin-1", **splits)
  assert corpus.vocab.decode(corpus.splits["train"]) == "café numéro 0\n\n"


# Settings that give no corpus (given {d}, docs/ of five .py files, and {t}/link.py -> decoder.py).
SETTINGS = [
  ({"valid_files": "{t}/nothing*"}, r"config\.data\.valid_files: '.*nothing\*' matches no"),
  ({"train_files": "{t}/missing.txt"}, r"train_files: '.*missing\.txt' matches no file"),
  ({"train_files": "{d}/__init__.py,{d}/tool.py"}, "matches 2 file.*leaves none to train on"),
  ({"train_files": " , "}, r"config\.data\.train_files is empty"),
  ({"encoding": "klingon"}, r"config\.data\.encoding = 'klingon' is not an encoding"),
  ({"text_field": ""}, r"config\.data\.text_field is empty"),
  ({"tokenizer": "subword", "vocab_size": 50_000}, "vocab_size = 50000 is more pieces than the t"),
  ({"tokenizer": "subword", "vocab_size": 0}, r"vocab_size = 0 must be in \[300, "),
  # A file in two splits, whatever path reaches it.
  ({"train_files": "{d}/*n*.py", "valid_files": "{d}/decoder.py", "test_files": "{d}/decoder.py"},
   r"decoder\.py is in config\.data\.valid_files and in config\.data\.test_files \(1 such file"),
  ({"valid_files": "{t}/link.py", "test_files": "{d}/decoder.py"},
   r"decoder\.py is in config\.data\.train_files and in config\.data\.valid_files .*trained on"),
]  # fmt: skip


@pytest.mark.parametrize("settings, message", SETTINGS)
def test_settings_that_give_no_corpus_are_one_line_naming_the_key(
  docs, tmp_path, settings, message
):
  (tmp_path / "link.py").symlink_to(docs / "decoder.py")
  cfg = {"train_files": str(docs / "*.py")}
  for key, value in settings.items():
    cfg[key] = value.format(t=tmp_path, d=docs) if isinstance(value, str) else value
  with pytest.raises(ValueError, match=message) as e:
    _load(tmp_path, **cfg)
  assert "\n" not in str(e.value)
  assert not glob.glob(str(tmp_path / "data" / "prepared" / "*" / store.MARKER))


def test_wikitext103_takes_a_subword_vocabulary_learned_on_its_train_articles(tmp_path):
  from tests.support import fake_wikitext

  fake_wikitext.write_extracted(str(tmp_path / "manual"), "raw_v1")
  folders = dict(data_dir=str(tmp_path / "data"), manual_dir=str(tmp_path / "manual"))
  corpus = load_corpus(DataConfig("wikitext103", "subword", 330, variant="raw_v1", **folders))
  texts = fake_wikitext.texts("raw_v1")
  assert corpus.name == "wikitext103-raw_v1-subword330" and corpus.vocab.size == 330
  for split, ids in corpus.splits.items():
    # every article back exactly; the bytes for bits per byte: its text plus one per boundary
    decoded = corpus.vocab.decode(ids[:-1]).replace("\n\n", "")
    assert decoded == texts[split].replace("\n\n", "")
    assert corpus.num_bytes[split] == len(texts[split].encode()) + int(np.sum(ids == 1))


def test_globs_are_made_absolute_for_config_json(tmp_path, monkeypatch):
  from aft_jax.data.config import absolute_globs

  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  want = f"{tmp_path}/a/*.txt,{tmp_path}/home/b/**/*.md"
  assert absolute_globs(" a/*.txt, ~/b/**/*.md ,") == want and absolute_globs("") == ""


def test_a_recursive_glob_does_not_follow_folder_links_and_holds_out_real_files(tmp_path):
  root = tmp_path / "notes"  # 14 documents in three folders, and what must add none:
  for i in range(15):  # doc14: in a hidden folder
    folder = root / ("." if i < 5 else "sub" if i < 10 else "sub/deeper" if i < 14 else ".hid")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"doc{i}.md").write_text(f"document {i}\n")
  (root / "sub" / "loop").symlink_to("..")  # two loops: glob.glob would walk 2^40 paths
  (root / "sub" / "deeper" / "up").symlink_to("../..")
  (root / "alias").symlink_to("sub")
  (root / "link.md").symlink_to("doc0.md")
  found = text.expand(str(root / "**" / "*.md"), "train_files")
  assert sorted(os.path.basename(p) for p in found) == sorted(f"doc{i}.md" for i in range(14))
  assert len({os.path.realpath(p) for p in found}) == 14
  files = _files(train_files=str(root / "**" / "*.md"))
  real = {s: {os.path.realpath(p) for p in paths} for s, paths in files.items()}
  assert {s: len(r) for s, r in real.items()} == {"train": 12, "validation": 1, "test": 1}
  assert not real["train"] & (real["validation"] | real["test"])
  # A folder named before "**" may itself be a link; "dir/**" takes every file below.
  assert len(text.expand(str(root / "alias" / "**"), "train_files")) == 9


def test_a_line_over_64_kib_is_learned_from_not_left_out():
  """SentencePiece leaves out lines over 64 KiB (a minified file): learned from in pieces."""
  long_line = "zqxj " * 20_000  # 100,000 bytes on one line
  vocab = subword.train([open(p).read() for p in STDLIB_JSON] + [long_line], 400)
  assert any("zqxj" in vocab._sp.id_to_piece(i) for i in range(vocab.size))
  assert vocab.decode(vocab.encode(long_line)) == long_line  # still tokenised whole
  pieces = ["a", "é" * 16_384, "é" * 16_384, "é" * 7_232]
  assert list(subword._lines(["a\n\n" + "é" * 40_000])) == pieces


# SentencePiece's C++ training, which a Ctrl-C cannot stop (its thread is deaf to it), endless.
SLOW_SENTENCEPIECE = """
import signal, sys, time
import sentencepiece as spm
def train(sentence_iterator, **_):
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  list(sentence_iterator)  # reads the documents, as SentencePiece does first
  print("training", flush=True)
  time.sleep(600)
spm.SentencePieceTrainer.train = train
from aft_jax.data import prepare
sys.argv[1:] = ["--dataset", "text", "--tokenizer", "subword", "--vocab_size", "300", "--quiet",
                "--train_files", sys.argv[1], "--data_dir", sys.argv[2]]
prepare.cli()
"""


def test_ctrl_c_while_sentencepiece_trains_stops_aft_prepare_in_one_line(docs, tmp_path):
  """Exit status 130, nothing marked prepared, no temporary file."""
  data = tmp_path / "data"
  cmd = [sys.executable, "-c", SLOW_SENTENCEPIECE, str(docs / "*.py"), str(data)]
  pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  proc = subprocess.Popen(with_default_sigint(cmd), **pipes)
  try:
    assert proc.stdout.readline() == "training\n", proc.stderr.read()[-2000:]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  lines = [line for line in err.splitlines() if line.strip()]
  assert proc.returncode == 130 and len(lines) == 1, err[-2000:]
  assert lines[0].startswith("aft-prepare: interrupted (Ctrl-C): nothing was marked prepared")
  written = [f for _, _, fs in os.walk(data) for f in fs]
  assert store.MARKER not in written and not [f for f in written if ".tmp-" in f], written


def _write_jsonl(path, texts, field="text"):
  with (gzip.open if str(path).endswith(".gz") else open)(path, "wt", encoding="utf-8") as f:
    for i, t in enumerate(texts):
      f.write(json.dumps({"id": i, field: t}) + "\n")
      if i == 0:
        f.write("\n")  # a blank line is no record


def _write_parquet(path, columns, dictionary=False):
  import pyarrow as pa
  import pyarrow.parquet as pq

  columns = {k: pa.array(v).dictionary_encode() if dictionary else v for k, v in columns.items()}
  pq.write_table(pa.table(columns), path, row_group_size=2)


def test_jsonl_and_parquet_records_give_the_tokens_of_the_same_texts_as_files(docs, tmp_path):
  """The same texts as files and as records (a pandas category column too): the same tokens."""
  paths = sorted(str(p) for p in docs.glob("*.py"))
  texts = [open(p).read() for p in paths]
  plain = _load(
    tmp_path / "plain", train_files=",".join(paths[:3]), valid_files=paths[3],
    test_files=paths[4], tokenizer="word",
  )  # fmt: skip
  rec = tmp_path / "records"
  rec.mkdir()
  _write_jsonl(rec / "train-1.jsonl.gz", texts[:2], field="body")
  _write_parquet(rec / "train-2.parquet", {"n": [0], "body": texts[2:3]})  # not the first column
  _write_jsonl(rec / "valid.jsonl", texts[3:4], field="body")
  _write_parquet(rec / "test.parquet", {"body": texts[4:]}, dictionary=True)
  records = _load(
    tmp_path / "rec", train_files=f"{rec}/train-1.jsonl.gz,{rec}/train-2.parquet",
    valid_files=f"{rec}/valid.jsonl", test_files=f"{rec}/test.parquet", tokenizer="word",
    text_field="body",
  )  # fmt: skip
  assert records.vocab.size == plain.vocab.size
  for split in text.SPLITS:
    np.testing.assert_array_equal(records.splits[split], plain.splits[split])
    np.testing.assert_array_equal(records.documents[split], plain.documents[split])
    assert records.num_bytes[split] == plain.num_bytes[split]
  ends = plain.documents["train"]  # just past each boundary: three documents, the last at the end
  assert len(ends) == 3 and ends[-1] == plain.splits["train"].size
  assert (plain.splits["train"][ends - 1] == plain.vocab.eos_id).all()


# (file, its content (a dict: Parquet columns), the message)
BAD_FILES = [
  ("empty.txt", b"  \n\n", r"empty\.txt is empty \(no text\)"),
  ("latin.txt", b"caf\xe9\n", r"latin\.txt is not utf-8 text \(byte 3: .*config\.data\.encoding"),
  ("binary.txt", b"\x00\x01\x02abc", r"binary\.txt is not text \(it holds NUL bytes\)"),
  (
    "a.jsonl",
    '{"text": "ok"}\n{"text": "cut\n',
    r"line 2 is not JSON \(Invalid control char.*14\)",
  ),
  ("b.jsonl", '{"text": "ok"}\n\n{"body": "x"}\n', r"b\.jsonl line 3 has no field 'text' .*'body'"),
  ("c.jsonl", '{"text": 3}\n', r"c\.jsonl line 1: field 'text' is a JSON number, not a str"),
  ("d.jsonl", '["text"]\n', r"d\.jsonl line 1 is a JSON array, not an object"),
  ("e.jsonl", '{"text": "a"}\nnull\n', r"e\.jsonl line 2 is JSON null, not an object"),
  ("k.jsonl", '{"text": "a\\u0000b"}\n', r"k\.jsonl line 1: field 'text' holds a NUL char"),
  ("l.jsonl", '{"text": "ab\\ud800"}\n', r"l\.jsonl line 1: field 'text' holds a lone surr"),
  ("f.jsonl", "\n\n", r"f\.jsonl holds no records"),
  ("g.jsonl.gz", b"\x1f\x8bnot gzip", r"g\.jsonl\.gz cannot be read \(.*damaged or truncated"),
  ("g.parquet", {"body": ["x"]}, r"g\.parquet has no column 'text' .*'body'"),
  ("h.parquet", {"text": [1, 2]}, r"h\.parquet: column 'text' holds int64, not strings"),
  ("i.parquet", {"text": ["a", "b", "c", None]}, r"i\.parquet row group 1 row 1: 'text' is null"),
  ("j.parquet", b"PAR1 not parquet", r"j\.parquet is not a readable Parquet file"),
  ("m.parquet", {"text": ["a", "b", "c\0"]}, r"m\.parquet row group 1 row 0: 'text' holds a NUL"),
]


@pytest.mark.parametrize("name, content, message", BAD_FILES)
def test_a_bad_file_or_record_is_one_line_naming_file_and_line_or_row_group(
  docs, tmp_path, name, content, message
):
  path = docs / name
  if isinstance(content, dict):
    _write_parquet(path, content)
  else:
    path.write_bytes(content.encode() if isinstance(content, str) else content)
  with pytest.raises(text.TextError, match=message) as e:
    _load(tmp_path, train_files=f"{docs}/*.py,{path}", tokenizer="byte")
  assert "\n" not in str(e.value)
  assert not glob.glob(str(tmp_path / "data" / "prepared" / "*" / store.MARKER))
