"""The Pallas kernels: lowering for GPUs and TPUs, launch plans, impl, values (interpreted)."""

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
from aft_jax.ops import simple
from aft_jax.ops.pallas import mosaic_simple, triton, triton_decay, triton_local, triton_simple
from benchmarks import accelerator_check, kernel_form
from tests.support.helpers import TRITON, export_for, on_target
from aft_jax.ops import logsumexp as lse
from tests.support import numpy_reference
from tests.support.op_cases import ATOL, RTOL, kernel_inputs, simple_reference

_GRID = re.compile(r"grid_x = (\d+) : i\d+, grid_y = (\d+) : i\d+, grid_z = (\d+) : i\d+")
# The configurations lowered chunk-parallel too (plan_for's widest block in both dtypes).
_CHUNKED = {(0, jnp.bfloat16), (0, jnp.float32), (1, jnp.bfloat16), (2, jnp.float32)}
D = 128  # one lane tile: the smallest channel count the TPU kernel takes


@pytest.mark.parametrize("i", range(3), ids=lambda i: f"block_d{triton.CONFIGS[i].block_d}")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_kernels_lower_for_cuda(i, dtype):
  """Every configuration, sequential and in segments, forward and backward, T ragged."""
  cfg = triton.CONFIGS[i]
  assert triton.plan_for(1, 4096, 3 * cfg.block_d).cfg == cfg  # auto can pick it, chunked
  assert triton.config_for(3 * cfg.block_d, batch=1 << 20) == cfg  # and sequential
  assert triton_local.dw_config(3 * cfg.block_d) == cfg
  x = jax.ShapeDtypeStruct((2, 100, 3 * cfg.block_d), dtype)  # 2 segments of 64
  w = jax.ShapeDtypeStruct((100, 100), jnp.float32)
  for seg in (None, 64) if (i, dtype) in _CHUNKED else (None,):
    simple = lambda k, v, w: jnp.sum(triton_simple.causal_mean(k, v, cfg, False, seg))
    local = lambda s: lambda k, v, w: jnp.sum(triton_local.local_mean(k, v, w, s, cfg, False, seg))
    # Kernels (forward, forward+backward): simple 1, 2; local 1, 3 (dw); segments add totals.
    for loss, n_grad in ((simple, 2), (local(1), 3), (local(40), 3)):
      counts = (2, n_grad + 2) if seg else (1, n_grad)
      for n, fn in zip(counts, (loss, jax.value_and_grad(loss, argnums=(0, 1, 2)))):
        module = export_for(fn, x, x, w).mlir_module()
        assert module.count(f"custom_call @{TRITON}(") == n
        # [B, D / block_d, 2 segments]; dw: [query chunks (T padded to 128), D / block_d, 1].
        grids = {tuple(map(int, g)) for g in _GRID.findall(module)}
        assert not seg or grids <= {(2, 3, 2), (8, 3, 1)}, grids
  decay = lambda k, v, w: jnp.sum(triton_decay.decay_mean(k, v, w, None, cfg))
  w = jax.ShapeDtypeStruct((2, 3 * cfg.block_d), jnp.float32)  # (decay, bonus)
  for n, fn in ((1, decay), (2, jax.value_and_grad(decay, argnums=(0, 1, 2)))):
    assert export_for(fn, x, x, w).mlir_module().count(f"custom_call @{TRITON}(") == n


def test_chunk_parallel_later_segments_never_reach_earlier_ones():
  """A later NaN or infinity: every earlier output of the chunk-parallel form bit-identical."""
  q, k, v, _ = kernel_inputs(100, 16, seed=2)
  w = np.zeros((100, 100), np.float32)
  cfg = triton.CONFIGS[-1]
  bad_k, bad_v = k.copy(), v.copy()
  bad_k[:, 70, :4], bad_v[:, 75, 4:8], bad_k[:, 80, 8:] = np.inf, np.nan, np.nan
  fns = (
    lambda k, v: triton_simple.causal_mean(k, v, cfg, True, 16),
    lambda k, v: triton_local.local_mean(k, v, w, 16, cfg, True, 16),
  )
  for fn in fns:
    fn = jax.jit(fn)
    good, bad = np.asarray(fn(k, v)), np.asarray(fn(bad_k, bad_v))
    np.testing.assert_array_equal(bad[:, :70], good[:, :70])


