"""AFT-simple (aft_jax/ops/simple.py) against float64 references: the chunked causal sums (its
kernels: tests/ops/test_pallas.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from aft_jax import ops
from aft_jax.ops import simple
from tests.support import numpy_reference as ref
from tests.support.helpers import equations
from tests.support.op_cases import (
  dense_op, qkvw, rand,
)  # fmt: skip


@pytest.mark.parametrize("t_len,scale", [(1, 40.0), (37, 40.0), (300, 40.0), (256, 1.0)])
def test_causal_derivatives_exact_at_large_logits(t_len, scale):
  """The custom JVP (and the reverse mode transposed from it): float32 against a dense float64
  softmax, at logits of std 40 (where chunks are recomputed with a running maximum), over
  several chunks (T = 37, 300: a padded last chunk)."""
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


@pytest.mark.parametrize("t_len", [1, 13, 16])
def test_causal_mean_small_chunks(t_len):
  """Chunks of 4 positions (the last one padded when 4 does not divide T), at ordinary and huge
  logits (chunks recomputed sequentially): values against the float64 loop reference,
  derivatives in both modes against finite differences."""
  with jax.enable_x64(True):
    for scale in (1.0, 100.0):
      rng = np.random.default_rng(t_len)
      k = jnp.asarray(rng.normal(size=(t_len, 3)) * scale)
      v = jnp.asarray(rng.normal(size=(t_len, 3)))
      fn = jax.jit(functools.partial(simple.causal_mean, chunk=4))
      q = np.full((t_len, 3), np.inf)  # sigma(q) = 1: the reference gives the mean itself
      expected = ref.aft_simple(q, np.asarray(k), np.asarray(v), True)
      np.testing.assert_allclose(fn(k, v), expected, rtol=1e-10, atol=1e-12)
      check_grads(fn, (k, v), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [0, 8])
def test_precision_policy(window):
  """AFT-simple's and (window 8) AFT-local's products, forward and tangent: bf16 inputs, bf16
  factors accumulated in float32; float32 inputs, float32 at HIGHEST (no TF32/bf16 passes)."""
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
