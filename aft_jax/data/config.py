"""``config.data``: which corpus a run trains on and where its files are (``DataConfig``)."""

from __future__ import annotations

import codecs
import dataclasses
import os
from collections.abc import Mapping

from aft_jax.typed_config import TypedConfig

DATASETS = ("pydoc", "wikitext103", "enwik8", "text")
TOKENIZERS = ("byte", "word", "subword")
OFFICIAL = ("auto", "yes", "no")
VARIANTS = ("v1", "raw_v1")
_CHOICES = {"dataset": DATASETS, "official": OFFICIAL, "tokenizer": TOKENIZERS, "variant": VARIANTS}
# A subword vocabulary holds the 256 bytes (so that any text is encodable), <unk>, <eos> and
# the pieces learned; SentencePiece keeps ids in int32.
MIN_SUBWORD, MAX_SUBWORD = 300, 1_000_000


@dataclasses.dataclass(frozen=True)
class DataConfig(TypedConfig):
  """The corpus of a run. ``aft_jax.data.load_corpus`` reads it; ``config.data`` is made of it."""

  WHERE = "data"
  # Keys added since the first release and the value a config without them ran with
  # (``TypedConfig.as_written``): each default is what the code did before the key.
  ADDED = {
    "official": ("3a3ca29", "auto"),
    "vocab_size": ("e72b922", 0),
    "train_files": ("e72b922", ""),
    "valid_files": ("e72b922", ""),
    "test_files": ("e72b922", ""),
    "valid_fraction": ("e72b922", 0.1),
    "test_fraction": ("e72b922", 0.1),
    "encoding": ("e72b922", "utf-8"),
    "text_field": ("b7308a7", "text"),
    "packing": ("b7308a7", False),
  }

  # The keys are described in docs/data.md.
  dataset: str = "pydoc"  # 'pydoc', 'wikitext103', 'enwik8' or 'text' (your files)
  tokenizer: str = "byte"  # 'byte', 'word' or 'subword' (wikitext103 and text)
  vocab_size: int = 0  # subword: the number of pieces (at least 300)
  # text: comma-separated globs; without valid_files / test_files, the fractions below of
  # train_files' documents are held out
  train_files: str = ""
  valid_files: str = ""
  test_files: str = ""
  valid_fraction: float = 0.1  # text: share of documents held out for validation (by document)
  test_fraction: float = 0.1  # text: share of documents held out for the test split
  encoding: str = "utf-8"  # text: the files' encoding (any name Python's codecs know)
  text_field: str = "text"  # text: the JSONL field / Parquet column of each record's text
  packing: bool = False  # text: training rows of whole documents (False: cut from one stream)
  variant: str = "v1"  # WikiText-103: 'v1' (tokenised, <unk>) or 'raw_v1'
  # prepared datasets live in <data_dir>/prepared; '': $AFT_JAX_DATA, else ~/.cache/aft_jax
  data_dir: str = ""
  manual_dir: str = ""  # a folder holding the official zip or its extracted files
  official: str = "auto"  # is the source the official release? auto, yes or no

  @classmethod
  def of(cls, cfg) -> DataConfig:
    """``cfg`` (a mapping or object) as an unchecked DataConfig; keys it lacks or sets to None
    take the defaults."""
    get = cfg.get if isinstance(cfg, Mapping) or hasattr(cfg, "get") else None
    values = {}
    for name in cls.defaults():
      value = get(name, None) if get else getattr(cfg, name, None)
      if value is not None:
        values[name] = value
    return cls(**values)

  def _value_problems(self) -> list[str]:
    errors = [
      f"{self.key(key)} = {getattr(self, key)!r} is not one of {', '.join(allowed)}"
      for key, allowed in _CHOICES.items()
      if getattr(self, key) not in allowed
    ]
    if self.dataset == "enwik8" and self.tokenizer in ("word", "subword"):
      errors.append(f"{self.key('tokenizer')} = {self.tokenizer!r}: enwik8 is bytes ('byte')")
    elif self.dataset == "pydoc" and self.tokenizer == "subword":
      errors.append(
        f"{self.key('tokenizer')} = 'subword': pydoc is bytes or words (train a subword "
        "vocabulary on files with dataset = 'text')"
      )
    elif self.tokenizer == "subword" and not MIN_SUBWORD <= self.vocab_size <= MAX_SUBWORD:
      errors.append(
        f"{self.key('vocab_size')} = {self.vocab_size} must be in [{MIN_SUBWORD}, "
        f"{MAX_SUBWORD:,}] for tokenizer = 'subword' (256 of the pieces are bytes)"
      )
    if self.dataset != "text":
      if self.packing:
        errors.append(
          f"{self.key('packing')} = True: {self.dataset} is one stream of tokens (no documents "
          "to pack); packing is for dataset = 'text'"
        )
      return errors
    if not self.text_field:
      errors.append(f"{self.key('text_field')} is empty: name the records' text field")
    if not self.train_files.replace(",", " ").strip():
      errors.append(f"{self.key('train_files')} is empty: dataset = 'text' needs files to train on")
    held_out = 0.0
    for split in ("valid", "test"):
      fraction = getattr(self, f"{split}_fraction")
      if not getattr(self, f"{split}_files").strip():
        if not 0.0 < fraction < 1.0:
          errors.append(
            f"{self.key(split + '_fraction')} = {fraction} must be in (0, 1) when "
            f"{self.key(split + '_files')} is empty (its documents come from train_files)"
          )
        held_out += fraction
    if held_out >= 1.0:
      errors.append(
        f"{self.key('valid_fraction')} + {self.key('test_fraction')} = {held_out} leaves no "
        "documents to train on"
      )
    try:
      codecs.lookup(self.encoding)
    except LookupError:
      errors.append(f"{self.key('encoding')} = {self.encoding!r} is not an encoding Python knows")
    return errors


def vocab_size_note(cfg: DataConfig) -> str | None:
  """The note (not an error: old workdirs have one) that ``vocab_size`` is unused; None: it is."""
  if cfg.tokenizer == "subword" or not cfg.vocab_size or cfg.tokenizer not in TOKENIZERS:
    return None
  has = {"byte": "its 256 byte values", "word": "the words of the train split"}[cfg.tokenizer]
  return (
    f"note: {cfg.key('vocab_size')} = {cfg.vocab_size} is not used: tokenizer = "
    f"{cfg.tokenizer!r} has {has} (vocab_size is the size of a 'subword' vocabulary)"
  )


def absolute_globs(spec: str) -> str:
  """Comma-separated globs made absolute (``~`` expanded): the same files from any directory."""
  return ",".join(
    os.path.abspath(os.path.expanduser(p.strip())) for p in spec.split(",") if p.strip()
  )


def default_data_dir() -> str:
  """The data folder of an empty `cfg.data_dir`: `$AFT_JAX_DATA`, else `~/.cache/aft_jax`."""
  path = os.environ.get("AFT_JAX_DATA") or os.path.join("~", ".cache", "aft_jax")
  return os.path.abspath(os.path.expanduser(path))


def resolve_data_dir(data_dir: str | None) -> str:
  """`data_dir` as an absolute path; `default_data_dir()` when it is empty."""
  return os.path.abspath(os.path.expanduser(data_dir)) if data_dir else default_data_dir()
