"""Subword vocabularies: a lossless SentencePiece unigram model learned on a corpus's train split,
deterministically, and stoppable with Ctrl-C (docs/data.md, "Subword vocabulary")."""

from __future__ import annotations

import hashlib
import io
import re
import threading
from collections.abc import Iterable

import numpy as np

from aft_jax import files
from aft_jax.data import vocab as vocab_lib

MODEL_FILENAME = "subword.model"
MAX_LINES = 5_000_000  # lines a vocabulary is learned from (WikiText-103 train: 1.8M)
EOS = vocab_lib.EOS
_SIZE_LIMIT = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_SIZE_LOW = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


class SubwordVocab(vocab_lib.Vocab):
  """A SentencePiece model; id = piece id. ``model`` is the serialised model (its file)."""

  unit = "subword"

  def __init__(self, model: bytes, *, where: str = "the subword model"):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top

    self.model = bytes(model)
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(self.model)
    except (RuntimeError, OSError, TypeError) as e:
      raise ValueError(f"{where} is not a SentencePiece model ({_first_line(e)})") from None
    if self._sp.eos_id() < 0 or self._sp.id_to_piece(self._sp.eos_id()) != EOS:
      raise ValueError(f"{where} has no {EOS!r} piece: not an aft_jax subword vocabulary")

  @property
  def size(self) -> int:
    return int(self._sp.get_piece_size())

  @property
  def eos_id(self) -> int:
    return int(self._sp.eos_id())

  @property
  def sha256(self) -> str:
    return hashlib.sha256(self.model).hexdigest()

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text), dtype=np.uint32)

  def decode(self, ids) -> str:
    """The text of ``ids``; ``<eos>`` (a document boundary) as an empty line."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if ids and not 0 <= min(ids) <= max(ids) < self.size:
      raise ValueError(f"subword ids must be in [0, {self.size}), got [{min(ids)}, {max(ids)}]")
    cuts = [-1] + [k for k, i in enumerate(ids) if i == self.eos_id] + [len(ids)]
    return "\n\n".join(self._sp.decode(ids[a + 1 : b]) for a, b in zip(cuts, cuts[1:]))

  def save(self, path: str) -> None:
    with files.atomic_path(path) as tmp, open(tmp, "wb") as f:
      f.write(self.model)

  @classmethod
  def load(cls, path: str, sha256: str | None = None) -> SubwordVocab:
    """The model in ``path``; a one-line ValueError naming it unless it reads, as ``sha256``."""
    try:
      with open(path, "rb") as f:
        model = f.read()
    except OSError as e:
      raise ValueError(f"the subword vocabulary {path} cannot be read: {e.strerror}") from None
    if sha256 is not None and hashlib.sha256(model).hexdigest() != sha256:
      raise ValueError(
        f"the subword vocabulary {path} is damaged: it does not match the SHA-256 recorded "
        "beside it"
      )
    return cls(model, where=f"the subword vocabulary {path}")


def train(documents: Iterable[str], vocab_size: int, *, seed=0, what="the train split"):
  """A SentencePiece unigram model of ``vocab_size`` pieces learned on ``documents``' lines (a
  size the text cannot give: a ValueError naming ``what``), in a thread that Ctrl-C abandons."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  spm.set_random_generator_seed(seed)
  out, stop, outcome = io.BytesIO(), threading.Event(), {}

  def sentences():
    try:
      for line in _lines(documents):
        if stop.is_set():
          raise _Abandoned
        yield line
    except GeneratorExit:  # SentencePiece stopped reading
      raise
    except BaseException as e:  # what reading the documents raised (SentencePiece wraps it)
      outcome.setdefault("reading", e)
      raise

  def work():
    try:
      spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(), model_writer=out, vocab_size=vocab_size, **_SETTINGS
      )
    except Exception as e:  # noqa: BLE001 (returned to the waiting thread)
      outcome["training"] = e

  thread = threading.Thread(target=work, name="sentencepiece", daemon=True)
  thread.start()
  try:
    while thread.is_alive():
      thread.join(0.1)  # a Ctrl-C is a KeyboardInterrupt here, between the waits
  except BaseException:
    stop.set()
    raise
  if "reading" in outcome:
    raise outcome["reading"]
  if "training" in outcome:
    raise _size_error(outcome["training"], vocab_size, what) from None
  return SubwordVocab(out.getvalue())


class _Abandoned(Exception):
  """Ends the documents' reading of a training that was interrupted."""


# Lines are SentencePiece's sentences; it leaves out those over max_sentence_length bytes, so a
# longer line is learned from in pieces of _PIECE_CHARS characters (at most 64 KiB in UTF-8).
_MAX_SENTENCE_BYTES = 1 << 16
_PIECE_CHARS = _MAX_SENTENCE_BYTES // 4

_SETTINGS = dict(
  model_type="unigram",
  character_coverage=1.0,
  normalization_rule_name="identity",
  remove_extra_whitespaces=False,
  add_dummy_prefix=False,
  allow_whitespace_only_pieces=True,
  split_digits=True,
  byte_fallback=True,
  user_defined_symbols=["\n"],
  unk_id=0,
  eos_id=1,
  bos_id=-1,
  pad_id=-1,
  eos_piece=EOS,
  max_sentence_length=_MAX_SENTENCE_BYTES,
  # At most this many lines, sampled with the seed when there are more (lm1b samples too):
  # SentencePiece holds its sentences in memory.
  input_sentence_size=MAX_LINES,
  shuffle_input_sentence=True,
  num_threads=1,  # one thread: the same model on every run
  minloglevel=2,
)


def _lines(documents: Iterable[str]):
  """The non-empty lines of ``documents``; one longer than SentencePiece takes as pieces."""
  for doc in documents:
    for line in doc.split("\n"):
      if len(line) > _PIECE_CHARS and len(line.encode("utf-8")) > _MAX_SENTENCE_BYTES:
        yield from (line[i : i + _PIECE_CHARS] for i in range(0, len(line), _PIECE_CHARS))
      elif line:
        yield line


def _size_error(e: Exception, vocab_size: int, what: str) -> ValueError:
  if m := _SIZE_LIMIT.search(str(e)):
    return ValueError(
      f"config.data.vocab_size = {vocab_size} is more pieces than {what} supports (at most "
      f"{m.group(2)}): lower it or add text"
    )
  if m := _SIZE_LOW.search(str(e)):
    return ValueError(
      f"config.data.vocab_size = {vocab_size} is too small for {what}: its characters and "
      f"the 256 bytes need at least {m.group(2)} pieces"
    )
  return ValueError(f"learning the subword vocabulary on {what}: {_first_line(e)}")


def _first_line(e: Exception) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0]
