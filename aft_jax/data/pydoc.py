"""The pydoc corpus' text (CPython's documentation without its layout lines), split at line ends
into train, test and validation pieces, and their token ids (docs/data.md, "pydoc")."""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from aft_jax.data import store
from aft_jax.data import vocab as vocab_lib

PYDOC_FRACTIONS = {"train": 0.8, "test": 0.1, "validation": 0.1}  # in text order

# Lines that are layout, not language: rules and table borders (`-----`, `+===+===+`), table
# rows and grammar alternatives (`| ...`), and grammar productions (`name ::= ...`).
_LAYOUT_LINE = re.compile(r"\s*(?:[-=~^*_+| ]{3,}|[|+].*|.*::=.*)\s*")


def pydoc_text(version: int | None = None) -> str:
  """CPython's pydoc topic texts, concatenated in sorted-key order, without layout lines (on
  which a small model would spend its capacity); version 1 of the builder kept them."""
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top

  raw = "".join(topics.topics[k] for k in sorted(topics.topics))
  if version == 1:
    return raw
  return "".join(
    line for line in raw.splitlines(keepends=True) if not _LAYOUT_LINE.fullmatch(line.strip())
  )


def split_at_lines(text: str, fractions: Mapping[str, float]) -> dict[str, str]:
  """Consecutive pieces of `text` of about the given fractions, cut after a '\\n' (so that the
  pieces' word streams concatenate to the text's)."""
  pieces, start, acc = {}, 0, 0.0
  for i, name in enumerate(fractions):
    acc += fractions[name]
    nl = text.find("\n", int(round(acc * len(text))))
    end = len(text) if i == len(fractions) - 1 or nl < 0 else nl + 1
    pieces[name] = text[start:end]
    start = end
  return pieces


def pydoc_splits(tokenizer="byte", version=None) -> tuple[vocab_lib.Vocab, dict[str, np.ndarray]]:
  """(vocabulary, {split: ids}) of the pydoc text as builder ``version`` (None: today's) made it:
  bytes, or words of train plus ``<unk>``."""
  pieces = split_at_lines(pydoc_text(version), PYDOC_FRACTIONS)
  if tokenizer == "byte":
    vocab: vocab_lib.Vocab = vocab_lib.ByteVocab()
  elif tokenizer == "word":
    vocab = vocab_lib.WordVocab.build(vocab_lib.count_words([pieces["train"]]), add_unk=True)
  else:
    raise ValueError(f"tokenizer must be 'word' or 'byte', got {tokenizer!r}")
  splits = {name: vocab.encode(pieces[name]) for name in store.SPLITS}
  for name, ids in splits.items():
    if ids.size < 2:
      raise ValueError(f"pydoc {name} split is empty; this Python ships too little documentation")
  return vocab, splits
