"""A run's config followed through aft_jax: the rooms (modules) and climbs (calls up ``LAYERS``)."""

import os
import sys

from ml_collections import ConfigDict

from aft_jax.trainer.run_config import RunConfig
from aft_jax.typed_config import TypedConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "aft_jax") + os.sep

# Layer of each module (by prefix, the longest matching): 0 is the top.
LAYERS = {
  "aft_jax.tools": 0,
  "aft_jax.trainer.train": 0,
  "aft_jax.trainer.train_lib": 0,
  "aft_jax.trainer.dry_run": 0,
  "aft_jax.trainer.run_config": 1,
  "aft_jax.trainer": 2,
  "aft_jax.workdir": 2,
  "aft_jax.data": 3,
  "aft_jax.model": 3,
  "aft_jax.sharding": 3,
  "aft_jax.decode": 3,
  "aft_jax.layers": 4,
  "aft_jax.adaptive": 4,
  "aft_jax.ops": 5,
  "aft_jax.typed_config": 6,
  "aft_jax.files": 6,
}


def layer(module: str) -> int:
  best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
  return LAYERS[best]


def _module(code) -> str | None:
  path = code.co_filename
  if not path.startswith(PACKAGE):
    return None
  return os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")


def _is_config(value) -> bool:
  return isinstance(value, (ConfigDict, RunConfig, TypedConfig))


def follow(fn, *args, **kwargs):
  """(fn's result, rooms, climbs): sets of modules and of (caller, callee) module.function."""
  rooms, climbs = set(), set()

  def trace(frame, event, arg):
    code = frame.f_code
    callee = _module(code) if event == "call" else None
    caller = _module(frame.f_back.f_code) if callee and frame.f_back else None
    if caller is None:
      return None
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    values = [frame.f_locals.get(n) for n in names]
    own_method = names and names[0] in ("self", "cls") and _is_config(values[0])
    if own_method or not any(_is_config(v) for v in values):
      return None
    rooms.add(callee)
    if layer(callee) < layer(caller):
      climbs.add((f"{caller}.{frame.f_back.f_code.co_name}", f"{callee}.{code.co_name}"))
    return None

  old = sys.gettrace()
  sys.settrace(trace)
  try:
    out = fn(*args, **kwargs)
  finally:
    sys.settrace(old)
  return out, rooms, climbs
