"""Every layer and the language model as a Flax NNX module (docs/nnx.md): the linen module of
``layers`` / ``model`` (the one source of the code) with its parameters as ``nnx.Param``
attributes under their linen names (the same tree, logical axis names kept), decoding with the
state as a value the caller holds: ``y, state = layer(x, state=state)``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta

from aft_jax import layers, model


class _Params(nnx.Module):
  """A sub-tree of a linen module's parameters, its names as attributes."""


def _attach(node: nnx.Module, tree: dict) -> nnx.Module:
  # Placed on the mesh by its logical axis rules where both are set (as the trainer places them).
  eager = meta.get_global_mesh() is not None and bool(nn.get_logical_axis_rules())
  for name, x in tree.items():
    if isinstance(x, dict):
      setattr(node, name, _attach(_Params(), x))
    elif isinstance(x, meta.AxisMetadata):
      setattr(node, name, nnx.Param(**x.to_nnx_metadata(), eager_sharding=eager))
    else:
      setattr(node, name, nnx.Param(x))
  return node


def _shapes(tree) -> dict:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path, simple=True, separator="/"): jnp.shape(x) for path, x in flat}


class Linen(nnx.Module):
  """The linen module ``definition`` as an ``nnx.Module``, its parameters initialised on
  ``example`` (an input) with ``rngs``, or ``params`` (a linen tree, e.g. a trained run's)."""

  def __init__(self, definition: nn.Module, example, *, rngs: nnx.Rngs | None = None, params=None):
    if (rngs is None) == (params is None):
      raise ValueError(f"{type(definition).__name__}: give rngs (new parameters) or params, one")
    self.definition = definition
    init = lambda key, x: definition.init(key, x)["params"]
    if params is None:
      tree = jax.jit(init)(rngs.params(), example)
    else:
      tree = jax.eval_shape(init, jax.random.key(0), example)
      want, got = _shapes(nn.unbox(tree)), _shapes(params)
      if want != got:
        keys = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        raise ValueError(
          f"{type(definition).__name__}: params must be its whole tree; these differ (given, "
          f"wanted; None: absent): { {k: (got.get(k), want.get(k)) for k in keys} }"
        )
      tree = meta.replace_boxed(tree, params)
    _attach(self, jax.tree.map(jnp.asarray, tree))

  def linen_params(self) -> dict:
    """The parameters as the linen tree (``definition.apply({"params": ...})``, export)."""
    return nnx.to_pure_dict(nnx.state(self, nnx.Param))

  def __call__(self, *args, state=None, **kwargs):
    """``definition``'s output; with ``state`` (``init_state``'s), one decoding call: (output,
    the state after it). ``kwargs`` as linen's (``rngs={"dropout": key}`` with ``train``)."""
    variables = {"params": self.linen_params()}
    if state is None:
      return self.definition.apply(variables, *args, **kwargs)
    out, mutated = self.definition.apply(
      {**variables, "cache": state}, *args, decode=True, mutable=["cache"], **kwargs
    )
    return out, mutated["cache"]

  def init_state(self, x):
    """The decoding state before any token, for inputs shaped like ``x`` (one token)."""
    init = lambda x: self.definition.init(jax.random.key(0), x, decode=True)["cache"]
    return jax.jit(init)(x)


class _Layer(Linen):
  linen: type[nn.Module]
  lead = 2  # [B, T, d_model] (AFTConv2D: [B, Ht, Wd, d_model])

  def __init__(self, d_model: int, *, rngs: nnx.Rngs, **settings):
    """The layer ``linen(**settings)`` for inputs ``[..., d_model]``."""
    example = jnp.zeros((1,) * self.lead + (d_model,))
    super().__init__(self.linen(**settings), example, rngs=rngs)


def _layer(linen: type[nn.Module], lead: int = 2) -> type[_Layer]:
  doc = f"``layers.{linen.__name__}`` as an ``nnx.Module``: ``(d_model, *, rngs, **settings)``."
  body = {"linen": linen, "lead": lead, "__doc__": doc, "__module__": __name__}
  return type(linen.__name__, (_Layer,), body)


AFTFull, AFTLocal = _layer(layers.AFTFull), _layer(layers.AFTLocal)
AFTSimple, AFTDecay = _layer(layers.AFTSimple), _layer(layers.AFTDecay)
AFTConv1D, AFTConv2D = _layer(layers.AFTConv1D), _layer(layers.AFTConv2D, lead=3)
MultiHeadAttention = _layer(layers.MultiHeadAttention)


class TransformerLM(Linen):
  """``model.TransformerLM(cfg)``: ``model(tokens_BT)`` log-probabilities ``[B, T, V]``,
  ``model(tokens_BT, targets_BT)`` the per-token NLL."""

  def __init__(self, cfg: model.ModelConfig, *, rngs: nnx.Rngs | None = None, params=None):
    example = jnp.zeros((1, 1), jnp.int32)
    super().__init__(model.TransformerLM(cfg), example, rngs=rngs, params=params)
