"""The corpus API the trainer uses: `load_corpus(cfg) -> Corpus`, preparing a dataset on first
use, and the in-memory pydoc corpus (docs/data.md)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

import numpy as np

from aft_jax.data import pydoc, store
from aft_jax.data.config import DataConfig, resolve_data_dir
from aft_jax.data import vocab as vocab_lib

log = logging.getLogger(__name__)

BARRIER_NAME = "aft_jax.data.prepare"


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A tokenised corpus: uint32[n] ids per split, and what a run records of it."""

  name: str
  unit: str  # 'word', 'subword' or 'byte': what perplexity is per
  vocab: vocab_lib.Vocab
  splits: Mapping[str, np.ndarray]  # train, validation, test
  bos_id: int  # the context of a split's first token: the vocabulary's eos_id
  num_bytes: Mapping[str, int] | None = None  # the UTF-8 bytes of a split (bits per byte)
  fingerprint: str | None = None  # of the source files
  sources: Mapping[str, Mapping[str, str]] | None = None  # text: ``text.source_files``
  # text: uint32[documents] per split, the offset past each document's boundary (for packing)
  documents: Mapping[str, np.ndarray] | None = None
  builder_version: int = 1  # of the dataset's builder that made it (``store.BUILDERS``)


def load_corpus(cfg: DataConfig, version: int | None = None) -> Corpus:
  """The corpus `cfg` names, as version `version` of its builder made it (None: today's; only
  pydoc builds older ones: ``record.check_corpus`` refuses the others)."""
  if not isinstance(cfg, DataConfig):
    raise TypeError(
      "load_corpus takes a DataConfig (DataConfig.of(mapping) makes one, .validate() checks it), "
      f"not a {type(cfg).__name__}"
    )
  if cfg.dataset == "pydoc":
    return pydoc_corpus(cfg.tokenizer, version)
  from aft_jax.data import prepare  # pylint: disable=g-import-not-at-top

  data_dir = resolve_data_dir(cfg.data_dir)
  out = prepare.prepared_path(data_dir, cfg)
  sources = None
  if cfg.dataset == "text":
    from aft_jax.data import text  # pylint: disable=g-import-not-at-top

    sources = text.source_files(cfg)  # (read before prepare reads the files)
  import jax  # pylint: disable=g-import-not-at-top  (keeps `import aft_jax.data` light)

  # Process 0 prepares; the others wait at the barrier, which it reaches even when it failed (so
  # that they stop with an error instead of waiting).
  try:
    if jax.process_index() == 0:
      prepare.prepare_corpus(data_dir, cfg)
  finally:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

      multihost_utils.sync_global_devices(BARRIER_NAME)
  return dataclasses.replace(load_prepared(out), sources=sources)


def vocab_size(cfg: DataConfig) -> tuple[int, str]:
  """(vocabulary size, where from) of the corpus ``cfg`` names, neither prepared nor loaded."""
  dataset, tokenizer = cfg.dataset, cfg.tokenizer
  if dataset == "pydoc":
    return pydoc_corpus(tokenizer).vocab.size, "the pydoc corpus"
  if tokenizer == "subword":  # a subword vocabulary has exactly the size asked for
    return cfg.vocab_size, "config.data.vocab_size"
  from aft_jax.data import prepare  # pylint: disable=g-import-not-at-top

  path = prepare.prepared_path(resolve_data_dir(cfg.data_dir), cfg)
  if store.is_complete(path):
    return int(store.read_summary(path)["vocab_size"]), f"the prepared corpus in {path}"
  if dataset == "text" and tokenizer == "word":  # only the files know: counted, not written
    from aft_jax.data import text  # pylint: disable=g-import-not-at-top

    documents = (
      doc
      for p in text.split_files(cfg)["train"]
      for doc in text.read_documents(p, cfg.encoding, cfg.text_field)
    )
    return text.learn_vocab(cfg, documents).size, "the text files (counted, not prepared)"
  if tokenizer == "byte" or dataset == "enwik8":
    return vocab_lib.ByteVocab().size, "bytes"
  return prepare.OFFICIAL_VOCAB_SIZE, "the official WikiText-103 vocabulary (not prepared here)"


def load_prepared(path: str) -> Corpus:
  """Corpus from a complete `prepare` output directory (ids memory-mapped)."""
  if not store.is_complete(path):
    raise FileNotFoundError(f"{path} is not a complete prepared corpus; run aft_jax.data.prepare")
  summary = store.read_summary(path)
  if summary["tokenizer"] == "word":
    vocab = vocab_lib.WordVocab.load(os.path.join(path, vocab_lib.VOCAB_FILENAME))
  elif summary["tokenizer"] == "subword":
    from aft_jax.data import subword  # pylint: disable=g-import-not-at-top

    model = os.path.join(path, subword.MODEL_FILENAME)
    try:
      vocab = subword.SubwordVocab.load(model, summary.get("subword_sha256"))
    except ValueError as e:
      raise ValueError(f"{e}; delete {path} and prepare again") from None
  else:
    vocab = vocab_lib.ByteVocab()
  if vocab.size != summary["vocab_size"]:
    raise ValueError(
      f"{path}: vocabulary has {vocab.size} entries, summary.json says {summary['vocab_size']}"
    )
  splits = {s: store.load_tokens(path, s, n) for s, n in summary["tokens"].items()}
  documents = None
  if summary.get("document_ends"):  # (text.DOCUMENTS_KEY: text corpora since they kept them)
    documents = {
      s: store.load_tokens(path, f"{s}-documents", n) for s, n in summary["documents"].items()
    }
  return Corpus(
    name=summary["name"],
    unit=vocab.unit,
    vocab=vocab,
    splits=splits,
    bos_id=vocab.eos_id,
    num_bytes=summary.get("bytes"),
    fingerprint=summary.get(store.FINGERPRINT_KEY),
    documents=documents,
    builder_version=summary.get(store.VERSION_KEY, 1),
  )


def pydoc_corpus(tokenizer: str = "byte", version: int | None = None) -> Corpus:
  """The quick-start corpus as builder ``version`` made it (None or unknown: today's); no I/O."""
  if version not in range(1, store.version("pydoc") + 1):
    version = store.version("pydoc")
  vocab, splits = pydoc.pydoc_splits(tokenizer, version)
  return Corpus(
    f"pydoc-{tokenizer}", vocab.unit, vocab, splits, vocab.eos_id, builder_version=version
  )
