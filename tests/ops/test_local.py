"""AFT-local (aft_jax/ops/local.py) against float64 references: the banded sums (which AFT-full
shares) block by block, and the Triton kernel in Pallas' interpreter (its pieces at an offset:
tests/ops/test_modes.py)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from aft_jax import ops
from aft_jax.ops import local
from aft_jax.ops.pallas import triton, triton_local
from tests.ops.test_simple import assert_close, check_precision, kernel_grads
from tests.support import numpy_reference as ref
from tests.support.helpers import equations
from tests.support.op_cases import (
  ATOL, RTOL, dense_op, kernel_inputs, qkvw, rand,
)  # fmt: skip


def _dense_reference(q, k, v, w, causal):
  """Vectorised float64 version of the loop reference (for sizes the loops are too slow for)."""
  q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
  t_len = w.shape[0]
  logits = k[..., None, :, :] + w[:, :, None]  # [..., t, t', D]
  if causal:
    logits = np.where(np.tril(np.ones((t_len, t_len), bool))[:, :, None], logits, -np.inf)
  p = np.exp(logits - logits.max(axis=-2, keepdims=True))
  y = (p * v[..., None, :, :]).sum(-2) / p.sum(-2)
  return y / (1.0 + np.exp(-q))


@pytest.mark.parametrize(
  "causal,window,scale",
  [
    (True, 32, 1.0),
    (True, 100, 40.0),
    (False, 50, 40.0),
    (False, 20, 1.0),
    (True, None, 40.0),
    (False, None, 1.0),
  ],
)
def test_banded_long_sequence(causal, window, scale):
  """T well above the block size: several query blocks (the last one overlapping), the running
  sums outside the window, and at scale 40 the exact recomputation of row groups. Values,
  reverse-mode and forward-mode derivatives (the custom JVP itself) against dense formulas.
  ``window=None``: AFT-full."""
  t_len = 300
  q, k, v, w = qkvw(20, (2,), t_len, 4, scale)
  if window is None:
    fn = functools.partial(ops.aft_full, causal=causal)
    bias = w
  else:
    fn = functools.partial(ops.aft_local, window=window, causal=causal)
    bias = ref.local_bias(w, window)

  plan = local.make_plan(t_len, 2 * 4, window or t_len, causal)
  assert plan.nb > 1 and plan.nb * plan.c > t_len, plan  # several blocks, the last overlapping
  rows = lambda x: np.swapaxes(x, 0, 1).reshape(t_len, -1)
  recomputed = jax.jit(lambda k, v, w: local._forward(plan, k, v, w))(rows(k), rows(v), w)[2]
  assert bool(np.any(recomputed)) == (scale > 1.0), recomputed.sum()

  dense = dense_op(window, causal)  # exact: a per-(t, d) maximum
  ct, tk, tv = rand(21, q.shape, q.shape, q.shape)
  (tw,) = rand(22, w.shape)

  @jax.jit
  def run(q, k, v, w, ct, tk, tv, tw):  # the op's values; both modes of the op and of dense
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3))(q, k, v, w)
    jvp = lambda f: jax.jvp(lambda k, v, w: f(q, k, v, w), (k, v, w), (tk, tv, tw))[1]
    return fn(q, k, v, w), (grad(fn), grad(dense)), (jvp(fn), jvp(dense))

  out, (grad_fn, grad_dense), (jvp_fn, jvp_dense) = run(q, k, v, w, ct, tk, tv, tw)
  expected = _dense_reference(q, k, v, bias, causal)
  chex.assert_trees_all_close(out, expected, rtol=RTOL, atol=ATOL)
  chex.assert_trees_all_close(grad_fn, grad_dense, rtol=1e-3, atol=1e-4)
  np.testing.assert_allclose(jvp_fn, jvp_dense, rtol=1e-3, atol=1e-4 * np.abs(jvp_dense).max())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t_len,window", [(13, 1), (13, 3), (13, 6), (16, 2), (16, 40)])
def test_banded_small_blocks(causal, t_len, window):
  """Blocks of 4 rows (the last one overlapping when 4 does not divide T): every layout case of
  the banded sums (windows narrower and wider than a block, clamped key ranges at both ends,
  running sums on both sides) against the float64 loop reference, and its derivatives in both
  modes against finite differences."""
  plan = local.make_plan(t_len, 3, window, causal, block=4)
  assert plan.nb == -(-t_len // 4)
  with jax.enable_x64(True):
    rng = np.random.default_rng(t_len * 100 + window)
    k, v = (jnp.asarray(rng.normal(size=(t_len, 3)) * 2) for _ in range(2))
    w = jnp.asarray(rng.normal(size=(t_len, t_len)))
    fn = jax.jit(functools.partial(local.banded_mean, plan))
    # The reference's output is sigma(q) * mean: q = +inf gives the mean itself.
    q = np.full((t_len, 3), np.inf)
    expected = ref.aft_local(q, np.asarray(k), np.asarray(v), np.asarray(w), window, causal)
    np.testing.assert_allclose(fn(k, v, w), expected, rtol=1e-10, atol=1e-12)
    check_grads(fn, (k, v, w), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_precision_policy():
  w = jnp.zeros((64, 64))
  check_precision(lambda q, k, v: ops.aft_local(q, k, v, w, window=8, causal=True, impl="xla"))


# --------------------------------------------------------------------------- the Triton kernel


def _local_dense(q, k, v, w, window):
  """Causal AFT-local written out (one softmax over every key per query row), for float64."""
  t_len = q.shape[-2]
  tp = jnp.arange(t_len)

  def row(t):
    bias = jnp.where(t - tp < window, w[t], 0.0)
    logits = jnp.where((tp <= t)[:, None], k + bias[:, None], -jnp.inf)  # [B, T, D]
    return jnp.sum(jax.nn.softmax(logits, axis=-2) * v, axis=-2)

  return jax.nn.sigmoid(q) * jnp.moveaxis(jax.lax.map(row, tp), 0, -2)


@functools.partial(jax.jit, static_argnames="window")
def _local_out_and_grads(q, k, v, w, ct, window):
  fn = functools.partial(_local_dense, window=window)
  return fn(q, k, v, w), jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2, 3))(q, k, v, w)


def _local_reference(q, k, v, w, ct, window, grads=True):
  """Output [and gradients (q, k, v, w) of sum(out * ct)], in float64 (one program per shape
  and window)."""
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(x, jnp.float64) for x in (q, k, v, w))
    if not grads:
      return np.asarray(jax.jit(_local_dense, static_argnames="window")(*args, window=window))
    out, g = _local_out_and_grads(*args, jnp.asarray(ct, jnp.float64), window=window)
    return np.asarray(out), jax.tree.map(np.asarray, g)


def _local_inputs(t_len, d, std, seed):
  """q, k, v, cotangent [2, T, d] and w [T, T] float32; k and w of std ``std``."""
  q, k, v, ct = kernel_inputs(t_len, d, seed)
  k = k / np.array([1.0, 40.0], np.float32)[:, None, None] * std
  w = np.random.default_rng(seed + 1).normal(scale=std, size=(t_len, t_len)).astype(np.float32)
  return q, k, v, w, ct


def test_dense_reference_is_the_loop_reference():
  q, k, v, w, _ = _local_inputs(9, 3, 3.0, 0)
  want = ref.aft_local(q, k, v, w, 4, causal=True)
  np.testing.assert_allclose(_local_reference(q, k, v, w, None, 4, False), want, rtol=1e-12)


@pytest.mark.parametrize("t_len, window", [(1, 3), (7, 20), (100, 5), (128, 32)])
def test_triton_kernel(t_len, window):
  """Values and gradients (q, k, v, w), logits of std 1 and 40 (one compiled program for
  both), T ragged (7, 100), a window wider than T (20 > 7: every key in the band), of one key
  block (5) and of three (32)."""
  fn = functools.partial(ops.aft_local, window=window, causal=True, impl="pallas_interpret")
  grads = jax.grad(lambda *a: jnp.sum(fn(*a[:4]) * a[4]), argnums=(0, 1, 2, 3))
  run = jax.jit(lambda *a: (fn(*a[:4]), grads(*a)))
  for std in (1.0, 40.0):
    q, k, v, w, ct = _local_inputs(t_len, 16, std, seed=t_len)
    out, got = run(q, k, v, w, ct)
    want_out, want = _local_reference(q, k, v, w, ct, window)
    chex.assert_trees_all_close(out, want_out, rtol=RTOL, atol=ATOL, custom_message=f"std {std}")
    for g, x in zip(got, want):  # (T = 1: dw is 0, up to float32 rounding)
      np.testing.assert_allclose(
        g, x, rtol=1e-4, atol=1e-4 * np.abs(x).max() + 1e-6, err_msg=f"std {std}"
      )


@pytest.mark.parametrize(
  "t_len, window, seg, std", [(200, 20, 32, 40.0), (100, 5, 16, 1.0)], ids=["std40", "std1"]
)
def test_triton_kernel_chunk_parallel(t_len, window, seg, std):
  """The chunk-parallel form: values and gradients (q, k, v, w), T ragged, segments of 7 and 2
  chunks whose first chunk reads the window's earlier keys from the segment before (32 and 16
  of them: ``seg`` is the least allowed), dk and dv overlap-added across segments; a segment
  shorter than that is refused."""
  q, k, v, w, ct = _local_inputs(t_len, 16, std, seed=t_len)
  cfg = triton.CONFIGS[-1]
  mean = lambda k, v, w, seg: triton_local.local_mean(k, v, w, window, cfg, True, seg)
  fn = lambda q, k, v, w: jax.nn.sigmoid(q) * mean(k, v, w, seg)
  assert_close(kernel_grads(fn, (q, k, v, w), ct), _local_reference(q, k, v, w, ct, window), 1e-4)
  with pytest.raises(ValueError, match="earlier keys"):
    mean(k, v, w, seg // 2)


def test_triton_kernel_ragged_long_sequence_forward():
  """T = 1000 (not a multiple of the chunk), window 48 (three key blocks), std 1 and 40."""
  q, k, v, w, _ = _local_inputs(1000, 16, 1.0, seed=5)
  k = k * np.array([1.0, 40.0], np.float32)[:, None, None]
  fn = functools.partial(ops.aft_local, window=48, causal=True, impl="pallas_interpret")
  want = _local_reference(q, k, v, w, None, 48, grads=False)
  chex.assert_trees_all_close(jax.jit(fn)(q, k, v, w), want, rtol=RTOL, atol=ATOL)


def test_triton_kernel_at_t4096_forward_matches_the_xla_path():
  """T = 4096 (256 chunks), logits of std 40: the kernel agrees with the XLA path, which the
  tests above check against the float64 reference (a dense float64 reference at this T would
  need gigabytes)."""
  q, k, v, w, _ = _local_inputs(4096, 16, 40.0, seed=7)
  q, k, v = (x[:1] for x in (q, k, v))
  kernel = functools.partial(ops.aft_local, window=32, causal=True, impl="pallas_interpret")
  xla = functools.partial(ops.aft_local, window=32, causal=True, impl="xla")
  chex.assert_trees_all_close(jax.jit(kernel)(q, k, v, w), xla(q, k, v, w), rtol=RTOL, atol=ATOL)


def test_triton_kernel_bfloat16_inputs():
  """bf16 in, bf16 out (and bf16 gradients of q, k, v), float32 inside: as close to the XLA
  path's bf16 results as bf16 rounding."""
  q, k, v, w, ct = _local_inputs(37, 32, 1.0, seed=1)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  args = (bf(q), bf(k), bf(v), w)

  def run(impl):
    fn = functools.partial(ops.aft_local, window=8, causal=True, impl=impl)
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct)
    return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(*args)

  (out16, grads16), (xla16, xla_grads) = run("pallas_interpret"), run("xla")
  assert out16.dtype == jnp.bfloat16 and [g.dtype for g in grads16[:3]] == [jnp.bfloat16] * 3
  chex.assert_trees_all_close(out16.astype(jnp.float32), xla16.astype(jnp.float32), atol=2e-2)
  for got, want in zip(grads16, xla_grads):
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2 * np.abs(want).max())


