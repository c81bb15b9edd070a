"""Checksums of a checkpoint's contents, one per array of the state and one per JSON item (why
per array: docs/training.md, "Checkpoint integrity"). An array's is two 32-bit sums, computed
on its devices, whatever its sharding:

    s = sum_i mix(bits_i ^ mix(i ^ seed))   (mod 2**32), for two seeds

``bits_i``: element i's bit pattern as uint32 words, i its row-major position, ``mix`` the
MurmurHash3 finaliser (a bijection: a change within one word changes both sums for certain;
changes to several cancel with a chance of about 2**-64). JSON items: SHA-256 of canonical JSON.
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

VERSION = 1
_SEEDS = (0x9E3779B9, 0x7F4A7C15)  # two lanes: 64 bits of checksum per array


def _mix(h):
  """MurmurHash3's 32-bit finaliser (lax on NumPy scalars: jnp's checks were slow to trace)."""
  shr = lambda h, n: lax.shift_right_logical(h, np.uint32(n))
  h = lax.mul(lax.bitwise_xor(h, shr(h, 16)), np.uint32(0x85EBCA6B))
  h = lax.mul(lax.bitwise_xor(h, shr(h, 13)), np.uint32(0xC2B2AE35))
  return lax.bitwise_xor(h, shr(h, 16))


def _words(x):
  """The bits of ``x`` as uint32: one word per element ([..., k] for 8-byte dtypes)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return lax.convert_element_type(x, np.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size < 4:
    narrow = lax.bitcast_convert_type(x, np.dtype(f"uint{8 * size}"))
    return lax.convert_element_type(narrow, np.uint32)
  return lax.bitcast_convert_type(x, np.uint32)


def _sums(x):
  w = _words(x)
  position = lax.full(w.shape, np.uint32(0))
  for d, n in enumerate(w.shape):  # row-major index, built per axis: no reshape of a sharded x
    position = lax.add(lax.mul(position, np.uint32(n)), lax.broadcasted_iota(np.uint32, w.shape, d))
  return jnp.stack(
    [
      jnp.sum(
        _mix(lax.bitwise_xor(w, _mix(lax.bitwise_xor(position, np.uint32(s))))), dtype=jnp.uint32
      )
      for s in _SEEDS
    ]
  )


_tree_sums = jax.jit(lambda tree: jax.tree_util.tree_map(_sums, tree))


def of_arrays(tree) -> dict[str, str]:
  """{path: "dtype[shape]:sums"} of every array of ``tree`` (path: ``jax.tree_util.keystr``)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  sums = jax.device_get(_tree_sums([x for _, x in leaves]))
  return {
    jax.tree_util.keystr(p): f"{x.dtype}{list(x.shape)}:{int(s[0]):08x}{int(s[1]):08x}"
    for (p, x), s in zip(leaves, sums)
  }


def of_json(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def record(state, items: dict) -> dict:
  """What a checkpoint keeps of its contents: the arrays of ``state`` and the JSON ``items``."""
  return {
    "version": VERSION,
    "arrays": of_arrays(state),
    "json": {name: of_json(obj) for name, obj in items.items()},
  }


def array_mismatches(saved: dict, state) -> list[str]:
  """The arrays (paths) of ``state`` that do not match ``saved`` (``record``'s dict), sorted."""
  now, was = of_arrays(state), saved.get("arrays", {})
  return [p for p in sorted(set(was) | set(now)) if was.get(p) != now.get(p)]


def json_mismatches(saved: dict, items: dict) -> list[str]:
  """The JSON items (names) that do not match ``saved``, a lost one too, sorted."""
  now, was = {n: of_json(v) for n, v in items.items()}, saved.get("json", {})
  return [n for n in sorted(set(was) | set(now)) if was.get(n) != now.get(n)]
