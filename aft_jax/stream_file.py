"""A stream's state as a file (``aft-generate --save_state`` / ``--state``; docs/training.md,
"Streams: no length limit"): safetensors, its metadata's SHA-256 covering all the rest."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from aft_jax import files
from aft_jax.decode import Stream, init_cache

FORMAT = "aft_jax.stream"
VERSION = 1


def fingerprint(model_cfg, params) -> str:
  """A SHA-256 of the model's config and every parameter (path, dtype, shape, bytes)."""
  h = hashlib.sha256()
  cfg = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg)}
  h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  for path, leaf in sorted(leaves, key=lambda pl: jax.tree_util.keystr(pl[0])):
    _hash_array(h, jax.tree_util.keystr(path), np.asarray(leaf))
  return h.hexdigest()


def _hash_array(h, name: str, a: np.ndarray) -> None:
  h.update(f"\n{name} {a.dtype.str} {list(a.shape)}\n".encode())
  h.update(np.ascontiguousarray(a).tobytes())


def _digest(meta: dict, tensors: dict) -> str:
  h = hashlib.sha256(f"{FORMAT}\n".encode())
  h.update(json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode())
  for name in sorted(tensors):
    _hash_array(h, name, tensors[name])
  return h.hexdigest()


def save(path: str, stream: Stream, model_fingerprint: str) -> None:
  from safetensors.numpy import save as st_save  # pylint: disable=g-import-not-at-top

  cache = jax.device_get(stream.cache)
  tensors = {
    f"cache/{k}": np.array(v, order="C")  # (ascontiguousarray makes a 0-d array 1-d)
    for k, v in traverse_util.flatten_dict(cache, sep="/").items()
  }
  tensors["last"] = np.array(stream.last_B, np.int32, order="C")
  tensors["rng"] = np.array(jax.random.key_data(stream.rng), order="C")
  meta = {
    "format": FORMAT,
    "version": str(VERSION),
    "model": model_fingerprint,
    "position": str(stream.position),
    "rng_impl": str(jax.random.key_impl(stream.rng)),
  }
  meta["sha256"] = _digest(meta, tensors)
  data = st_save(tensors, metadata=meta)
  with files.output_path("--save_state", path) as tmp, open(tmp, "wb") as f:
    f.write(data)


def load(path: str, model, model_fingerprint: str) -> Stream:
  """The ``Stream`` in ``path`` for ``model``, or a one-line ValueError."""
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load as st_load  # pylint: disable=g-import-not-at-top

  where = f"--state {path}"
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise ValueError(f"{where}: cannot read it: {e.strerror}") from None
  try:
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    tensors = st_load(data)
  except (SafetensorError, ValueError, AttributeError) as e:
    raise ValueError(f"{where} is damaged or not a stream state (not safetensors: {e})") from None
  if meta.get("format") != FORMAT:
    raise ValueError(f"{where} is not a stream state written by aft-generate --save_state")
  if meta.get("sha256") != _digest(meta, tensors):
    raise ValueError(f"{where} is damaged: its contents do not match their SHA-256 checksum")
  if not meta.get("version", "").isdigit() or int(meta["version"]) > VERSION:
    raise ValueError(f"{where} has format version {meta.get('version')!r}; update aft_jax")
  if meta.get("model") != model_fingerprint:
    raise ValueError(
      f"{where} is the state of another model (fingerprint {str(meta.get('model'))[:12]}..., "
      f"this one's {model_fingerprint[:12]}...): a state continues only the model that wrote it"
    )
  prefix = "cache/"
  cache = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
  last, key = tensors.get("last"), tensors.get("rng")
  rows = last.shape[0] if last is not None and last.ndim == 1 else 0
  abstract = jax.eval_shape(functools.partial(init_cache, model, max(rows, 1)))
  want = traverse_util.flatten_dict(abstract, sep="/")
  shapes = lambda d: {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in d.items()}  # noqa: E731
  if key is None or not rows or shapes(cache) != shapes(want):
    raise ValueError(f"{where} does not hold this model's decoding state")
  cache = jax.tree.map(jnp.asarray, traverse_util.unflatten_dict(cache, sep="/"))
  rng = jax.random.wrap_key_data(key, impl=meta.get("rng_impl", "threefry2x32"))
  return Stream(cache, np.asarray(last, np.int32), rng)