def test_plan_splits_t_where_the_sequential_grid_is_small():
  for b, t_len in ((1, 16384), (8, 2048)):
    plan = triton.plan_for(b, t_len, 512)
    assert plan.seg is not None and plan.seg % plan.cfg.block_t == 0
    assert b * (512 // plan.cfg.block_d) * -(-t_len // plan.seg) >= triton.MIN_PROGRAMS
    with kernel_form.forced("sequential"):
      assert triton.plan_for(b, t_len, 512).seg is None
  assert triton.plan_for(256, 2048, 512).seg is None
  with kernel_form.forced("chunked"):
    assert triton.plan_for(256, 2048, 512).seg is not None
    assert triton.plan_for(1, 128, 512).seg is None  # one segment: nothing to split
  assert triton_local.plan_for(1, 16384, 512, window=1024).seg >= 1024
  with pytest.raises(ValueError, match="form must be one of"):
    kernel_form.forced("parallel").__enter__()
  assert triton.plan_for(2, 4096, 16).seg == 128  # (the T = 4096 kernel case below)
  assert triton.config_for(512, batch=1).block_d == 16  # few rows: more programs
  k, cfg = jnp.zeros((2, 100, 16)), triton.CONFIGS[-1]
  with pytest.raises(ValueError, match="whole chunks of 16"):
    triton_simple.causal_mean(k, k, cfg, True, 24)
  with pytest.raises(ValueError, match="earlier keys"):  # 16 positions, 32 earlier keys
    triton_local.local_mean(k, k, jnp.zeros((100, 100)), 20, cfg, True, 16)


@pytest.mark.parametrize("batch, t_len", [(1, 16384), (8, 2048)])
def test_every_kernel_fills_an_h200_at_long_t_and_small_batch(batch, t_len):
  """impl="auto" for an H200: every Triton call launches >= 528 programs (4 per SM)."""
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


def test_model_trains_the_same_with_the_kernel():
  """AFT-local (3 chunks, keys past the window), 20 Adam steps: impl=xla's losses to 1e-4."""
  t_len = 40
  cfg = ModelConfig(vocab_size=32, max_len=t_len, num_layers=1, d_model=16, mlp_dim=32, window=4)
  cfg = dataclasses.replace(cfg, mixing="aft_local", dropout_rate=0.0)
  # Rows that count up from a random start (mod 32): learnable from the last token.
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


@pytest.mark.parametrize("cfg", mosaic_simple.CONFIGS, ids=lambda c: f"block_d{c.block_d}")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_tpu_kernel_lowers_for_tpu(cfg, dtype):  # forward (one kernel), backward (two)
  x = jax.ShapeDtypeStruct((2, 100, 3 * cfg.block_d), dtype)  # 3 * block_d picks cfg
  loss = lambda k, v: jnp.sum(mosaic_simple.causal_mean(k, v, cfg))
  for kernels, fn in ((1, loss), (2, jax.grad(loss, argnums=(0, 1)))):
    exported = export_for(fn, x, x, platform="tpu", calls=())
    assert exported.mlir_module().count("custom_call @tpu_custom_call(") == kernels
  assert mosaic_simple.config_for(3 * cfg.block_d, batch=1) == cfg
  assert mosaic_simple.config_for(512, batch=1).block_d == 256  # two programs for two cores
  assert mosaic_simple.config_for(512, batch=2) == mosaic_simple.CONFIGS[0]  # block_d 512


def test_impl_on_a_tpu_backend(monkeypatch):
  """For a TPU: "auto" is XLA, "pallas" the TPU kernel (a spy interprets it), refusals."""
  with on_target("TPU v5 lite", "tpu"):
    _impl_on_a_tpu(monkeypatch)


def _impl_on_a_tpu(monkeypatch):
  q, k, v, _ = kernel_inputs(40, D, seed=6)
  auto = functools.partial(ops.aft_simple, causal=True)
  assert "pallas_call" not in str(jax.make_jaxpr(auto)(q, k, v))
  calls = []

  def spy(k, v, cfg=None, interpret=False):
    calls.append((k.shape, cfg, interpret))
    return mosaic_simple.causal_mean(k, v, cfg, True)

  monkeypatch.setattr(simple, "KERNELS", (simple.KERNELS[0], simple.KERNELS[1]._replace(mean=spy)))
  got = ops.aft_simple(q[None], k[None], v[None], causal=True, impl="pallas")
  # [1, 2, T, D] flattened to the kernel's [B, T, D]; compiled, in its own configuration.
  assert calls == [((2, 40, D), None, False)]
  want = ops.aft_simple(q, k, v, causal=True, impl="xla")
  chex.assert_trees_all_close(got[0], want, rtol=RTOL, atol=ATOL)
  z = lambda d: (jnp.zeros((1, 8, d)),) * 2
  cases = [  # (the op's refusals for a TPU: tests/ops/test_common.py's test_resolve)
    (lambda: mosaic_simple.causal_mean(*z(96)), "D = 96 is not a multiple"),
    (lambda: mosaic_simple.causal_mean(*z(384), mosaic_simple.CONFIGS[1]), "cannot tile D = 384"),
  ]
  for fn, msg in cases:
    with pytest.raises(ValueError, match=msg):
      fn()
  # pallas_interpret keeps running the GPU (Triton-layout) kernel: D = 16 is fine there.
  assert "pallas_call" in str(
    jax.make_jaxpr(functools.partial(ops.aft_simple, causal=True, impl="pallas_interpret"))(
      q[..., :16], k[..., :16], v[..., :16]
    )
  )
  assert len(calls) == 1


def test_accelerator_check_measures_the_tpu_kernel_of_aft_simple_only():
  assert accelerator_check.kernel_impl_for("tpu") == "pallas"
  kernel_rows = lambda platform: [
    n for n in accelerator_check.op_rows("pallas", platform) if n.endswith("/pallas")
  ]
  assert kernel_rows("tpu") == ["aft_simple/pallas"]
  assert "aft_local_32/pallas" in kernel_rows("gpu")


def _local_dense(q, k, v, w, window):  # causal AFT-local, one softmax per query row
  tp = jnp.arange(q.shape[-2])

  def row(t):
    bias = jnp.where(t - tp < window, w[t], 0.0)
    logits = jnp.where((tp <= t)[:, None], k + bias[:, None], -jnp.inf)  # [B, T, D]
    return jnp.sum(jax.nn.softmax(logits, axis=-2) * v, axis=-2)

  return jax.nn.sigmoid(q) * jnp.moveaxis(jax.lax.map(row, tp), 0, -2)


def _reference(window, q, k, v, w, ct):  # float64 output [and gradients of sum(out * ct)]
  if not window:
    return simple_reference(q, k, v, ct)
  fn = functools.partial(_local_dense, window=window)
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(x, jnp.float64) for x in (q, k, v, w))
    if ct is None:
      return np.asarray(jax.jit(fn)(*args)), None
    return jax.tree.map(np.asarray, _out_and_grads(fn)(*args, jnp.asarray(ct, jnp.float64)))


