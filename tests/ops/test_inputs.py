"""Bad inputs are refused up front with a one-line ValueError naming the argument; empty
inputs give empty outputs; the layers refuse factor_dim < 0 and decode NaN past max_len."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import layers, ops

X = np.zeros((2, 6, 4), np.float32)
W = np.zeros((6, 6), np.float32)


def _calls(q, k, v, w):
  """Every op on q, k, v [..., T, D] (AFT-conv: D heads of one channel) and w [T, T]."""
  ker = np.zeros((q.shape[-1], 3), np.float32) if w.dtype.kind == "f" else w[:1, :3]
  return {
    "aft_full": lambda: ops.aft_full(q, k, v, w, causal=True),
    "aft_local": lambda: ops.aft_local(q, k, v, w, window=2, causal=True),
    "aft_simple": lambda: ops.aft_simple(q, k, v, causal=True),
    "aft_simple_nc": lambda: ops.aft_simple(q, k, v),
    "aft_conv1d": lambda: ops.aft_conv1d(q[..., None], k, v[..., None], ker, causal=True),
  }


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_non_floating_inputs_are_refused(dtype, arg):
  xs = {"q": X, "k": X, "v": X}
  xs[arg] = X.astype(dtype)
  name = np.dtype(dtype).name
  for op, call in _calls(xs["q"], xs["k"], xs["v"], W).items():
    with pytest.raises(ValueError, match=rf"must be a real floating-point array; got {arg} {name}"):
      call()


def test_non_floating_bias_and_kernel_are_refused():
  with pytest.raises(ValueError, match=r"aft_full: w must be a real floating-point.*int32"):
    ops.aft_full(X, X, X, W.astype(np.int32))
  with pytest.raises(ValueError, match=r"aft_conv1d: kernel must be a real floating-point"):
    ops.aft_conv1d(X[..., None], X, X[..., None], np.zeros((4, 3), np.int32), causal=True)


@pytest.mark.parametrize("shape", [(2, 0, 4), (2, 6, 0), (0, 6, 4)])
def test_empty_inputs_give_empty_outputs(shape):
  x = np.zeros(shape, np.float32)
  t = shape[1]
  for op, call in _calls(x, x, x, np.zeros((t, t), np.float32)).items():
    out = call()
    assert out.size == 0 and out.dtype == jnp.float32, op
    assert out.shape[: len(shape)] == shape, op


def test_factor_dim_below_zero_is_refused():
  x = jnp.zeros((1, 4, 8))
  with pytest.raises(ValueError, match=r"AFTFull: factor_dim must be an int >= 0.*got -1"):
    layers.AFTFull(max_len=8, factor_dim=-1).init(jax.random.key(0), x)
  for f in (0, None):  # a full bias
    layers.AFTFull(max_len=8, factor_dim=f).init(jax.random.key(0), x)


@pytest.mark.parametrize("cls", [layers.AFTFull, layers.AFTLocal])
def test_decoding_past_max_len_gives_nan(cls):
  module = cls(max_len=3, causal=True)
  x = jax.random.normal(jax.random.key(1), (1, 1, 8))
  variables = {"params": module.init(jax.random.key(0), jnp.tile(x, (1, 3, 1)))["params"]}
  cache = module.init(jax.random.key(0), x, decode=True)["cache"]
  step = jax.jit(
    lambda c, x: module.apply({**variables, "cache": c}, x, decode=True, mutable="cache")
  )
  outs = []
  for _ in range(5):
    y, upd = step(cache, x)
    cache = upd["cache"]
    outs.append(np.asarray(y))
  assert all(np.isfinite(y).all() for y in outs[:3])
  assert all(np.isnan(y).all() for y in outs[3:])
