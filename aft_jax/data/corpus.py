"""The corpus API the trainer uses: `load_corpus(cfg) -> Corpus`.

Datasets:
* 'pydoc': the documentation shipped with CPython (`pydoc_data.topics.topics`,
  ~465 KB, values concatenated in sorted-key order). Needs no download and no
  writes, builds in well under a second. Split at line ends into train (first
  80%), test (next 10%) and validation (last 10%) of the characters. Byte-level
  by default; word-level builds its vocabulary from train plus `<unk>`, and
  held-out words unseen in train become `<unk>` (so its word perplexity is not
  comparable with open-vocabulary numbers). The text depends on the Python
  version, so compare pydoc numbers only within one Python version.
* 'wikitext103': prepared by `aft_jax.data.prepare` into `cfg.data_dir` (run
  on first use), then memory-mapped.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

import numpy as np

from aft_jax.data import store
from aft_jax.data import vocab as vocab_lib

log = logging.getLogger(__name__)

PYDOC_FRACTIONS = {"train": 0.8, "test": 0.1, "validation": 0.1}  # in text order


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A tokenised corpus.

  Attributes:
    name: e.g. 'pydoc-byte', 'wikitext103-v1-word'.
    unit: 'word' (report perplexity) or 'byte' (report bits per byte).
    vocab: `.size`, `.encode(text) -> uint32[n]`, `.decode(ids) -> str`, `.eos_id`.
    splits: 'train', 'validation' and (here always) 'test' -> uint32[n] ids.
    bos_id: id fed as the context of a split's first token so that every
      token is predicted: `<eos>` for words (a split starts at a line start),
      ord('\\n') for bytes.
  """

  name: str
  unit: str
  vocab: vocab_lib.Vocab
  splits: Mapping[str, np.ndarray]
  bos_id: int


def _get(cfg, field: str, default=None):
  value = cfg.get(field, default) if isinstance(cfg, Mapping) else getattr(cfg, field, default)
  return default if value is None else value


def load_corpus(cfg) -> Corpus:
  """Corpus named by `cfg` (attributes or a mapping).

  Fields: dataset ('pydoc' | 'wikitext103'), tokenizer ('word' | 'byte'),
  data_dir, manual_dir (optional), variant ('v1' | 'raw_v1'; bytes always
  use raw_v1). WikiText-103 is prepared on first use (downloading unless the
  data is in manual_dir).
  """
  dataset = _get(cfg, "dataset", "pydoc")
  if dataset == "pydoc":
    return pydoc_corpus(_get(cfg, "tokenizer", "byte"))
  if dataset != "wikitext103":
    raise ValueError(f"cfg.dataset must be 'pydoc' or 'wikitext103', got {dataset!r}")
  from aft_jax.data import prepare  # pylint: disable=g-import-not-at-top

  tokenizer = _get(cfg, "tokenizer", "word")
  variant = prepare.resolve_variant(tokenizer, _get(cfg, "variant"))
  data_dir = _get(cfg, "data_dir", "")
  if not data_dir:
    raise ValueError("cfg.data_dir must be set for dataset='wikitext103'")
  path = store.prepared_dir(data_dir, prepare.corpus_name(variant, tokenizer))
  if not store.is_complete(path):
    prepare.prepare_wikitext103(
      data_dir, manual_dir=_get(cfg, "manual_dir") or None, variant=variant, tokenizer=tokenizer
    )
  return load_prepared(path)


def load_prepared(path: str) -> Corpus:
  """Corpus from a complete `prepare` output directory (ids memory-mapped)."""
  if not store.is_complete(path):
    raise FileNotFoundError(f"{path} is not a complete prepared corpus; run aft_jax.data.prepare")
  summary = store.read_summary(path)
  if summary["tokenizer"] == "word":
    vocab = vocab_lib.WordVocab.load(os.path.join(path, vocab_lib.VOCAB_FILENAME))
  else:
    vocab = vocab_lib.ByteVocab()
  if vocab.size != summary["vocab_size"]:
    raise ValueError(
      f"{path}: vocabulary has {vocab.size} entries, summary.json says {summary['vocab_size']}"
    )
  splits = {s: store.load_tokens(path, s, n) for s, n in summary["tokens"].items()}
  return Corpus(
    name=summary["name"], unit=vocab.unit, vocab=vocab, splits=splits, bos_id=vocab.eos_id
  )


def pydoc_text() -> str:
  """CPython's pydoc topic texts, concatenated in sorted-key order."""
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top

  return "".join(topics.topics[k] for k in sorted(topics.topics))


def split_at_lines(text: str, fractions: Mapping[str, float]) -> dict[str, str]:
  """Consecutive pieces of `text` of about the given fractions, cut after a '\\n'.

  Cutting at line ends keeps the word protocol identical on each piece and
  on the whole: the pieces' token streams concatenate to the text's stream.
  """
  pieces, start, acc = {}, 0, 0.0
  names = list(fractions)
  for i, name in enumerate(names):
    acc += fractions[name]
    if i == len(names) - 1:
      end = len(text)
    else:
      nl = text.find("\n", int(round(acc * len(text))))
      end = len(text) if nl < 0 else nl + 1
    pieces[name] = text[start:end]
    start = end
  return pieces


def pydoc_corpus(tokenizer: str = "byte") -> Corpus:
  """The quick-start corpus (see module docstring); deterministic, no I/O."""
  pieces = split_at_lines(pydoc_text(), PYDOC_FRACTIONS)
  if tokenizer == "byte":
    vocab: vocab_lib.Vocab = vocab_lib.ByteVocab()
  elif tokenizer == "word":
    vocab = vocab_lib.WordVocab.build(vocab_lib.count_words([pieces["train"]]), add_unk=True)
  else:
    raise ValueError(f"tokenizer must be 'word' or 'byte', got {tokenizer!r}")
  splits = {name: vocab.encode(pieces[name]) for name in ("train", "validation", "test")}
  for name, ids in splits.items():
    if ids.size < 2:
      raise ValueError(f"pydoc {name} split is empty; this Python ships too little documentation")
  return Corpus(
    name=f"pydoc-{tokenizer}", unit=vocab.unit, vocab=vocab, splits=splits, bos_id=vocab.eos_id
  )