def _out_and_grads(fn):  # (q, k, v, w, ct) -> fn's output and grads of sum(out * ct), jitted
  grads = jax.grad(lambda *a: jnp.sum(fn(*a[:4]).astype(jnp.float32) * a[4]), argnums=(0, 1, 2, 3))
  return jax.jit(lambda *a: (fn(*a[:4]), grads(*a)))


def _kernel(op, window, seg, impl="pallas_interpret"):  # the op (seg None) or a kernel
  cfg = triton.CONFIGS[-1]
  if op == "tpu":
    mean = lambda k, v, w: mosaic_simple.causal_mean(k, v, None, True)
  elif seg is None and window:
    return lambda q, k, v, w: ops.aft_local(q, k, v, w, window=window, causal=True, impl=impl)
  elif seg is None:
    return lambda q, k, v, w: ops.aft_simple(q, k, v, causal=True, impl=impl)
  elif window:
    mean = lambda k, v, w: triton_local.local_mean(k, v, w, window, cfg, True, seg)
  else:
    mean = lambda k, v, w: triton_simple.causal_mean(k, v, cfg, True, seg)
  return lambda q, k, v, w: jax.nn.sigmoid(q) * mean(k, v, w)


def _case(op, t_len, d=16, window=0, seg=None, dtype="f32", stds=(None,), grads=True, want="f64",
          rows=2, seed=None, form="sequential"):  # fmt: skip
  name = f"{op}-T{t_len}-d{d}-s{window}-seg{seg}-{dtype}-{want}{'-grads' if grads else ''}"
  return pytest.param(
    op, t_len, d, window, seg, dtype, stds, grads, want, rows, seed, form, id=name
  )


