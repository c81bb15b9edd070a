"""AFT-simple's chunked causal sums (aft_jax/ops/simple.py) against float64 references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import ops
from aft_jax.ops import simple
from tests.support.helpers import equations
from tests.support.op_cases import (
  dense_op, qkvw, rand,
)  # fmt: skip


@pytest.mark.parametrize("t_len,scale", [(1, 40.0), (37, 40.0), (300, 40.0), (256, 1.0)])
def test_causal_derivatives_exact_at_large_logits(t_len, scale):
  """Both modes against a dense float64 softmax at std 40 (chunks recomputed), chunks padded."""
  q, k, v, _ = qkvw(22, (2,), t_len, 3, scale)
  ct, tk, tv = rand(23, q.shape, q.shape, q.shape)
  fn = jax.jit(functools.partial(ops.aft_simple, causal=True))

  dense = lambda q, k, v: dense_op(0, True)(q, k, v, None)

  def derivatives(f, q, k, v, ct, tk, tv):  # reverse mode (q, k, v), forward mode (k, v)
    rev = jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2))(q, k, v)
    return rev, jax.jvp(lambda k, v: f(q, k, v), (k, v), (tk, tv))[1]

  with jax.enable_x64(True):
    x64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v, ct, tk, tv))
    want_rev, want_fwd = jax.tree.map(
      np.asarray, jax.jit(derivatives, static_argnums=0)(dense, *x64)
    )
  rows = lambda x: np.swapaxes(x, 0, 1).reshape(t_len, -1)
  c = min(simple.CHUNK, t_len)
  chunks = lambda x: simple._chunked(x, c, -1e30)
  chunked_forward = jax.jit(lambda k, v: simple._forward(chunks(k), chunks(v), False))
  recomputed = chunked_forward(rows(k), rows(v))[3]
  assert bool(np.any(recomputed)) == (scale > 1.0 and t_len > 1), recomputed
  got_rev, got_fwd = jax.jit(derivatives, static_argnums=0)(fn, q, k, v, ct, tk, tv)
  for got, want in zip(got_rev + (got_fwd,), want_rev + (want_fwd,)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("window", [0, 8])
def test_precision_policy(window):
  """Products: bf16 factors summed in float32, or float32 at HIGHEST (no TF32 passes)."""
  w = jnp.zeros((64, 64))
  local = lambda q, k, v: ops.aft_local(q, k, v, w, window=window, causal=True, impl="xla")
  fn = local if window else lambda q, k, v: ops.aft_simple(q, k, v, causal=True, impl="xla")
  x = jnp.ones((2, 64, 16))
  for dtype in (jnp.bfloat16, jnp.float32):
    loss = lambda x: jnp.sum(fn(x, x, x).astype(jnp.float32))
    dots = list(equations(jax.make_jaxpr(jax.grad(loss))(x.astype(dtype)).jaxpr, "dot_general"))
    assert len(dots) >= 2  # forward and tangent products
    for eqn in dots:
      in_types = {v.aval.dtype for v in eqn.invars}
      if dtype == jnp.bfloat16:
        # The exact-recomputation branch (rare rows) stays float32.
        if in_types == {jnp.dtype(jnp.bfloat16)}:
          assert eqn.params["preferred_element_type"] == jnp.float32
      else:
        assert in_types == {jnp.dtype(jnp.float32)}
        assert eqn.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2, eqn
    if dtype == jnp.bfloat16:
      assert any({v.aval.dtype for v in e.invars} == {jnp.dtype(jnp.bfloat16)} for e in dots)
