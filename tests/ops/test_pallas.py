"""The Pallas kernels (aft_jax.ops.pallas_simple, pallas_local) and the ``impl`` choice of the
ops.

The kernels run in Pallas interpret mode on CPU against a float64 reference, and are lowered
(not run) for GPUs with ``jax.export``, so a kernel that would fail to compile there fails here.
"""

import dataclasses
import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from aft_jax import ops
from aft_jax.model import ModelConfig, TransformerLM
from aft_jax.ops import pallas_local, pallas_simple, pallas_split
from benchmarks import kernel_form
from benchmarks.bench_ops import scan_simple
from tests.support import numpy_reference as ref
from tests.support.helpers import TRITON, equations, export_for

RTOL, ATOL = 2e-4, 2e-5  # as the op tests (tests/ops/test_reference.py)


def _inputs(t_len, d, seed=0):
  """q, k, v, cotangent [2, T, d] float32; batch row 0 has logits of std 1, row 1 std 40."""
  rng = np.random.default_rng(seed)
  q, k, v, ct = (rng.normal(size=(2, t_len, d)) for _ in range(4))
  k = k * np.array([1.0, 40.0])[:, None, None]
  return tuple(np.asarray(x, np.float32) for x in (q, k, v, ct))


def _reference(q, k, v, ct):
  """Output and gradients (q, k, v) of sum(out * ct), in float64."""
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(x, jnp.float64) for x in (q, k, v))
    out = scan_simple(*args)
    grads = jax.grad(lambda *a: jnp.sum(scan_simple(*a) * ct), argnums=(0, 1, 2))(*args)
    return jax.tree.map(np.asarray, (out, grads))


def _pallas(q, k, v, ct):
  fn = functools.partial(ops.aft_simple, causal=True, impl="pallas_interpret")
  grads = jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2))
  # The sequential form (auto would split T = 1000 into segments: tested below).
  with kernel_form.forced("sequential"):
    return jax.jit(lambda *a: (fn(*a), grads(*a)))(q, k, v)


