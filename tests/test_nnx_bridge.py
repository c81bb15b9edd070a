"""aft_jax.nnx_bridge: every layer and the model from Flax NNX: apply, jit, decode, given params."""

import re

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aft_jax import layers, nnx_bridge
from aft_jax.model import ModelConfig, TransformerLM

T, D = 6, 8
CALL = nnx.jit(lambda module, x: module(x))  # one compilation per layer, not an op at a time
STEP = nnx.jit(nnx_bridge.decode_step)
LAYERS = {
  "aft_full": lambda: layers.AFTFull(max_len=T, causal=True),
  "aft_local": lambda: layers.AFTLocal(max_len=T, window=2, causal=True),
  "aft_simple": lambda: layers.AFTSimple(causal=True),
  "aft_conv1d": lambda: layers.AFTConv1D(num_heads=2, kernel_size=3, causal=True),
  "softmax": lambda: layers.MultiHeadAttention(num_heads=2, max_len=T, causal=True),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_each_causal_layer_inits_applies_and_decodes_from_nnx(name):
  x_BTD = jax.random.normal(jax.random.key(0), (2, T, D))
  layer = LAYERS[name]()
  m = nnx_bridge.to_nnx(layer, x_BTD)
  assert isinstance(m, nnx.Module)
  params = nnx_bridge.linen_params(m)
  want = layer.apply({"params": params}, x_BTD)
  chex.assert_trees_all_close(CALL(m, x_BTD), want, atol=1e-6)
  # A rank-1 input: linen's ValueError, word for word (not an IndexError from inside).
  with pytest.raises(ValueError) as linen_error:
    layer.apply({"params": params}, x_BTD[0, 0])
  with pytest.raises(ValueError, match=re.escape(str(linen_error.value))):
    m(x_BTD[0, 0])
  # Decoding before the cache exists would return the init-time placeholder: refused.
  with pytest.raises(ValueError, match=r"no decoding cache; call start_decoding"):
    STEP(m, x_BTD[:, :1])
  start = nnx_bridge.start_decoding(m, x_BTD[:, :1])
  steps = [STEP(m, x_BTD[:, t : t + 1]) for t in range(T)]
  chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), want, atol=1e-5)
  nnx.update(m, start)  # a new sequence: its first step is the first step again
  chex.assert_trees_all_close(STEP(m, x_BTD[:, :1]), steps[0], atol=1e-6)
  # So after a second start_decoding (which empties the cache, not steps it): two steps again.
  nnx_bridge.start_decoding(m, x_BTD[:, :1])
  again = [STEP(m, x_BTD[:, t : t + 1]) for t in range(2)]
  chex.assert_trees_all_close(again, steps[:2], atol=1e-6)


def test_given_parameters_are_the_whole_tree_or_refused():
  x_BTD = jax.random.normal(jax.random.key(0), (2, T, D))
  layer = LAYERS["aft_local"]()
  params = nn.unbox(jax.jit(layer.init)(jax.random.key(3), x_BTD)["params"])
  partial = {name: p for name, p in params.items() if name != "out"}
  with pytest.raises(flax.errors.ScopeParamNotFoundError):
    layer.apply({"params": partial}, x_BTD)
  with pytest.raises(
    ValueError, match=r"missing \['out/bias', 'out/kernel'\], not the module's none"
  ):
    nnx_bridge.to_nnx(layer, x_BTD, params=partial)
  extra = {**params, "extra": {"kernel": np.zeros((2, 2), np.float32)}}
  with pytest.raises(ValueError, match=r"missing none, not the module's \['extra/kernel'\]"):
    nnx_bridge.to_nnx(layer, x_BTD, params=extra)
  wrong = {**params, "out": {**params["out"], "kernel": np.zeros((D, 3), np.float32)}}
  with pytest.raises(ValueError, match=rf"params out/kernel must be \({D}, {D}\); got \({D}, 3\)"):
    nnx_bridge.to_nnx(layer, x_BTD, params=wrong)
  m = nnx_bridge.to_nnx(layer, x_BTD, params=params)  # the whole tree: its values
  chex.assert_trees_all_close(nnx_bridge.linen_params(m), params)


def test_the_image_layer_applies_from_nnx():
  x = jax.random.normal(jax.random.key(0), (1, 4, 4, D))
  layer = layers.AFTConv2D(num_heads=2, kernel_size=3)
  m = nnx_bridge.to_nnx(layer, x)
  want = jax.jit(layer.apply)({"params": nnx_bridge.linen_params(m)}, x)
  chex.assert_trees_all_close(CALL(m, x), want, atol=1e-6)


def test_the_model_from_nnx_takes_given_parameters_jits_and_decodes():
  cfg = ModelConfig(
    vocab_size=20, num_layers=1, d_model=D, num_heads=2, mlp_dim=16, max_len=T, window=2
  )
  model = TransformerLM(cfg)
  tokens_BT = jax.random.randint(jax.random.key(1), (2, T), 0, 20)
  params = jax.jit(model.init)(jax.random.key(7), tokens_BT)["params"]  # e.g. load_pretrained's
  m = nnx_bridge.to_nnx(model, tokens_BT, params=jax.tree_util.tree_map(np.asarray, params))
  want_BTV = jax.jit(model.apply)({"params": params}, tokens_BT)
  got_BTV = CALL(m, tokens_BT)
  chex.assert_trees_all_close(got_BTV, want_BTV, atol=1e-6)
  assert bool(jnp.all(jnp.isfinite(got_BTV)))
  nnx_bridge.start_decoding(m, tokens_BT[:, :1])
  steps = [STEP(m, tokens_BT[:, t : t + 1]) for t in range(T)]
  chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), want_BTV, atol=1e-5)
