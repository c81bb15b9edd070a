"""Word protocol, vocabulary order and files, byte tokenizer, pydoc corpus."""

import collections

import numpy as np
import pytest

from aft_jax.data import corpus as corpus_lib
from aft_jax.data import pydoc as pydoc_lib
from aft_jax.data import vocab as vocab_lib
from aft_jax.data.vocab import EOS, UNK, ByteVocab, WordVocab


TEXTS = ["", "\n", "a b\n", "a b", " a  b \n\n c\n", " \n = T = \n \n x <unk> y \n"]
TEXTS += ["tab\tsep\x0bvt\u3000ideographic\n\n\nend", "Café Zürich 東京\u2028line-sep\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_word_tokens_match_line_protocol(text):
  """The protocol the slow, obvious way: per line, split, then <eos>."""
  lines = text.split("\n")[:-1] if text.endswith("\n") else text.split("\n") if text else []
  assert vocab_lib.word_tokens(text) == [t for line in lines for t in line.split() + [EOS]]
  assert vocab_lib.word_tokens("a\n\n \nb\n") == ["a", EOS, EOS, EOS, "b", EOS]  # lone <eos>


def test_build_orders_by_frequency_then_string_and_adds_eos_and_unk_last():
  counts = collections.Counter({"b": 3, "a": 3, "c": 5, EOS: 4, "z": 1, "y": 1})
  reverse = collections.Counter(dict(reversed(list(counts.items()))))  # insertion order: none
  for c in (counts, reverse):
    assert WordVocab.build(c).tokens == ["c", EOS, "a", "b", "y", "z"]
  v = WordVocab.build(collections.Counter({"x": 2}), add_unk=True)
  assert v.tokens == ["x", EOS, UNK] and v.eos_id == 1


def test_encode_decode_and_oov():
  v = WordVocab.build(vocab_lib.count_words(["the cat sat\nthe dog\n"]), add_unk=True)
  ids = v.encode("the cat\nsat\n")
  assert ids.dtype == np.uint32
  assert [v.tokens[i] for i in ids] == ["the", "cat", EOS, "sat", EOS]
  assert v.decode(ids) == "the cat\nsat\n"
  assert v.tokens[v.encode("unseen\n")[0]] == UNK


def test_save_load_roundtrip(tmp_path):
  words = ["the", EOS, UNK, "Café", "東京", "@-@", "a\u200bb", "ſ"]
  path = str(tmp_path / "vocab.txt")
  WordVocab(words).save(path)
  assert open(path, encoding="utf-8").read() == "".join(w + "\n" for w in words)
  w = WordVocab.load(path)
  assert w.tokens == words and w.eos_id == 1 and w.tokens.index(UNK) == 2
  assert not list(tmp_path.glob("*.tmp*"))


@pytest.mark.parametrize(
  "make, message",
  [
    (lambda path: WordVocab([EOS, "a", "a"]), "duplicate tokens in vocabulary"),
    (lambda path: WordVocab(["a"]), "vocabulary has no '<eos>'"),
    (lambda path: WordVocab([EOS, "a b"]), "'a b' is empty or contains whitespace"),
    (lambda path: WordVocab.load(path), "is truncated"),  # (no final newline)
    (lambda path: WordVocab([EOS, "a"], unk=None).encode("a b\n"), "'b' is not in the vocab"),
    (lambda path: ByteVocab().decode([300]), r"byte ids must be in \[0, 255\], got range"),
  ],
)
def test_bad_vocabularies_and_ids_are_one_line_errors(tmp_path, make, message):
  path = tmp_path / "v.txt"
  path.write_text(f"{EOS}\na", encoding="utf-8")
  with pytest.raises(ValueError, match=message):
    make(str(path))


def test_byte_vocab():
  v, text = ByteVocab(), "naïve 東京\nx"
  ids = v.encode(text)
  assert ids.dtype == np.uint32 and ids.tolist() == list(text.encode("utf-8"))
  assert v.size == 256 and v.eos_id == 10 and v.unit == "byte"
  assert v.decode(ids) == text
  assert v.decode(ids[:7]) == "naïve " and "\ufffd" in v.decode(ids[:8])  # cut inside '東'


def test_pydoc_corpus_is_the_text_in_bytes_or_words_with_unk_only_for_held_out_words():
  c, text = corpus_lib.pydoc_corpus("byte"), pydoc_lib.pydoc_text()
  assert len(text) > 100_000 and c.unit == "byte" and c.bos_id == 10 and c.vocab.size == 256
  # Text order is train, test, validation (validation is the last 10%).
  joined = np.concatenate([c.splits["train"], c.splits["test"], c.splits["validation"]])
  assert joined.dtype == np.uint32 and joined.astype(np.uint8).tobytes() == text.encode("utf-8")
  assert 0.78 < c.splits["train"].size / joined.size < 0.82
  assert 0.08 < c.splits["validation"].size / joined.size < 0.12
  assert c.splits["train"][-1] == ord("\n") and c.splits["test"][-1] == ord("\n")
  a = corpus_lib.pydoc_corpus("word")
  assert a.unit == "word" and a.bos_id == a.vocab.eos_id
  pieces = pydoc_lib.split_at_lines(text, pydoc_lib.PYDOC_FRACTIONS)
  assert "".join(pieces.values()) == text
  unk = a.vocab.tokens.index(UNK)
  assert not (a.splits["train"] == unk).any()
  train_words = set(vocab_lib.word_tokens(pieces["train"]))
  valid = vocab_lib.word_tokens(pieces["validation"])
  expected_unk = sum(w not in train_words for w in valid)
  assert expected_unk > 0 and int((a.splits["validation"] == unk).sum()) == expected_unk
  assert a.splits["validation"].size == len(valid)
