"""``config.data``: which corpus a run trains on and where its files are (``DataConfig``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from aft_jax.typed_config import TypedConfig

DATASETS = ("pydoc", "wikitext103", "enwik8")
TOKENIZERS = ("byte", "word")
OFFICIAL = ("auto", "yes", "no")
VARIANTS = ("v1", "raw_v1")
DATA_DIR_ENV = "AFT_JAX_DATA"  # the default data_dir, where set


@dataclasses.dataclass(frozen=True)
class DataConfig(TypedConfig):
  """The corpus of a run. ``aft_jax.data.load_corpus`` reads it; ``config.data`` is made of it."""

  WHERE = "data"

  dataset: str = "pydoc"  # 'pydoc' (ships with Python), 'wikitext103' or 'enwik8'
  tokenizer: str = "byte"  # 'byte' or 'word'
  variant: str = "v1"  # WikiText-103: 'v1' (tokenised, <unk>) or 'raw_v1'
  # prepared datasets live in <data_dir>/prepared; '': $AFT_JAX_DATA, else ~/.cache/aft_jax
  data_dir: str = ""
  manual_dir: str = ""  # a folder holding the official zip or its extracted files
  # is the source the official release? 'auto': judge by its line counts / size (a file under
  # an official name with other counts is an error), 'yes': require it, 'no': a custom corpus
  official: str = "auto"

  @classmethod
  def of(cls, cfg) -> DataConfig:
    """``cfg`` (a ConfigDict, a mapping or an object with these attributes) as a DataConfig.
    Keys it leaves out take their defaults, but for the tokenizer: WikiText-103's usual one
    is words. None for a folder or the variant means its default."""
    get = cfg.get if isinstance(cfg, Mapping) or hasattr(cfg, "to_dict") else None
    values = {}
    for name in cls.defaults():
      value = get(name, None) if get else getattr(cfg, name, None)
      if value is not None:
        values[name] = value
    if "tokenizer" not in values and values.get("dataset") == "wikitext103":
      values["tokenizer"] = "word"
    return cls(**values)

  def _value_problems(self) -> list[str]:
    errors = []
    if self.dataset not in DATASETS:
      errors.append(f"{self.key('dataset')} = {self.dataset!r} is not one of {', '.join(DATASETS)}")
    if self.official not in OFFICIAL:
      errors.append(f"{self.key('official')} = {self.official!r} is not 'auto', 'yes' or 'no'")
    if self.tokenizer not in TOKENIZERS:
      errors.append(f"{self.key('tokenizer')} = {self.tokenizer!r} is not 'byte' or 'word'")
    elif self.dataset == "enwik8" and self.tokenizer != "byte":
      errors.append(f"{self.key('tokenizer')} = {self.tokenizer!r}: enwik8 is bytes ('byte')")
    if self.variant not in VARIANTS:
      errors.append(f"{self.key('variant')} = {self.variant!r} is not 'v1' or 'raw_v1'")
    return errors


def default_data_dir() -> str:
  """The folder for prepared data when `cfg.data_dir` is empty: `$AFT_JAX_DATA`, else
  `~/.cache/aft_jax`, as an absolute path.

  Absolute and per user, so that runs started from any directory share one prepared copy
  instead of preparing WikiText-103 (190 MB) again under a relative `data/`.
  """
  path = os.environ.get(DATA_DIR_ENV) or os.path.join("~", ".cache", "aft_jax")
  return os.path.abspath(os.path.expanduser(path))


def resolve_data_dir(data_dir: str | None) -> str:
  """`data_dir` as an absolute path; `default_data_dir()` when it is empty."""
  return os.path.abspath(os.path.expanduser(data_dir)) if data_dir else default_data_dir()