def test_scan_reference_is_the_loop_reference():
  q, k, v, _ = _inputs(7, 3)
  out, _ = _reference(q, k, v, np.zeros_like(q))
  np.testing.assert_allclose(out, ref.aft_simple(q, k, v, causal=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t_len", [1, 7, 128, 1000])
def test_simple_kernel_matches_reference(t_len):
  """The sequential form: values and gradients, std 1 and 40, T not a multiple of the chunk
  (7, 1000)."""
  q, k, v, ct = _inputs(t_len, 16, seed=t_len)
  out, grads = _pallas(q, k, v, ct)
  want_out, want_grads = _reference(q, k, v, ct)
  chex.assert_trees_all_close(out, want_out, rtol=RTOL, atol=ATOL)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_simple_kernel_long_sequence_forward():
  """T = 4096: ``auto`` takes the chunk-parallel form (32 segments of 128: two fold blocks)."""
  assert pallas_split.plan_for(2, 4096, 16).seg == 128
  q, k, v, _ = _inputs(4096, 16, seed=3)
  out = jax.jit(functools.partial(ops.aft_simple, causal=True, impl="pallas_interpret"))(q, k, v)
  chex.assert_trees_all_close(out, _reference(q, k, v, np.zeros_like(q))[0], rtol=RTOL, atol=ATOL)


def test_simple_kernel_bfloat16_inputs():
  """bf16 in, bf16 out, float32 inside: as close to the float32 result as the XLA path's."""
  q, k, v, _ = _inputs(37, 32)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  out16 = ops.aft_simple(bf(q), bf(k), bf(v), causal=True, impl="pallas_interpret")
  assert out16.dtype == jnp.bfloat16
  xla16 = ops.aft_simple(bf(q), bf(k), bf(v), causal=True, impl="xla")
  chex.assert_trees_all_close(out16.astype(jnp.float32), xla16.astype(jnp.float32), atol=2e-2)


@pytest.mark.parametrize("cfg", pallas_simple.CONFIGS, ids=lambda c: f"block_d{c.block_d}")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_simple_kernel_lowers_for_cuda(cfg, dtype):
  """Every configuration ``auto`` can choose lowers to Triton (forward and backward), T
  ragged."""
  x = jax.ShapeDtypeStruct((2, 100, 3 * cfg.block_d), dtype)  # 3 * block_d picks cfg
  loss = lambda k, v: jnp.sum(pallas_simple.causal_mean(k, v, cfg, False))
  exported = export_for(jax.grad(loss, argnums=(0, 1)), x, x)
  assert "__gpu$xla.gpu.triton" in exported.mlir_module()
  assert pallas_simple.config_for(3 * cfg.block_d, batch=1 << 20) == cfg  # auto can pick it
  assert pallas_simple.config_for(512, batch=1).block_d == 16  # few rows: more programs


# Every chunk-parallel configuration, in bf16 and float32 (both at the widest block, which
# plan_for takes wherever D is a multiple of 64; the loads are what the dtype changes).
_CHUNKED_CASES = [(0, jnp.bfloat16), (0, jnp.float32), (1, jnp.bfloat16), (2, jnp.float32)]


@pytest.mark.parametrize("i, dtype", _CHUNKED_CASES, ids=["64-bf16", "64-f32", "32-bf16", "16-f32"])
def test_chunk_parallel_kernels_lower_for_cuda(i, dtype):
  """Every configuration of the chunk-parallel form lowers to Triton, AFT-simple and AFT-local
  (windows of one and three key blocks), forward and forward+backward, T ragged; the segment
  kernels' grid has the segments as its third axis."""
  cfg = pallas_split.CHUNKED_CONFIGS[i]
  assert pallas_split.plan_for(1, 4096, 3 * cfg.block_d).cfg == cfg  # auto can pick it
  x = jax.ShapeDtypeStruct((2, 100, 3 * cfg.block_d), dtype)  # 2 segments of 64
  w = jax.ShapeDtypeStruct((100, 100), jnp.float32)
  simple = lambda k, v, w: jnp.sum(pallas_simple.causal_mean(k, v, cfg, False, 64))
  local = lambda window: (
    lambda k, v, w: jnp.sum(pallas_local.local_mean(k, v, w, window, cfg, False, 64))
  )
  # Kernels: simple 2 (totals, forward) + 4 (totals, forward with L, totals, backward);
  # local the same + dw.
  for loss, n_fwd, n_grad in ((simple, 2, 4), (local(1), 2, 5), (local(40), 2, 5)):
    for n, fn in ((n_fwd, loss), (n_grad, jax.value_and_grad(loss, argnums=(0, 1, 2)))):
      module = export_for(fn, x, x, w).mlir_module()
      assert module.count(f"custom_call @{TRITON}(") == n
      # [B, D / block_d, 2 segments]; dw: [query chunks (T padded to 128), D / block_d, 1].
      grids = {tuple(map(int, g)) for g in _GRID.findall(module)}
      assert grids <= {(2, 3, 2), (8, 3, 1)}, grids


def _kernel_grads(fn, args, ct):
  """fn(*args) and the gradients of sum(fn * ct) in every argument, jitted once."""
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct)
  grads = jax.grad(loss, argnums=tuple(range(len(args))))
  return jax.jit(lambda *a: (fn(*a), grads(*a)))(*args)


def _assert_close(got, want, rtol):
  """Outputs and gradients within ``rtol`` of the largest magnitude of each."""
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g = np.asarray(g, np.float32)
    np.testing.assert_allclose(g, x, rtol=rtol, atol=rtol * np.abs(x).max() + 1e-6)


@pytest.mark.parametrize(
  "t_len, seg, dtype",
  [(600, 32, jnp.float32), (100, 16, jnp.bfloat16)],
  ids=["T600-seg32-f32", "T100-seg16-bf16"],
)
def test_simple_chunk_parallel_matches_reference(t_len, seg, dtype):
  """The chunk-parallel form (``seg`` positions per program): values and gradients, std 1 and
  40 (the two batch rows: segment totals whose maxima differ by far more than float32's
  range), T ragged, 19 segments (two fold blocks) or 7, bf16 inputs with float32 sums."""
  q, k, v, ct = _inputs(t_len, 16, seed=t_len)
  cfg = pallas_simple.CONFIGS[-1]
  fn = lambda q, k, v: jax.nn.sigmoid(q) * pallas_simple.causal_mean(k, v, cfg, True, seg)
  args = tuple(jnp.asarray(x, dtype) for x in (q, k, v))
  # The reference from the rounded inputs: bf16 then only rounds the outputs (8 bits).
  want = _reference(*(np.asarray(x, np.float32) for x in args), ct)
  _assert_close(_kernel_grads(fn, args, ct), want, 1e-4 if dtype == jnp.float32 else 2e-2)
  with pytest.raises(ValueError, match="whole chunks of 16"):
    pallas_simple.causal_mean(k, v, cfg, True, seg + 8)


def test_chunk_parallel_later_segments_never_reach_earlier_ones():
  """A NaN and an infinity in a later segment's keys and values: every earlier output of the
  chunk-parallel form is bit-identical (the fold takes only earlier segments' totals)."""
  q, k, v, _ = _inputs(100, 16, seed=2)
  w = np.zeros((100, 100), np.float32)
  cfg = pallas_simple.CONFIGS[-1]
  bad_k, bad_v = k.copy(), v.copy()
  bad_k[:, 70, :4], bad_v[:, 75, 4:8], bad_k[:, 80, 8:] = np.inf, np.nan, np.nan
  fns = (
    lambda k, v: pallas_simple.causal_mean(k, v, cfg, True, 16),
    lambda k, v: pallas_local.local_mean(k, v, w, 16, cfg, True, 16),
  )
  for fn in fns:
    fn = jax.jit(fn)
    good, bad = np.asarray(fn(k, v)), np.asarray(fn(bad_k, bad_v))
    np.testing.assert_array_equal(bad[:, :64], good[:, :64])  # the segments before row 70
    np.testing.assert_array_equal(bad[:, :70], good[:, :70])


def test_plan_splits_t_where_the_sequential_grid_is_small():
  """The one choice: at B 1, T 16384 and B 8, T 2048 (D 512) the chunk-parallel form with at
  least ``MIN_PROGRAMS`` programs; at B 256 the sequential one; T too short for two segments:
  sequential; ``kernel_form.forced`` selects either form where it can run; AFT-local's
  segments hold the window's earlier keys."""
  for b, t_len in ((1, 16384), (8, 2048)):
    plan = pallas_split.plan_for(b, t_len, 512)
    assert plan.seg is not None and plan.seg % plan.cfg.block_t == 0
    assert b * (512 // plan.cfg.block_d) * -(-t_len // plan.seg) >= pallas_split.MIN_PROGRAMS
    with kernel_form.forced("sequential"):
      assert pallas_split.plan_for(b, t_len, 512).seg is None
  assert pallas_split.plan_for(256, 2048, 512).seg is None
  with kernel_form.forced("chunked"):
    assert pallas_split.plan_for(256, 2048, 512).seg is not None
    assert pallas_split.plan_for(1, 128, 512).seg is None  # one segment: nothing to split
  assert pallas_local.plan_for(1, 16384, 512, window=1024).seg >= 1024
  with pytest.raises(ValueError, match="form must be one of"):
    kernel_form.forced("parallel").__enter__()


# --------------------------------------------------------------------------- AFT-local


def _local_dense(q, k, v, w, window):
  """Causal AFT-local written out (one softmax over every key per query row), for float64."""
  t_len = q.shape[-2]
  tp = jnp.arange(t_len)

  def row(t):
    bias = jnp.where(t - tp < window, w[t], 0.0)
    logits = jnp.where((tp <= t)[:, None], k + bias[:, None], -jnp.inf)  # [B, T, D]
    return jnp.sum(jax.nn.softmax(logits, axis=-2) * v, axis=-2)

  a = jnp.moveaxis(jax.lax.map(row, tp), 0, -2)
  return jax.nn.sigmoid(q) * a


def _local_reference(q, k, v, w, ct, window, grads=True):
  """Output [and gradients (q, k, v, w) of sum(out * ct)], in float64."""
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(x, jnp.float64) for x in (q, k, v, w))
    fn = functools.partial(_local_dense, window=window)
    out = np.asarray(fn(*args))
    if not grads:
      return out
    g = jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2, 3))(*args)
    return out, jax.tree.map(np.asarray, g)