# k's rows of std 1 and 40 (``stds``: both rows and w of each); T ragged, below a chunk, several
# chunks or segments; windows of 1 and 3 key blocks or past T; "xla": float64 too big, or bf16.
KERNEL_CASES = [
  *(_case("simple", t) for t in (1, 7, 128, 1000)),
  _case("simple", 4096, grads=False, seed=3, form="auto"),  # 32 segments of 128
  _case("simple", 37, d=32, dtype="bf16", grads=False, want="xla", seed=0),
  _case("simple", 600, seg=32),
  _case("simple", 100, seg=16, dtype="bf16"),
  *(_case("tpu", t, d=128) for t in (1, 7, 128, 1000)),
  _case("tpu", 150, d=512, seed=8),  # block_d 512: four lane tiles
  _case("tpu", 4096, d=128, grads=False, seed=3),
  _case("tpu", 200, d=128, dtype="bf16", seed=5),
  *(_case("local", t, window=s, stds=(1, 40)) for t, s in ((1, 3), (7, 20), (100, 5), (128, 32))),
  _case("local", 200, window=20, seg=32, stds=(40.0,)),
  _case("local", 100, window=5, seg=16, stds=(1.0,)),
  _case("local", 1000, window=48, grads=False, seed=5),
  _case("local", 4096, window=32, stds=(40.0,), grads=False, want="xla", rows=1, seed=7),
  _case("local", 37, d=32, window=8, dtype="bf16", stds=(1.0,), want="xla", seed=1),
]  # fmt: skip


@pytest.mark.parametrize("op, t_len, d, window, seg, dtype, stds, grads, want, rows, seed, form",
                         KERNEL_CASES)  # fmt: skip
def test_kernel_against_reference(op, t_len, d, window, seg, dtype, stds, grads, want, rows, seed,
                                  form):  # fmt: skip
  """Output and gradients (bf16: dtypes kept) against float64 (or the XLA path)."""
  bf16, tol = dtype == "bf16", 2e-2 if dtype == "bf16" else 1e-4
  jitted = lambda fn: _out_and_grads(fn) if grads else jax.jit(lambda *a: (fn(*a[:4]), None))
  run = jitted(_kernel(op, window, seg))
  for std in stds:
    q, k, v, ct = kernel_inputs(t_len, d, seed=t_len if seed is None else seed)
    w = np.random.default_rng((t_len if seed is None else seed) + 1).normal(size=(t_len, t_len))
    w = (w * (std or 1.0)).astype(np.float32)
    if std:
      k = k / np.array([1.0, 40.0], np.float32)[:, None, None] * std
    q, k, v, ct = (x[:rows] for x in (q, k, v, ct))
    args = tuple(jnp.asarray(x, jnp.bfloat16 if bf16 else jnp.float32) for x in (q, k, v)) + (w,)
    with kernel_form.forced(form):
      out, got = run(*args, ct)
    if want == "xla":
      want_out, want_grads = jitted(_kernel(op, window, None, "xla"))(*args, ct)
    else:
      want_out, want_grads = _reference(
        window, *(np.float32(x) for x in args), ct if grads else None
      )
    if bf16:
      assert out.dtype == (jnp.bfloat16 if seg is None and op != "tpu" else jnp.float32)
      chex.assert_trees_all_close(np.float32(out), np.float32(want_out), atol=2e-2)
    else:
      chex.assert_trees_all_close(out, want_out, rtol=RTOL, atol=ATOL, custom_message=f"std {std}")
    for g, x in zip(got or (), want_grads or ()):  # (T = 1: dw is 0, up to float32 rounding)
      g, x = np.float32(g), np.float32(x)
      atol = tol * np.abs(x).max() + 1e-6
      np.testing.assert_allclose(g, x, rtol=0 if bf16 else tol, atol=atol, err_msg=f"std {std}")
    if bf16 and grads:
      assert [g.dtype for g in got[:3]] == [jnp.bfloat16] * 3


