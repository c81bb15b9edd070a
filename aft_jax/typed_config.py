"""``TypedConfig``: each component's keys, defined, documented and checked in one frozen
dataclass, the config tree generated from them. docs/training.md, "Config keys", "Reliability"."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import ml_collections


def type_ok(value, default) -> bool:
  """Whether ``value`` has ``default``'s type (an int for a float, no bool for a number; None)."""
  if default is None or value is None:
    return True
  if isinstance(default, bool):
    return isinstance(value, bool)
  if isinstance(default, float):
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if isinstance(default, int):
    return isinstance(value, int) and not isinstance(value, bool)
  if isinstance(default, (list, tuple)):
    return isinstance(value, (list, tuple))
  return isinstance(value, type(default))


def type_problems(values: dict, defaults: dict, prefix: str) -> list[str]:
  """One line per value of ``values`` whose type is not its default's (keys ``prefix + name``)."""
  return [
    f"config.{prefix}{k} = {values[k]!r} should be a {type(defaults[k]).__name__}"
    for k in defaults
    if k in values and not type_ok(values[k], defaults[k])
  ]


class TypedConfig:
  """A component's config: a frozen dataclass, each field a default (its type) and a comment."""

  WHERE: ClassVar[str] = ""  # the tree node of its keys ("": the top)
  OUTSIDE_TREE: ClassVar[tuple[str, ...]] = ()  # fields the tree does not hold
  # Keys added since the first release (3d08369): {name: (commit, old value or f(saved node))}.
  ADDED: ClassVar[dict[str, tuple[str, Any | Callable[[Mapping], Any]]]] = {}

  @classmethod
  def defaults(cls) -> dict:
    missing = dataclasses.MISSING
    return {
      f.name: f.default if f.default is not missing else f.default_factory()
      for f in dataclasses.fields(cls)
    }

  @classmethod
  def tree_defaults(cls) -> dict:
    return {k: v for k, v in cls.defaults().items() if k not in cls.OUTSIDE_TREE}

  @classmethod
  def from_config(cls, config):  # of a config tree (a ConfigDict or a dict)
    node = config[cls.WHERE] if cls.WHERE else config
    return cls(**{name: node[name] for name in cls.tree_defaults()})

  @classmethod
  def as_written(cls, node: Mapping) -> dict:
    """``node`` (a saved config's keys) with each ``ADDED`` key it lacks at its old value."""
    out = dict(node)
    for name, (_, old) in cls.ADDED.items():
      if name not in out:
        out[name] = old(node) if callable(old) else old
    return out

  def key(self, name: str) -> str:  # as errors name field ``name``: "config.data.dataset"
    return f"config.{self.WHERE + '.' if self.WHERE else ''}{name}"

  def problems(self) -> list[str]:
    """One line per invalid setting (types first: the value checks assume the types)."""
    values = self._typed_values()
    wrong = type_problems(values, self.defaults(), self.WHERE + "." if self.WHERE else "")
    return wrong or self._value_problems()

  def _typed_values(self) -> dict:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def _value_problems(self) -> list[str]:
    return []

  def validate(self):
    """Raises ValueError naming every invalid setting; returns self otherwise."""
    errors = self.problems()
    if errors:
      raise ValueError("; ".join(errors))
    return self


def positive(cfg: TypedConfig, *names: str) -> list[str]:
  """The "must be >= 1" line of each of ``names`` below 1."""
  return [f"{cfg.key(n)} = {getattr(cfg, n)} must be >= 1" for n in names if getattr(cfg, n) < 1]


def flatten(d, prefix: str = "") -> dict:
  """A nested config (dicts or ConfigDicts) as one dict keyed "model.mixing" etc."""
  out = {}
  for k, v in d.items():
    key = f"{prefix}{k}"
    if isinstance(v, (dict, ml_collections.ConfigDict)):
      out.update(flatten(v, key + "."))
    else:
      out[key] = v
  return out