def _local_inputs(t_len, d, std, seed):
  """q, k, v, cotangent [2, T, d] and w [T, T] float32; k and w of std ``std``."""
  q, k, v, ct = _inputs(t_len, d, seed)
  k = k / np.array([1.0, 40.0], np.float32)[:, None, None] * std
  w = np.random.default_rng(seed + 1).normal(scale=std, size=(t_len, t_len)).astype(np.float32)
  return q, k, v, w, ct


def test_local_reference_is_the_loop_reference():
  q, k, v, w, _ = _local_inputs(9, 3, 3.0, 0)
  want = ref.aft_local(q, k, v, w, 4, causal=True)
  np.testing.assert_allclose(_local_reference(q, k, v, w, None, 4, False), want, rtol=1e-12)


@pytest.mark.parametrize("std", [1.0, 40.0])
@pytest.mark.parametrize("t_len, window", [(1, 3), (7, 20), (100, 5), (128, 32)])
def test_local_kernel_matches_reference(t_len, window, std):
  """Values and gradients (q, k, v, w), logits of std 1 and 40, T ragged (7, 100), a window
  wider than T (20 > 7: every key in the band), of one key block (5) and of three (32)."""
  q, k, v, w, ct = _local_inputs(t_len, 16, std, seed=t_len)
  fn = functools.partial(ops.aft_local, window=window, causal=True, impl="pallas_interpret")
  grads = jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2, 3))
  out, got = jax.jit(lambda *a: (fn(*a), grads(*a)))(q, k, v, w)
  want_out, want = _local_reference(q, k, v, w, ct, window)
  chex.assert_trees_all_close(out, want_out, rtol=RTOL, atol=ATOL)
  for g, x in zip(got, want):  # (T = 1: dw is 0, up to float32 rounding)
    np.testing.assert_allclose(g, x, rtol=1e-4, atol=1e-4 * np.abs(x).max() + 1e-6)


