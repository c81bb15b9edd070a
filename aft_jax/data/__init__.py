"""Data: the corpora (pydoc, WikiText-103, enwik8, your own text), tokenisers and input pipelines
(docs/data.md). Importing it does not import TFDS or JAX: the builders import them when needed.
"""

from aft_jax.data.config import DATASETS, DataConfig, default_data_dir, resolve_data_dir
from aft_jax.data.corpus import Corpus, load_corpus, pydoc_corpus, vocab_size
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
