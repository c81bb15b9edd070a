"""The layers and the model from Flax NNX, through ``flax.nnx.bridge.ToNNX`` (no second copy of
any module: the NNX object runs the same linen code and the same ``aft_jax.ops``).

    from aft_jax.layers import AFTLocal
    from aft_jax.nnx_bridge import to_nnx

    layer = to_nnx(AFTLocal(max_len=128, window=16, causal=True), x_BTD)  # an nnx.Module
    y_BTD = layer(x_BTD)                         # [B, T, D] -> [B, T, D], as layer.apply
    params = nnx.state(layer, nnx.Param)         # its parameters, as NNX state

``to_nnx`` wraps a linen module in ``ToNNX`` and initialises it from example inputs
(``bridge.lazy_init``); ``params=`` puts given linen parameters in (a trained run's, or
``load_pretrained``'s): the whole tree, as linen's ``apply`` takes it (a missing, extra or
misshapen parameter is a ValueError naming its path, never left at its random init). The
parameters keep their logical axis names as NNX metadata
(``out_sharding``); they are created unsharded (``nnx.use_eager_sharding(False)``), since no
mesh is set up here: shard them with the project's rules where a mesh is.

Decoding: the bridge carries the ``cache`` collection when it is called with
``mutable=["cache"]``: ``start_decoding`` creates the cache (as ``model.init(..., decode=True)``
does in linen), or empties it to start a new sequence, and returns the empty cache;
``decode_step`` feeds one token ``[B, 1]`` at a time, updating the cache in the NNX object (a
ValueError before ``start_decoding``); the outputs equal the causal full-sequence ones
(``tests/test_nnx_bridge.py``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import bridge


def to_nnx(module, *example_args, params=None, seed: int = 0, **example_kwargs) -> bridge.ToNNX:
  """``module`` (a linen layer or ``TransformerLM``) as an initialised ``nnx.Module``.

  ``example_args`` / ``example_kwargs``: inputs of the call that initialises it (shapes only
  matter); ``params``: linen parameters to use instead of fresh ones (the tree
  ``module.init(...)["params"]`` has).
  """
  nnx_module = bridge.ToNNX(module, rngs=nnx.Rngs(seed))
  # Initialised as one compiled program (nnx.jit carries the new variables out): run op by op,
  # a model's init compiles each of its operations on its own, several times slower.
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
  """ValueError unless ``got`` has every parameter of ``want`` (the module's), no other, each of
  its shape: linen's ``apply`` refuses a partial tree too, and a parameter left out would stay
  at its random init."""
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
  """Creates the decoding cache for inputs shaped like ``x_B1`` ([B, 1, ...]), or empties the
  one there (a new sequence), and returns it as it is before any token: ``nnx.update(nnx_module,
  returned)`` starts a new sequence too."""
  # Created only where there is none (linen's cache variables initialise when they do not
  # exist; an existing cache would take a step instead).
  nnx.pop(nnx_module, nnx.Cache)
  create = nnx.jit(lambda m, x: m(x, decode=True, mutable=["cache"]))  # no step is taken
  with nnx.use_eager_sharding(False):
    create(nnx_module, x_B1)
  return nnx.clone(nnx.state(nnx_module, nnx.Cache))


def decode_step(nnx_module: bridge.ToNNX, x_B1):
  """One decoding step on ``x_B1`` ([B, 1, ...]); the cache in ``nnx_module`` moves on. A
  ValueError before ``start_decoding``: without a cache the call would create one and return
  its init-time placeholder, not a step's output."""
  if not jax.tree.leaves(nnx.state(nnx_module, nnx.Cache)):
    raise ValueError(
      "decode_step: the module has no decoding cache; call start_decoding(module, x_B1) first"
    )
  return nnx_module(x_B1, decode=True, mutable=["cache"])