@pytest.mark.parametrize(
  "t_len, window, seg, std", [(200, 20, 32, 40.0), (100, 5, 16, 1.0)], ids=["std40", "std1"]
)
def test_local_chunk_parallel_matches_reference(t_len, window, seg, std):
  """The chunk-parallel form: values and gradients (q, k, v, w), T ragged, segments of 7 and 2
  chunks whose first chunk reads the window's earlier keys from the segment before (32 and 16
  of them: ``seg`` is the least allowed), dk and dv overlap-added across segments; a segment
  shorter than that is refused."""
  q, k, v, w, ct = _local_inputs(t_len, 16, std, seed=t_len)
  cfg = pallas_local.CONFIGS[-1]
  local = lambda k, v, w, seg: pallas_local.local_mean(k, v, w, window, cfg, True, seg)
  fn = lambda q, k, v, w: jax.nn.sigmoid(q) * local(k, v, w, seg)
  got = _kernel_grads(fn, (q, k, v, w), ct)
  _assert_close(got, _local_reference(q, k, v, w, ct, window), 1e-4)
  with pytest.raises(ValueError, match="earlier keys"):
    local(k, v, w, seg // 2)


def test_local_kernel_ragged_long_sequence_forward():
  """T = 1000 (not a multiple of the chunk), window 48 (three key blocks), std 1 and 40."""
  q, k, v, w, _ = _local_inputs(1000, 16, 1.0, seed=5)
  k = k * np.array([1.0, 40.0], np.float32)[:, None, None]
  fn = functools.partial(ops.aft_local, window=48, causal=True, impl="pallas_interpret")
  out = jax.jit(fn)(q, k, v, w)
  want = _local_reference(q, k, v, w, None, 48, grads=False)
  chex.assert_trees_all_close(out, want, rtol=RTOL, atol=ATOL)


def test_local_kernel_at_t4096_forward_matches_the_xla_path():
  """T = 4096 (256 chunks), logits of std 40: the kernel agrees with the XLA path, which the op
  tests check against the float64 reference (a dense float64 reference at this T would need
  gigabytes)."""
  q, k, v, w, _ = _local_inputs(4096, 16, 40.0, seed=7)
  q, k, v = (x[:1] for x in (q, k, v))
  kernel = functools.partial(ops.aft_local, window=32, causal=True, impl="pallas_interpret")
  xla = functools.partial(ops.aft_local, window=32, causal=True, impl="xla")
  chex.assert_trees_all_close(jax.jit(kernel)(q, k, v, w), xla(q, k, v, w), rtol=RTOL, atol=ATOL)


def test_local_kernel_bfloat16_inputs():
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


@pytest.mark.parametrize("cfg", pallas_local.CONFIGS, ids=lambda c: f"block_d{c.block_d}")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_local_kernel_lowers_for_cuda(cfg, dtype):
  """Every configuration ``auto`` can choose lowers to Triton, forward and forward+backward
  (the dk, dv kernel and the dw kernel, whose channel block is block_d here), T ragged, windows
  of one and several key blocks."""
  x = jax.ShapeDtypeStruct((2, 100, 3 * cfg.block_d), dtype)  # 3 * block_d picks cfg
  w = jax.ShapeDtypeStruct((100, 100), jnp.float32)
  assert pallas_local.dw_config(3 * cfg.block_d) == cfg
  for window in (1, 40):
    loss = lambda k, v, w: jnp.sum(pallas_local.local_mean(k, v, w, window, cfg, False))
    for kernels, fn in ((1, loss), (3, jax.value_and_grad(loss, argnums=(0, 1, 2)))):
      exported = export_for(fn, x, x, w)
      assert exported.mlir_module().count("custom_call @__gpu$xla.gpu.triton(") == kernels
  assert pallas_local.config_for(3 * cfg.block_d, batch=1 << 20) == cfg  # auto can pick it


def test_local_kernel_dw_partials_do_not_grow_with_the_batch():
  """The backward's partial sums of dw are one [t_pad, W] per channel block of the widest tile
  (summed over the batch rows inside the dw kernel), not one per (batch row, channel block):
  at batch 8 and D = 128 the kernels' outputs of that shape are 2 x 112 x 64 floats, while
  dk and dv grow with the batch."""
  t_len, d, window = 100, 128, 40  # t_pad 112, W = 16 (ceil(39 / 16) + 1) = 64
  w = jnp.zeros((t_len, t_len))
  for batch in (1, 8):
    k = jnp.zeros((batch, t_len, d))
    cfg = pallas_local.config_for(d, batch)
    loss = lambda k, w: jnp.sum(pallas_local.local_mean(k, k, w, window, cfg, True))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(k, w).jaxpr
    shapes = [v.aval.shape for e in equations(jaxpr, "pallas_call") for v in e.outvars]
    assert cfg.block_d == 16  # dk, dv: one program per (batch row, 16 channels)
    assert sorted(s for s in shapes if s[-1] == 64) == [(2, 112, 64)]
    assert shapes.count((batch, 64 - 16 + 112, d)) == 2  # dk, dv (keys' padded layout)


_GRID = re.compile(r"grid_x = (\d+) : i\d+, grid_y = (\d+) : i\d+, grid_z = (\d+) : i\d+")


@pytest.mark.parametrize("batch, t_len", [(1, 16384), (8, 2048)])
def test_every_kernel_fills_an_h200_at_long_t_and_small_batch(batch, t_len):
  """Lowered for cuda under an abstract H200 (``impl="auto"`` takes the kernels there): every
  Triton call of causal AFT-simple and AFT-local-128 at D 512, forward and forward+backward,
  launches at least 528 programs (4 per SM of a 132-SM GPU), read from the calls' grid_x/y/z."""
  x = jax.ShapeDtypeStruct((batch, t_len, 512), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((t_len, t_len), jnp.float32)
  cases = {
    "aft_simple": (lambda q, k, v: ops.aft_simple(q, k, v, causal=True), (x, x, x)),
    "aft_local_128": (
      lambda q, k, v, w: ops.aft_local(q, k, v, w, window=128, causal=True),
      (x, x, x, w),
    ),
  }
  for name, (op, args) in cases.items():
    grad = jax.grad(lambda *a: jnp.sum(op(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    for mode, fn in (("fwd", op), ("fwd+bwd", grad)):
      module = export_for(fn, *args).mlir_module()
      grids = [math.prod(map(int, g)) for g in _GRID.findall(module)]
      assert len(grids) == module.count(f"custom_call @{TRITON}(") >= 1 + (mode != "fwd")
      assert min(grids) >= 528, (name, mode, grids)


def test_auto_is_xla_on_cpu_and_pallas_needs_a_kernel():
  q, k, v, _ = _inputs(8, 16)
  jaxpr = str(jax.make_jaxpr(functools.partial(ops.aft_simple, causal=True))(q, k, v))
  assert "pallas_call" not in jaxpr
  jaxpr = str(
    jax.make_jaxpr(functools.partial(ops.aft_simple, causal=True, impl="pallas_interpret"))(q, k, v)
  )
  assert "pallas_call" in jaxpr
  w = np.zeros((8, 8), np.float32)
  local = functools.partial(ops.aft_local, window=2, causal=True)
  assert "pallas_call" not in str(jax.make_jaxpr(local)(q, k, v, w))
  assert "pallas_call" in str(
    jax.make_jaxpr(functools.partial(local, impl="pallas_interpret"))(q, k, v, w)
  )
  cases = [
    (lambda: ops.aft_simple(q, k, v, causal=True, impl="pallas"), "not for the 'cpu' platform"),
    (lambda: ops.aft_simple(q, k, v, impl="pallas_interpret"), "the kernel is for causal=True"),
    (
      lambda: ops.aft_simple(q[..., :12], k[..., :12], v[..., :12], causal=True, impl="pallas"),
      "D = 12 is not a multiple of 16",
    ),
    (lambda: ops.aft_full(q, k, v, w, causal=True, impl="pallas"), "no Pallas kernel for this op"),
    (lambda: ops.aft_local(q, k, v, w, window=2, impl="pallas"), "the kernel is for causal=True"),
    (
      lambda: ops.aft_local(q, k, v, w, window=2000, causal=True, impl="pallas_interpret"),
      "the window 2000 is larger than the kernel's 1024",
    ),
    (lambda: ops.aft_full(q, k, v, w, impl="triton"), "impl must be one of"),
  ]
  for fn, msg in cases:
    with pytest.raises(ValueError, match=msg):
      fn()


@pytest.mark.parametrize("mixing, t_len", [("aft_simple", 8), ("aft_local", 40)])
def test_model_trains_the_same_with_the_kernel(mixing, t_len):
  """A tiny causal LM (AFT-simple, or AFT-local as in the quickstart: here 3 chunks of 16 and
  keys older than the window), 20 Adam steps: impl=pallas_interpret gives the losses of
  impl=xla within 1e-4."""
  cfg = ModelConfig(vocab_size=32, max_len=t_len, num_layers=1, d_model=16, mlp_dim=32, window=4)
  cfg = dataclasses.replace(cfg, mixing=mixing, dropout_rate=0.0)
  # Rows that count up from a random start (mod 32): each next token is learnable from the
  # last, so a few steps lower the loss from the near-uniform start of GPT-2's initialisation.
  start = np.random.default_rng(0).integers(0, 32, size=(20, 4, 1))
  tokens = (start + np.arange(t_len + 1)) % 32
  tx = optax.adam(3e-3)

  def losses(impl):
    model = TransformerLM(dataclasses.replace(cfg, impl=impl).validate())
    params = model.init(jax.random.key(0), tokens[0, :, :-1])["params"]

    def step(carry, batch):
      params, opt = carry
      loss_fn = lambda p: jnp.mean(model.apply({"params": p}, batch[:, :-1], batch[:, 1:]))
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt = tx.update(grads, opt, params)
      return (optax.apply_updates(params, updates), opt), loss

    return jax.jit(lambda p: jax.lax.scan(step, (p, tx.init(p)), tokens)[1])(params)

  xla, kernel = losses("xla"), losses("pallas_interpret")
  assert float(xla[-1]) < float(xla[0]) - 0.1  # it trains
  np.testing.assert_allclose(kernel, xla, atol=1e-4, rtol=0)
