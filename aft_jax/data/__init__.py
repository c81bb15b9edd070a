"""Data: WikiText-103 and enwik8 (TFDS builders, prepare CLI), your own text files (``text``),
tokenisers (bytes, words, SentencePiece subwords: ``subword``), the pydoc corpus, input
pipelines.

Importing this package does not import TFDS (slow to import): the builders
(`aft_jax.data.wikitext103`, `aft_jax.data.enwik8`) import it when data is actually prepared, and
`load_corpus` imports JAX's multi-host utilities only when it needs a barrier.
"""

from aft_jax.data.config import DATASETS, DataConfig
from aft_jax.data.corpus import (
  Corpus,
  default_data_dir,
  load_corpus,
  pydoc_corpus,
  resolve_data_dir,
  vocab_size,
)
from aft_jax.data.pipeline import TrainIterator, eval_batches, num_eval_batches, train_iterator
from aft_jax.data.vocab import ByteVocab, Vocab, WordVocab

__all__ = [
  "ByteVocab",
  "Corpus",
  "DATASETS",
  "DataConfig",
  "TrainIterator",
  "Vocab",
  "WordVocab",
  "default_data_dir",
  "eval_batches",
  "load_corpus",
  "num_eval_batches",
  "pydoc_corpus",
  "resolve_data_dir",
  "train_iterator",
  "vocab_size",
]
