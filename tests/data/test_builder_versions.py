"""Each version of each corpus builder (``store.BUILDERS``) still makes the tokens recorded for it
here: a change to a builder's tokens fails until it is a new version (in BUILDERS and COUNTS)."""

import pytest

from aft_jax.data import load_corpus, store
from aft_jax.data.config import DataConfig
from tests.support import fake_enwik8 as fe
from tests.support import fake_wikitext as fw

# (dataset, tokenizer, builder version) -> (vocabulary size, {split: tokens}) on the files below.
COUNTS = {
  ("enwik8", "byte", 1): (256, {"train": 4503, "validation": 250, "test": 250}),
  ("pydoc", "byte", 1): (256, {"train": 3201, "validation": 372, "test": 382}),
  ("pydoc", "byte", 2): (256, {"train": 2059, "validation": 250, "test": 264}),
  ("pydoc", "word", 1): (104, {"train": 862, "validation": 93, "test": 103}),
  ("pydoc", "word", 2): (95, {"train": 630, "validation": 74, "test": 78}),
  ("text", "byte", 1): (256, {"train": 3291, "validation": 433, "test": 425}),
  ("text", "subword", 1): (290, {"train": 3051, "validation": 409, "test": 393}),
  ("text", "word", 1): (72, {"train": 721, "validation": 97, "test": 97}),
  ("wikitext103", "byte", 1): (256, {"train": 895, "validation": 325, "test": 222}),
  ("wikitext103", "word", 1): (99, {"train": 194, "validation": 80, "test": 53}),
}

# pydoc_data's topics (they differ between Pythons): tables, rules and grammar version 2 drops.
TABLE = "+------+-----+\n| x    | y   |\n+------+-----+\n   list_display ::= [items]\n"
TOPICS = {
  f"topic{i:02}": f"Topic {i}\n********\n\nItem {i} of a list is read after item {i - 1}.\n"
  + (TABLE if i % 3 == 0 else f"   >>> {i} ** 2\n   {i * i}\n")
  for i in range(40)
}
# Documents (one per line) of the train, validation and test files.
TEXT = {
  split: "".join(f"Line {i} of the {split} text: every token is scored once.\n" for i in range(n))
  for split, n in (("train", 60), ("valid", 8), ("test", 8))
}


def _config(dataset, tokenizer, tmp_path, monkeypatch) -> DataConfig:
  data, manual = str(tmp_path / "data"), str(tmp_path / "manual")
  if dataset == "pydoc":
    from pydoc_data import topics

    monkeypatch.setattr(topics, "topics", TOPICS)
    return DataConfig(dataset="pydoc", tokenizer=tokenizer)
  if dataset == "text":
    files = {}
    for split, text in TEXT.items():
      (tmp_path / f"{split}.txt").write_text(text)
      files[f"{split}_files"] = str(tmp_path / f"{split}.txt")
    size = 290 if tokenizer == "subword" else 0
    return DataConfig(dataset="text", tokenizer=tokenizer, data_dir=data, vocab_size=size, **files)
  if dataset == "enwik8":
    fe.write_file(manual, fe.content(5_003))
    return DataConfig(dataset="enwik8", tokenizer="byte", data_dir=data, manual_dir=manual)
  variant = "v1" if tokenizer == "word" else "raw_v1"
  fw.write_extracted(manual, variant)
  return DataConfig("wikitext103", tokenizer, variant=variant, data_dir=data, manual_dir=manual)


def test_the_table_has_every_version_of_every_builder():
  versions = {(d, v) for d in store.BUILDERS for v in range(1, store.version(d) + 1)}
  assert {(d, v) for d, _, v in COUNTS} == versions


@pytest.mark.parametrize("dataset, tokenizer, version", sorted(COUNTS))
def test_each_version_of_each_builder_makes_its_recorded_tokens(
  dataset, tokenizer, version, tmp_path, monkeypatch
):
  if dataset != "pydoc" and version != store.version(dataset):
    pytest.skip("a prepared corpus is built by today's version only (older runs are refused)")
  corpus = load_corpus(_config(dataset, tokenizer, tmp_path, monkeypatch), version)
  got = (corpus.vocab.size, {s: int(t.size) for s, t in corpus.splits.items()})
  assert corpus.builder_version == version and got == COUNTS[dataset, tokenizer, version]


def test_a_corpus_prepared_by_another_version_of_its_builder_is_prepared_again(
  tmp_path, monkeypatch
):
  cfg = _config("text", "byte", tmp_path, monkeypatch)
  path = store.prepared_dir(cfg.data_dir, load_corpus(cfg).name)
  store.finish(path, {**store.read_summary(path), store.VERSION_KEY: 0})  # another version's
  assert load_corpus(cfg).builder_version == store.version("text")
  assert store.read_summary(path)[store.VERSION_KEY] == store.version("text")
