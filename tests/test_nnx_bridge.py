"""aft_jax.nnx_bridge: every layer and the model from Flax NNX: apply, jit, decode, given params."""

import chex
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
X_BTD = jax.random.normal(jax.random.key(0), (2, T, D))
TOKENS_BT = jax.random.randint(jax.random.key(1), (2, T), 0, 20)
MODULES = {
  "aft_full": lambda: layers.AFTFull(max_len=T, causal=True),
  "aft_local": lambda: layers.AFTLocal(max_len=T, window=2, causal=True),
  "aft_simple": lambda: layers.AFTSimple(causal=True),
  "aft_conv1d": lambda: layers.AFTConv1D(num_heads=2, kernel_size=3, causal=True),
  "softmax": lambda: layers.MultiHeadAttention(num_heads=2, max_len=T, causal=True),
  "model": lambda: TransformerLM(
    ModelConfig(
      vocab_size=20, num_layers=1, d_model=D, num_heads=2, mlp_dim=16, max_len=T, window=2
    )
  ),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_causal_layer_and_the_model_apply_and_decode_from_nnx(name):
  module = MODULES[name]()
  x = TOKENS_BT if name == "model" else X_BTD
  if name == "model":  # given parameters (e.g. load_pretrained's), numpy arrays
    params = jax.jit(module.init)(jax.random.key(7), x)["params"]
    m = nnx_bridge.to_nnx(module, x, params=jax.tree_util.tree_map(np.asarray, params))
  else:
    m = nnx_bridge.to_nnx(module, x)
    params = nnx_bridge.linen_params(m)
  assert isinstance(m, nnx.Module)
  want = jax.jit(module.apply)({"params": params}, x)
  chex.assert_tree_all_finite(want)
  chex.assert_trees_all_close(CALL(m, x), want, atol=1e-6)
  # Decoding before the cache exists would return the init-time placeholder: refused.
  with pytest.raises(ValueError, match=r"no decoding cache; call start_decoding"):
    STEP(m, x[:, :1])
  start = nnx_bridge.start_decoding(m, x[:, :1])
  steps = [STEP(m, x[:, t : t + 1]) for t in range(T)]
  chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), want, atol=1e-5)
  nnx.update(m, start)  # a new sequence: its first step is the first step again
  chex.assert_trees_all_close(STEP(m, x[:, :1]), steps[0], atol=1e-6)
  # So after a second start_decoding (which empties the cache, not steps it): two steps again.
  nnx_bridge.start_decoding(m, x[:, :1])
  again = [STEP(m, x[:, t : t + 1]) for t in range(2)]
  chex.assert_trees_all_close(again, steps[:2], atol=1e-6)


def test_given_parameters_are_the_whole_tree_or_refused():
  layer = MODULES["aft_local"]()
  params = nn.unbox(jax.jit(layer.init)(jax.random.key(3), X_BTD)["params"])
  partial = {name: p for name, p in params.items() if name != "out"}  # linen: a flax error
  extra = {**params, "extra": {"kernel": np.zeros((2, 2), np.float32)}}
  wrong = {**params, "out": {**params["out"], "kernel": np.zeros((D, 3), np.float32)}}
  for bad, message in [
    (partial, r"missing \['out/bias', 'out/kernel'\], not the module's none"),
    (extra, r"missing none, not the module's \['extra/kernel'\]"),
    (wrong, rf"params out/kernel must be \({D}, {D}\); got \({D}, 3\)"),
  ]:
    with pytest.raises(ValueError, match=message):
      nnx_bridge.to_nnx(layer, X_BTD, params=bad)
  m = nnx_bridge.to_nnx(layer, X_BTD, params=params)  # the whole tree: its values
  chex.assert_trees_all_close(nnx_bridge.linen_params(m), params)