def test_triton_kernel_dw_partials_do_not_grow_with_the_batch():
  """The backward's partial sums of dw are one [t_pad, W] per channel block of the widest tile
  (summed over the batch rows inside the dw kernel), not one per (batch row, channel block):
  at batch 8 and D = 128 the kernels' outputs of that shape are 2 x 112 x 64 floats, while dk
  and dv grow with the batch."""
  t_len, d, window = 100, 128, 40  # t_pad 112, W = 16 (ceil(39 / 16) + 1) = 64
  w = jnp.zeros((t_len, t_len))
  for batch in (1, 8):
    k = jnp.zeros((batch, t_len, d))
    cfg = triton.config_for(d, batch)
    loss = lambda k, w: jnp.sum(triton_local.local_mean(k, k, w, window, cfg, True))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(k, w).jaxpr
    shapes = [v.aval.shape for e in equations(jaxpr, "pallas_call") for v in e.outvars]
    assert cfg.block_d == 16  # dk, dv: one program per (batch row, 16 channels)
    assert sorted(s for s in shapes if s[-1] == 64) == [(2, 112, 64)]
    assert shapes.count((batch, 64 - 16 + 112, d)) == 2  # dk, dv (keys' padded layout)


def test_a_symbolic_batch_exports():
  """jax.export with an unconstrained symbolic batch: the banded sums' row groups take one row
  where the channel count is symbolic; the exported program gives the float64 reference's
  values at batch 3."""
  (b,) = jax.export.symbolic_shape("b")
  x, w = jax.ShapeDtypeStruct((b, 12, 3), jnp.float32), jax.ShapeDtypeStruct((12, 12), jnp.float32)
  q, k, v, bias = qkvw(30, (3,), 12, 3, 1.0)
  fn = lambda q, k, v, w: ops.aft_local(q, k, v, w, window=4, causal=True)
  exported = jax.export.export(jax.jit(fn))(x, x, x, w)
  want = ref.aft_local(q, k, v, bias, 4, causal=True)
  np.testing.assert_allclose(exported.call(q, k, v, bias), want, rtol=RTOL, atol=ATOL)
