"""Data: WikiText-103 (TFDS builder, tokenisers, prepare CLI), the pydoc corpus, input pipelines.

Importing this package does not import TFDS (slow); `aft_jax.data.wikitext103`
and `aft_jax.data.prepare` do, when WikiText-103 is actually prepared.
"""

from aft_jax.data.corpus import Corpus, load_corpus, pydoc_corpus
from aft_jax.data.pipeline import TrainIterator, eval_batches, num_eval_batches, train_iterator
from aft_jax.data.vocab import ByteVocab, Vocab, WordVocab

__all__ = [
  "ByteVocab",
  "Corpus",
  "TrainIterator",
  "Vocab",
  "WordVocab",
  "eval_batches",
  "load_corpus",
  "num_eval_batches",
  "pydoc_corpus",
  "train_iterator",
]
