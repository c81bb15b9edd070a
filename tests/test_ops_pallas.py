"""The Pallas kernels (aft_jax.ops.pallas_simple, pallas_local) and the ``impl`` choice of the
ops.

The kernels run in Pallas interpret mode on CPU against a float64 reference, and are lowered
(not run) for GPUs with ``jax.export``, so a kernel that would fail to compile there fails here.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from aft_jax import ops
from aft_jax.model import ModelConfig, TransformerLM
from aft_jax.ops import pallas_local, pallas_simple
from benchmarks.bench_ops import scan_simple
from tests import numpy_reference as ref
from tests.helpers import equations, export_for

RTOL, ATOL = 2e-4, 2e-5  # as the op tests (tests/test_ops.py)


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
  return jax.jit(lambda *a: (fn(*a), grads(*a)))(q, k, v)


def test_scan_reference_is_the_loop_reference():
  q, k, v, _ = _inputs(7, 3)
  out, _ = _reference(q, k, v, np.zeros_like(q))
  np.testing.assert_allclose(out, ref.aft_simple(q, k, v, causal=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t_len", [1, 7, 128, 1000])
def test_simple_kernel_matches_reference(t_len):
  """Values and gradients, std 1 and 40, T not a multiple of the chunk (7, 1000)."""
  q, k, v, ct = _inputs(t_len, 16, seed=t_len)
  out, grads = _pallas(q, k, v, ct)
  want_out, want_grads = _reference(q, k, v, ct)
  chex.assert_trees_all_close(out, want_out, rtol=RTOL, atol=ATOL)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_simple_kernel_long_sequence_forward():
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
  tokens = np.random.default_rng(0).integers(0, 32, size=(20, 4, t_len + 1))
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
