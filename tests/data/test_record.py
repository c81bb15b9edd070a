"""aft_jax.data.record: what a run records of its corpus, and one line naming what changed."""

import hashlib
import re

import pytest

from aft_jax.data import pydoc_corpus, record
from aft_jax.data.config import DataConfig


def _sources(docs):
  return record.sources(DataConfig("text", "byte", train_files=str(docs / "*.py")))


def test_a_same_size_edit_near_an_end_is_seen_and_many_changes_are_counted(docs):
  saved = {"sources": _sources(docs)}
  record.check_sources(saved, _sources(docs), "x")  # nothing changed: no refusal
  files = sorted(p for split in saved["sources"].values() for p in split)
  for path in files:  # every file: the same size, one byte changed at its end
    data = bytearray(open(path, "rb").read())
    data[-2] ^= 1
    open(path, "wb").write(bytes(data))
  with pytest.raises(record.DataChanged) as e:
    record.check_sources(saved, _sources(docs), "the checkpoint at step 3")
  line = str(e.value)
  assert "\n" not in line and line.startswith("the data changed since the checkpoint at step 3: ")
  assert len(re.findall(r" file \S+ changed", line)) == 3
  assert f"; and {len(files) - 3} more change(s);" in line


def test_the_record_of_a_corpus_names_its_vocabulary_and_tokens(tmp_path):
  words = pydoc_corpus("word")
  saved = record.of_corpus(words)
  path = tmp_path / "vocab.txt"
  words.vocab.save(str(path))
  assert saved["vocab_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
  assert saved["tokens"] == {s: len(t) for s, t in words.splits.items()}
  assert "vocab_sha256" not in record.of_corpus(pydoc_corpus("byte"))  # bytes: no file
  record.check_corpus(saved, record.of_corpus(words), "x")  # the same corpus: no refusal
  other = dict(saved, vocab_sha256="0" * 64)
  with pytest.raises(record.DataChanged, match=r"the word vocabulary is another one \(SHA-256"):
    record.check_corpus(other, saved, "x")
  with pytest.raises(record.DataChanged, match="the vocabulary has 256 entries, had"):
    record.check_corpus(saved, record.of_corpus(pydoc_corpus("byte")), "x")
  fewer = dict(saved, tokens=dict(saved["tokens"], train=saved["tokens"]["train"] - 1))
  with pytest.raises(record.DataChanged, match=r"the train split has [\d,]+ tokens, had"):
    record.check_corpus(fewer, saved, "x")
  # A record written before some keys existed is compared on the keys both have.
  record.check_corpus({"tokenizer": "word", "vocab_size": words.vocab.size}, saved, "x")
