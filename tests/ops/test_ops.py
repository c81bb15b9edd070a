"""What the ops hold together: their identities; bfloat16 is close to float32."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import ops
from tests.support.op_cases import qkvw, rand


same = functools.partial(chex.assert_trees_all_close, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_identities(causal):
  """Wide AFT-local is AFT-full, zero-bias AFT-simple; zero-kernel AFT-conv1d AFT-simple."""
  q, k, v, w = qkvw(7, (2,), 12, 5, 3.0)
  for window in (12, 50):
    same(
      ops.aft_local(q, k, v, w, window=window, causal=causal),
      ops.aft_full(q, k, v, w, causal=causal),
    )
  q, k, v, _ = qkvw(8, (2,), 12, 5, 3.0)
  w = np.zeros((12, 12), np.float32)
  same(ops.aft_local(q, k, v, w, window=3, causal=causal), ops.aft_simple(q, k, v, causal=causal))
  q, v = rand(9, (2, 8, 2, 3), (2, 8, 2, 3))
  (k,) = rand(10, (2, 8, 2), scale=3.0)
  out = ops.aft_conv1d(q, k, v, np.zeros((2, 3), np.float32), causal=causal)
  flat = lambda x: np.broadcast_to(x, q.shape).reshape(2, 8, 6)
  same(out, ops.aft_simple(flat(q), flat(k[..., None]), flat(v), causal=causal).reshape(q.shape))


def _causal_ops(t_len: int, d: int, window: int) -> dict:  # AFT-conv1d: 2 heads, kernel from w

  def conv1d(q, k, v, w):
    heads = lambda x: x.reshape(2, t_len, 2, d // 2)
    out = ops.aft_conv1d(heads(q), heads(k)[..., 0], heads(v), w[:2, :3], causal=True)
    return out.reshape(2, t_len, d)

  return {
    "full": lambda q, k, v, w: ops.aft_full(q, k, v, w, causal=True),
    "local": lambda q, k, v, w: ops.aft_local(q, k, v, w, window=window, causal=True),
    "simple": lambda q, k, v, w: ops.aft_simple(q, k, v, causal=True),
    "conv1d": conv1d,
  }


@pytest.mark.parametrize("name", ["full", "local", "simple", "conv1d"])
def test_bfloat16_close_to_float32(name):
  q, k, v, w = qkvw(19, (2,), 16, 8, 1.0)
  fn = jax.jit(_causal_ops(16, 8, window=4)[name])
  out32 = fn(q, k, v, w)
  out16 = fn(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, w)))
  assert out16.dtype == jnp.bfloat16
  # bf16 has an 8-bit mantissa: inputs carry ~0.4% rounding; outputs are O(1).
  chex.assert_trees_all_close(out16.astype(jnp.float32), out32, atol=3e-2, rtol=3e-2)
