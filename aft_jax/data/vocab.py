"""Tokenisers: words (``<eos>`` after each line) and UTF-8 bytes; ids are 1-D ``np.uint32``
arrays (docs/data.md, "Tokenisers")."""

from __future__ import annotations

import abc
import collections
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from aft_jax import files

EOS = "<eos>"
UNK = "<unk>"
VOCAB_FILENAME = "vocab.txt"


def word_tokens(text: str) -> list[str]:
  """Tokens of `text` under the word protocol (words, `<eos>` after each line)."""
  tokens = text.replace("\n", f" {EOS} ").split()
  if text and not text.endswith("\n"):
    tokens.append(EOS)  # the unterminated last line still ends with <eos>
  return tokens


def count_words(texts: Iterable[str]) -> collections.Counter:
  """Token frequencies (including `<eos>`) over `texts` under the protocol."""
  counts: collections.Counter = collections.Counter()
  for text in texts:
    counts.update(word_tokens(text))
  return counts


class Vocab(abc.ABC):
  """Text to uint32[n] ids and back: ``size`` ids, ``eos_id`` ending a line or document; ``unit``
  ('byte', 'word' or 'subword') is what perplexity is per."""

  unit: str
  size: int
  eos_id: int

  @abc.abstractmethod
  def encode(self, text: str) -> np.ndarray:
    """Returns uint32[n] ids of `text`."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Returns the text of ids int[n]."""

  def __repr__(self) -> str:
    return f"{type(self).__name__}(size={self.size})"


class ByteVocab(Vocab):
  """UTF-8 bytes; id = byte value."""

  unit, size, eos_id = "byte", 256, ord("\n")

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

  def decode(self, ids) -> str:
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() > 255):
      raise ValueError(f"byte ids must be in [0, 255], got range [{ids.min()}, {ids.max()}]")
    # A window cut in the middle of a multi-byte character must still print.
    return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class WordVocab(Vocab):
  """Words; id = position in `tokens`; an unknown word is `unk`'s id, an error where it has none."""

  unit = "word"

  def __init__(self, tokens: Sequence[str], *, unk: str | None = UNK):
    self._tokens = list(tokens)
    self._stoi = {t: i for i, t in enumerate(self._tokens)}
    if len(self._stoi) != len(self._tokens):
      dup = [t for t, c in collections.Counter(self._tokens).items() if c > 1][:5]
      raise ValueError(f"duplicate tokens in vocabulary: {dup}")
    if EOS not in self._stoi:
      raise ValueError(f"vocabulary has no {EOS!r} token")
    for t in self._tokens:
      if not t or t != t.strip() or len(t.split()) != 1:
        raise ValueError(f"vocabulary token {t!r} is empty or contains whitespace")
    self._unk_id = self._stoi.get(unk) if unk is not None else None

  @classmethod
  def build(cls, counts: collections.Counter, *, add_unk: bool = False) -> "WordVocab":
    """Tokens by descending count, then string; `<eos>`, and `<unk>` with `add_unk`, at least."""
    counts = collections.Counter(counts)
    counts.setdefault(EOS, 0)
    if add_unk:
      counts.setdefault(UNK, 0)
    tokens = sorted(counts, key=lambda t: (-counts[t], t))
    return cls(tokens)

  @property
  def tokens(self) -> list[str]:
    return list(self._tokens)

  @property
  def size(self) -> int:
    return len(self._tokens)

  @property
  def eos_id(self) -> int:
    return self._stoi[EOS]

  def encode_tokens(self, tokens: Sequence[str]) -> np.ndarray:
    """uint32[len(tokens)] ids of already-split tokens."""
    if self._unk_id is None:
      try:
        ids = [self._stoi[t] for t in tokens]
      except KeyError as e:
        raise ValueError(
          f"word {e.args[0]!r} is not in the vocabulary (which has no <unk>)"
        ) from None
    else:
      get, unk = self._stoi.get, self._unk_id
      ids = [get(t, unk) for t in tokens]
    return np.asarray(ids, dtype=np.uint32)

  def encode(self, text: str) -> np.ndarray:
    return self.encode_tokens(word_tokens(text))

  def decode(self, ids) -> str:
    """Words joined by spaces, `<eos>` as a newline (spacing is not restored)."""
    lines, line = [], []
    for i in np.asarray(ids).reshape(-1).tolist():
      tok = self._tokens[i]
      if tok == EOS:
        lines.append(" ".join(line) + "\n")
        line = []
      else:
        line.append(tok)
    return "".join(lines) + " ".join(line)

  @property
  def sha256(self) -> str:
    """The SHA-256 of the vocabulary's file (what ``save`` writes)."""
    return hashlib.sha256("".join(t + "\n" for t in self._tokens).encode("utf-8")).hexdigest()

  def save(self, path: str) -> None:
    """One token per line, id order, written atomically."""
    files.atomic_write(path, "".join(t + "\n" for t in self._tokens))

  @classmethod
  def load(cls, path: str) -> "WordVocab":
    with open(path, encoding="utf-8", newline="") as f:
      text = f.read()
    if not text.endswith("\n"):
      raise ValueError(f"vocabulary file {path} is truncated (no final newline)")
    # '\n' only: tokens may hold what str.splitlines() also splits at.
    return cls(text[:-1].split("\n"))
