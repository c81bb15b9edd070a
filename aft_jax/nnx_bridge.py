"""The layers and the model from Flax NNX through ``flax.nnx.bridge.ToNNX`` (the same linen
code): docs/training.md, "From Flax NNX"."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import bridge


def to_nnx(module, *example_args, params=None, seed: int = 0, **example_kwargs) -> bridge.ToNNX:
  """``module`` (a linen layer or ``TransformerLM``) as an ``nnx.Module`` initialised (unsharded)
  on the example inputs; ``params``: the whole linen tree to use instead of fresh ones."""
  nnx_module = bridge.ToNNX(module, rngs=nnx.Rngs(seed))
  # One compiled program (nnx.jit carries the new variables out), not a compile per op.
  init = nnx.jit(lambda m: bridge.lazy_init(m, *example_args, **example_kwargs))
  with nnx.use_eager_sharding(False):
    init(nnx_module)
  if params is not None:
    state = nnx.state(nnx_module, nnx.Param)
    params = jax.tree_util.tree_map(jnp.asarray, nn.unbox(params))
    _check_params(nnx.to_pure_dict(state), params)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(nnx_module, state)
  return nnx_module


def _check_params(want: dict, got) -> None:
  """ValueError unless ``got`` has exactly ``want``'s parameters and shapes (no random ones)."""
  flat = lambda tree: {
    jax.tree_util.keystr(path, simple=True, separator="/"): jnp.shape(x)
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }
  want, got = flat(want), flat(got)
  missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
  if missing or extra:
    raise ValueError(
      f"to_nnx: params must be the module's whole parameter tree; missing {missing or 'none'}, "
      f"not the module's {extra or 'none'}"
    )
  for path in sorted(want):
    if got[path] != want[path]:
      raise ValueError(f"to_nnx: params {path} must be {want[path]}; got {got[path]}")


def linen_params(nnx_module: bridge.ToNNX) -> dict:
  """The NNX module's parameters as the linen tree (``module.apply({"params": ...})``, export)."""
  return nnx.to_pure_dict(nnx.state(nnx_module, nnx.Param))


def start_decoding(nnx_module: bridge.ToNNX, x_B1) -> nnx.State:
  """Creates (or empties: a new sequence) the decoding cache for inputs like ``x_B1`` ([B, 1,
  ...]) and returns it; ``nnx.update(nnx_module, returned)`` starts a new sequence too."""
  # Popped first: linen creates cache variables only where there are none.
  nnx.pop(nnx_module, nnx.Cache)
  create = nnx.jit(lambda m, x: m(x, decode=True, mutable=["cache"]))  # no step is taken
  with nnx.use_eager_sharding(False):
    create(nnx_module, x_B1)
  return nnx.clone(nnx.state(nnx_module, nnx.Cache))


def decode_step(nnx_module: bridge.ToNNX, x_B1):
  """One decoding step on ``x_B1`` ([B, 1, ...]), the cache moving on; a ValueError before
  ``start_decoding`` (the call would create a cache, not take a step)."""
  if not jax.tree.leaves(nnx.state(nnx_module, nnx.Cache)):
    raise ValueError(
      "decode_step: the module has no decoding cache; call start_decoding(module, x_B1) first"
    )
  return nnx_module(x_B1, decode=True, mutable=["cache"])