@pytest.mark.parametrize("keys", ["std1_std40", "extreme"])
def test_decay_kernel_against_reference(keys):
  """T 37 (chunks and a rest), decays 0, 1e-6, 0.7, 30, a bonus: the output against the float64
  loop reference, gradients in q, k, v, decay, bonus against the float64 XLA form; two pieces."""
  q, k, v, ct = kernel_inputs(37, 16, seed=11)
  if keys == "extreme":  # exp overflows past 88 (float32)
    k = np.sign(k) * np.array([60.0, 1e4], np.float32)[:, None, None]
  lam = np.repeat(np.array([0.0, 1e-6, 0.7, 30.0], np.float32), 4)
  u = np.float32(2.0) * ct[0, 0]
  args = (q, k, v, lam, u)
  loss = lambda impl: lambda *a: jnp.sum(ops.aft_decay(*a, impl=impl) * ct)
  grads = jax.jit(jax.grad(loss("pallas_interpret"), argnums=range(5)))(*args)
  y = ops.aft_decay(*args, impl="pallas_interpret")
  np.testing.assert_allclose(y, numpy_reference.aft_decay(*args), rtol=1e-5, atol=1e-6)
  with jax.enable_x64(True):
    want = jax.grad(loss("xla"), argnums=range(5))(*(np.float64(x) for x in args))
  for g, x in zip(grads, want):
    np.testing.assert_allclose(g, x, rtol=1e-5, atol=1e-5 * np.abs(x).max())

  def pieces(impl, q, k, v, lam, u):  # keys std 1 or +-60 (the state enters as one float32 key)
    piece = lambda s, **kw: ops.aft_decay(q[:1, s], k[:1, s], v[:1, s], lam, u, impl=impl,
                                          output_final_state=True, **kw)  # fmt: skip
    y1, state = piece(slice(0, 20))
    y2, state = piece(slice(20, None), initial_state=state)
    y, lse_ = jnp.concatenate([y1, y2], 1), state.m + jnp.log(state.den)
    return jnp.sum(y * ct[:1]) + jnp.sum(lse_ + state.num / state.den), (y, lse_, state)

  run = lambda impl: jax.jit(jax.value_and_grad(functools.partial(pieces, impl), range(5), True))
  (_, (y1, lse1, s1)), g1 = run("pallas_interpret")(*args)
  (_, (_, lse2, s2)), g2 = run("xla")(*args)
  np.testing.assert_allclose(y1, y[:1], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse1, lse2, rtol=1e-6)
  np.testing.assert_allclose(s1.num / s1.den, s2.num / s2.den, rtol=1e-5, atol=1e-6)
  for g, x in zip(g1, g2):
    np.testing.assert_allclose(g, x, rtol=1e-5, atol=1e-5 * np.abs(x).max())


def test_tpu_kernel_exact_paths_are_taken_and_needed(monkeypatch):
  """At std 40 the fast paths alone are wrong; the exact scans alone are exact."""
  q, k, v, ct = kernel_inputs(300, 128, seed=4)
  w = np.zeros((300, 300), np.float32)
  want = simple_reference(q, k, v, ct)
  tpu = lambda: _out_and_grads(_kernel("tpu", 0, None))(q, k, v, w, ct)

  def matches(got, rows=(0, 1)):
    chex.assert_trees_all_close(got[0][rows,], want[0][rows,], rtol=RTOL, atol=ATOL)
    for g, x in zip(got[1], want[1]):
      np.testing.assert_allclose(g[rows,], x[rows,], rtol=1e-4, atol=1e-4 * np.abs(x[rows,]).max())

  exp_max = lse.EXP_MAX
  monkeypatch.setattr(mosaic_simple, "MIN_DEN", 0.0)  # forward: fast path only (no term set
  monkeypatch.setattr(lse, "EXP_MAX", np.inf)  # aside either, however far k rises)
  out, grads = tpu()
  assert not np.all(np.isclose(out[1], want[0][1], rtol=RTOL, atol=ATOL))
  matches((out, grads), rows=(0,))  # std 1 never needed the scan
  monkeypatch.setattr(mosaic_simple, "MIN_DEN", mosaic_simple.DEN_OK)
  monkeypatch.setattr(lse, "EXP_MAX", exp_max)
  monkeypatch.setattr(mosaic_simple, "MAX_RISE", np.inf)  # backward: fast path only
  jax.clear_caches()  # the thresholds are read when traced (newer jax caches custom_vjp traces)
  out, grads = tpu()
  chex.assert_trees_all_close(out, want[0], rtol=RTOL, atol=ATOL)
  assert not np.all(np.isclose(grads[1][1], want[1][1][1], rtol=1e-4, atol=1e-4))
  monkeypatch.setattr(mosaic_simple, "MIN_DEN", np.inf)  # both: the exact scans only
  monkeypatch.setattr(mosaic_simple, "MAX_RISE", -1.0)
  jax.clear_caches()
  matches(tpu())
