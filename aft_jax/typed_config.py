"""The components' typed configs: each component defines, documents and checks its own keys
in a frozen dataclass (``ModelConfig`` in aft_jax/model.py, ``DataConfig``, ...), and the
training config tree (an ml_collections ConfigDict) is generated from those dataclasses
(aft_jax/trainer/default_config.py). A run reads the tree once, into one ``RunConfig`` of these
slices (aft_jax/trainer/run_config.py); the components then take their own slice.

A component's class sets ``WHERE``, the node of the tree that holds its keys ("data" for
``config.data.*``, "" for keys at the top), gives each field a default (its type: a value of
another type is refused) and a comment (its meaning), and lists what is wrong with a value in
``_value_problems``. ``OUTSIDE_TREE`` names fields that are no config key (the model's
``vocab_size``: it comes from the data). ``from_config(config)`` reads it from a tree;
``problems()`` is every type and value problem, one line each, named as the config key
(``config.data.dataset``).

A saved config (a workdir's config.json, a checkpoint's, an export's model config) holds every
key of the version that wrote it, so a key it lacks was added since; it takes the value that
version ran with, never today's default (which may differ, as ``model.init``'s does). Each class
lists every key it gained since the first release (commit 3d08369, the first config tree) in
``ADDED``, with the change that added it and that old value, and ``as_written`` fills them in.
The table is complete, old values equal to today's defaults included: the rule is one lookup,
a test checks the table against the first release's keys, and a key a saved config lacks that
is in no table was written by every version, so its absence is damage (the config check names
it). A key added later gets its entry with it. A changed default of an existing key needs none:
every saved config holds that key's value. So no version number is written: the keys a saved
config holds say which of them it predates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import ml_collections


def type_ok(value, default) -> bool:
  """Whether ``value`` may stand where ``default`` does: the same type (an int for a float;
  never a bool for a number), a list or tuple for a list or tuple; None always."""
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
  """Base of a component's config (a frozen dataclass whose every field has a default)."""

  WHERE: ClassVar[str] = ""
  OUTSIDE_TREE: ClassVar[tuple[str, ...]] = ()  # fields the tree does not hold
  # The keys added since the first release: {name: (the change that added it, the value a
  # config written before it ran with)}; the old value may be a function of the saved keys
  # (the node ``as_written`` reads) where the old code used another key's value.
  ADDED: ClassVar[dict[str, tuple[str, Any | Callable[[Mapping], Any]]]] = {}

  @classmethod
  def defaults(cls) -> dict:
    """Every field and its default, in the order of the fields."""
    missing = dataclasses.MISSING
    return {
      f.name: f.default if f.default is not missing else f.default_factory()
      for f in dataclasses.fields(cls)
    }

  @classmethod
  def tree_defaults(cls) -> dict:
    """The component's keys in the config tree and their defaults."""
    return {k: v for k, v in cls.defaults().items() if k not in cls.OUTSIDE_TREE}

  @classmethod
  def from_config(cls, config):
    """The component's keys of a config tree (a ConfigDict or a dict)."""
    node = config[cls.WHERE] if cls.WHERE else config
    return cls(**{name: node[name] for name in cls.tree_defaults()})

  @classmethod
  def as_written(cls, node: Mapping) -> dict:
    """``node`` (the component's keys in a saved config) with each ``ADDED`` key it lacks at
    the value the version that wrote it ran with (module doc)."""
    out = dict(node)
    for name, (_, old) in cls.ADDED.items():
      if name not in out:
        out[name] = old(node) if callable(old) else old
    return out

  def key(self, name: str) -> str:
    """The config key of field ``name``, as errors name it: "config.data.dataset"."""
    return f"config.{self.WHERE + '.' if self.WHERE else ''}{name}"

  def problems(self) -> list[str]:
    """One line per invalid setting (types first: the value checks assume the types)."""
    values = self._typed_values()
    wrong = type_problems(values, self.defaults(), self.WHERE + "." if self.WHERE else "")
    return wrong or self._value_problems()

  def _typed_values(self) -> dict:
    """The fields' values as the type check compares them with the defaults."""
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
