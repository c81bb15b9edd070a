"""AFT-simple (aft_jax/ops/simple.py) against float64 references: the chunked causal sums, the
Triton kernel in Pallas' interpreter and the TPU kernel interpreted."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from aft_jax import ops
from aft_jax.ops import logsumexp as lse
from aft_jax.ops import simple
from aft_jax.ops.pallas import mosaic_simple, triton, triton_simple
from benchmarks import kernel_form
from tests.support import numpy_reference as ref
from tests.support.helpers import equations
from tests.support.op_cases import (
  ATOL, RTOL, dense_op, kernel_inputs, qkvw, rand, simple_reference,
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


def test_precision_policy():
  """bf16 inputs: matrix products of bf16 factors accumulated in float32; float32 inputs: float32
  products at HIGHEST precision (no TF32/bf16 passes on accelerators)."""
  check_precision(lambda q, k, v: ops.aft_simple(q, k, v, causal=True, impl="xla"))


def check_precision(fn):
  """``fn(q, k, v)``'s products, forward and tangent, follow the precision policy."""
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


# --------------------------------------------------------------------------- the Triton kernel


def test_scan_reference_is_the_loop_reference():
  q, k, v, _ = kernel_inputs(7, 3)
  out, _ = simple_reference(q, k, v, None)
  np.testing.assert_allclose(out, ref.aft_simple(q, k, v, causal=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t_len", [1, 7, 128, 1000])
def test_triton_kernel(t_len):
  """The sequential form (auto would split T = 1000 into segments: tested below): values and
  gradients, std 1 and 40, T not a multiple of the chunk (7, 1000)."""
  q, k, v, ct = kernel_inputs(t_len, 16, seed=t_len)
  fn = functools.partial(ops.aft_simple, causal=True, impl="pallas_interpret")
  with kernel_form.forced("sequential"):
    _assert_matches(kernel_grads(fn, (q, k, v), ct), simple_reference(q, k, v, ct))


def test_triton_kernel_long_sequence_forward():
  """T = 4096: ``auto`` takes the chunk-parallel form (32 segments of 128: two fold blocks)."""
  assert triton.plan_for(2, 4096, 16).seg == 128
  q, k, v, _ = kernel_inputs(4096, 16, seed=3)
  out = jax.jit(functools.partial(ops.aft_simple, causal=True, impl="pallas_interpret"))(q, k, v)
  want = simple_reference(q, k, v, None)[0]
  chex.assert_trees_all_close(out, want, rtol=RTOL, atol=ATOL)


def test_triton_kernel_bfloat16_inputs():
  """bf16 in, bf16 out, float32 inside: as close to the float32 result as the XLA path's."""
  q, k, v, _ = kernel_inputs(37, 32)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  out16 = ops.aft_simple(bf(q), bf(k), bf(v), causal=True, impl="pallas_interpret")
  assert out16.dtype == jnp.bfloat16
  xla16 = ops.aft_simple(bf(q), bf(k), bf(v), causal=True, impl="xla")
  chex.assert_trees_all_close(out16.astype(jnp.float32), xla16.astype(jnp.float32), atol=2e-2)


def kernel_grads(fn, args, ct):
  """fn(*args) and the gradients of sum(fn * ct) in every argument, jitted once."""
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct)
  grads = jax.grad(loss, argnums=tuple(range(len(args))))
  return jax.jit(lambda *a: (fn(*a), grads(*a)))(*args)


def assert_close(got, want, rtol):
  """Outputs and gradients within ``rtol`` of the largest magnitude of each."""
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g = np.asarray(g, np.float32)
    np.testing.assert_allclose(g, x, rtol=rtol, atol=rtol * np.abs(x).max() + 1e-6)


@pytest.mark.parametrize(
  "t_len, seg, dtype",
  [(600, 32, jnp.float32), (100, 16, jnp.bfloat16)],
  ids=["T600-seg32-f32", "T100-seg16-bf16"],
)
def test_triton_kernel_chunk_parallel(t_len, seg, dtype):
  """The chunk-parallel form (``seg`` positions per program): values and gradients, std 1 and
  40 (segment totals whose maxima differ by far more than float32's range), T ragged, 19
  segments (two fold blocks) or 7, bf16 inputs with float32 sums."""
  q, k, v, ct = kernel_inputs(t_len, 16, seed=t_len)
  cfg = triton.CONFIGS[-1]
  fn = lambda q, k, v: jax.nn.sigmoid(q) * triton_simple.causal_mean(k, v, cfg, True, seg)
  args = tuple(jnp.asarray(x, dtype) for x in (q, k, v))
  # The reference from the rounded inputs: bf16 then only rounds the outputs (8 bits).
  want = simple_reference(*(np.asarray(x, np.float32) for x in args), ct)
  assert_close(kernel_grads(fn, args, ct), want, 1e-4 if dtype == jnp.float32 else 2e-2)
  with pytest.raises(ValueError, match="whole chunks of 16"):
    triton_simple.causal_mean(k, v, cfg, True, seg + 8)


# --------------------------------------------------------------------------- the TPU kernel

D = 128  # one lane tile: the smallest channel count the TPU kernel takes


def _tpu(q, k, v, ct):
  """sigma(q) * the interpreted TPU kernel's mean, and the gradients (q, k, v) of sum(out * ct)."""
  fn = lambda q, k, v: jax.nn.sigmoid(q) * mosaic_simple.causal_mean(k, v, None, True)
  return kernel_grads(fn, (q, k, v), ct)


def _assert_matches(got, want, rows=(0, 1)):
  """Output (RTOL, ATOL) and gradients (1e-4 of the largest) of the given batch rows."""
  (out, grads), (want_out, want_grads) = got, want
  chex.assert_trees_all_close(out[rows,], want_out[rows,], rtol=RTOL, atol=ATOL)
  for g, w in zip(grads, want_grads):
    g, w = g[rows,], w[rows,]
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


@pytest.mark.parametrize("t_len", [1, 7, 128, 1000])
def test_tpu_kernel(t_len):
  """Values and gradients, logits of std 1 (batch row 0) and 40 (row 1); T shorter than a
  chunk (1, 7), one chunk (128), and ragged over several (1000)."""
  q, k, v, ct = kernel_inputs(t_len, D, seed=t_len)
  _assert_matches(_tpu(q, k, v, ct), simple_reference(q, k, v, ct))


def test_tpu_kernel_widest_channel_block():
  """block_d 512 (four lane tiles, as ``config_for`` picks for wide layers), two chunks with a
  ragged end."""
  q, k, v, ct = kernel_inputs(150, 512, seed=8)
  cfg = mosaic_simple.CONFIGS[0]
  assert cfg.block_d == 512 and mosaic_simple.config_for(512, batch=2) == cfg
  _assert_matches(_tpu(q, k, v, ct), simple_reference(q, k, v, ct))


def test_tpu_kernel_long_sequence_forward():
  q, k, v, _ = kernel_inputs(4096, D, seed=3)
  out = jax.jit(lambda q, k, v: jax.nn.sigmoid(q) * mosaic_simple.causal_mean(k, v, None, True))
  want = simple_reference(q, k, v, None)[0]
  chex.assert_trees_all_close(out(q, k, v), want, rtol=RTOL, atol=ATOL)


def test_tpu_kernel_exact_paths_are_taken_and_needed(monkeypatch):
  """At std 40 the fast paths alone are wrong (the chunk's early denominators underflow; L
  rises past what one shift can hold), so the reference test above passes only through the
  exact scans; forced everywhere, the scans alone are exact at std 1 and 40."""
  q, k, v, ct = kernel_inputs(300, D, seed=4)
  want = simple_reference(q, k, v, ct)
  exp_max = lse.EXP_MAX
  monkeypatch.setattr(mosaic_simple, "MIN_DEN", 0.0)  # forward: fast path only (no term set
  monkeypatch.setattr(lse, "EXP_MAX", np.inf)  # aside either, however far k rises)
  out, grads = _tpu(q, k, v, ct)
  assert not np.all(np.isclose(out[1], want[0][1], rtol=RTOL, atol=ATOL))
  _assert_matches((out, grads), want, rows=(0,))  # std 1 never needed the scan
  monkeypatch.setattr(mosaic_simple, "MIN_DEN", mosaic_simple.DEN_OK)
  monkeypatch.setattr(lse, "EXP_MAX", exp_max)
  monkeypatch.setattr(mosaic_simple, "MAX_RISE", np.inf)  # backward: fast path only
  jax.clear_caches()  # the thresholds are read when traced (newer jax caches custom_vjp traces)
  out, grads = _tpu(q, k, v, ct)
  chex.assert_trees_all_close(out, want[0], rtol=RTOL, atol=ATOL)
  assert not np.all(np.isclose(grads[1][1], want[1][1][1], rtol=1e-4, atol=1e-4))
  monkeypatch.setattr(mosaic_simple, "MIN_DEN", np.inf)  # both: the exact scans only
  monkeypatch.setattr(mosaic_simple, "MAX_RISE", -1.0)
  jax.clear_caches()
  _assert_matches(_tpu(q, k, v, ct), want)


def test_tpu_kernel_bfloat16_inputs():
  """bf16 k, v (float32 inside, a float32, dk and dv bf16): within 2e-2 of the largest output
  or gradient of the float32 computation on the same (rounded) inputs, std 1 and 40."""
  q, k, v, ct = kernel_inputs(200, D, seed=5)
  k16, v16 = (jnp.asarray(x, jnp.bfloat16) for x in (k, v))
  out, grads = _tpu(q, k16, v16, ct)
  assert out.dtype == jnp.float32 and [g.dtype for g in grads[1:]] == [jnp.bfloat16] * 2
  want_out, want_grads = simple_reference(q, np.float32(k16), np.float32(v16), ct)
  for got, want in zip((out, *grads), (want_out, *want_grads)):
    got = np.asarray(got, np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
