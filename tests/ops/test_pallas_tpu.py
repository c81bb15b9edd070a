"""The Pallas TPU (Mosaic) kernel for causal AFT-simple (aft_jax.ops.pallas_simple_tpu) and how
``impl`` reaches it.

The kernel runs in Pallas' interpreter on CPU against a float64 reference, and is lowered
(not run) for TPUs with ``jax.export``, so a kernel that Pallas cannot lower to Mosaic fails
here. No test runs it on a TPU.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import ops
from aft_jax.ops import logsumexp as lse
from aft_jax.ops import pallas_simple_tpu as tpu_kernel
from benchmarks import accelerator_check
from tests.support.helpers import export_for, on_target
from tests.ops.test_pallas import ATOL, RTOL, _inputs, _reference

D = 128  # one lane tile: the smallest channel count the kernel takes


def _kernel(q, k, v, ct):
  """sigma(q) * the interpreted TPU kernel's mean, and the gradients (q, k, v) of
  sum(out * ct), in one jit."""
  fn = lambda q, k, v: jax.nn.sigmoid(q) * tpu_kernel.causal_mean(k, v, None, True)
  grads = jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2))
  return jax.jit(lambda *a: (fn(*a), grads(*a)))(q, k, v)


def _assert_matches(got, want, rows=(0, 1)):
  """Output (RTOL, ATOL) and gradients (1e-4 of the largest) of the given batch rows."""
  (out, grads), (want_out, want_grads) = got, want
  chex.assert_trees_all_close(out[rows,], want_out[rows,], rtol=RTOL, atol=ATOL)
  for g, w in zip(grads, want_grads):
    g, w = g[rows,], w[rows,]
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


@pytest.mark.parametrize("t_len", [1, 7, 128, 1000])
def test_tpu_kernel_matches_reference(t_len):
  """Values and gradients, logits of std 1 (batch row 0) and 40 (row 1); T shorter than a
  chunk (1, 7), one chunk (128), and ragged over several (1000)."""
  q, k, v, ct = _inputs(t_len, D, seed=t_len)
  _assert_matches(_kernel(q, k, v, ct), _reference(q, k, v, ct))


def test_tpu_kernel_widest_channel_block():
  """block_d 512 (four lane tiles per block, as ``config_for`` picks for wide layers), two
  chunks with a ragged end."""
  q, k, v, ct = _inputs(150, 512, seed=8)
  cfg = tpu_kernel.CONFIGS[0]
  assert cfg.block_d == 512 and tpu_kernel.config_for(512, batch=2) == cfg
  _assert_matches(_kernel(q, k, v, ct), _reference(q, k, v, ct))


def test_tpu_kernel_long_sequence_forward():
  q, k, v, _ = _inputs(4096, D, seed=3)
  out = jax.jit(lambda q, k, v: jax.nn.sigmoid(q) * tpu_kernel.causal_mean(k, v, None, True))
  want = _reference(q, k, v, np.zeros_like(q))[0]
  chex.assert_trees_all_close(out(q, k, v), want, rtol=RTOL, atol=ATOL)


def test_tpu_kernel_exact_paths_are_taken_and_needed(monkeypatch):
  """At std 40 the fast paths alone are wrong (the chunk's early denominators underflow; L
  rises past what one shift can hold), so the reference test above passes only through the
  exact scans; forced everywhere, the scans alone are exact at std 1 and 40."""
  q, k, v, ct = _inputs(300, D, seed=4)
  want = _reference(q, k, v, ct)
  lse_exp_max = lse.EXP_MAX
  monkeypatch.setattr(tpu_kernel, "MIN_DEN", 0.0)  # forward: fast path only (no term set
  monkeypatch.setattr(lse, "EXP_MAX", np.inf)  # aside either, however far k rises)
  out, grads = _kernel(q, k, v, ct)
  assert not np.all(np.isclose(out[1], want[0][1], rtol=RTOL, atol=ATOL))
  _assert_matches((out, grads), want, rows=(0,))  # std 1 never needed the scan
  monkeypatch.setattr(tpu_kernel, "MIN_DEN", tpu_kernel.DEN_OK)
  monkeypatch.setattr(lse, "EXP_MAX", lse_exp_max)
  monkeypatch.setattr(tpu_kernel, "MAX_RISE", np.inf)  # backward: fast path only
  jax.clear_caches()  # the thresholds are read when traced (newer jax caches custom_vjp traces)
  out, grads = _kernel(q, k, v, ct)
  chex.assert_trees_all_close(out, want[0], rtol=RTOL, atol=ATOL)
  assert not np.all(np.isclose(grads[1][1], want[1][1][1], rtol=1e-4, atol=1e-4))
  monkeypatch.setattr(tpu_kernel, "MIN_DEN", np.inf)  # both: the exact scans only
  monkeypatch.setattr(tpu_kernel, "MAX_RISE", -1.0)
  jax.clear_caches()
  _assert_matches(_kernel(q, k, v, ct), want)


def test_tpu_kernel_bfloat16_inputs():
  """bf16 k, v (float32 inside, a float32, dk and dv bf16): within 2e-2 of the largest output
  or gradient of the float32 computation on the same (rounded) inputs, std 1 and 40."""
  q, k, v, ct = _inputs(200, D, seed=5)
  k16, v16 = (jnp.asarray(x, jnp.bfloat16) for x in (k, v))
  out, grads = _kernel(q, k16, v16, ct)
  assert out.dtype == jnp.float32 and [g.dtype for g in grads[1:]] == [jnp.bfloat16] * 2
  want_out, want_grads = _reference(q, np.float32(k16), np.float32(v16), ct)
  for got, want in zip((out, *grads), (want_out, *want_grads)):
    got = np.asarray(got, np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("cfg", tpu_kernel.CONFIGS, ids=lambda c: f"block_d{c.block_d}")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_tpu_kernel_lowers_for_tpu(cfg, dtype):
  """Every configuration lowers to Mosaic, forward (one kernel) and forward+backward (two),
  T ragged; and ``config_for`` picks each one for some channel count."""
  x = jax.ShapeDtypeStruct((2, 100, 3 * cfg.block_d), dtype)  # 3 * block_d picks cfg
  loss = lambda k, v: jnp.sum(tpu_kernel.causal_mean(k, v, cfg))
  for kernels, fn in ((1, loss), (2, jax.grad(loss, argnums=(0, 1)))):
    exported = export_for(fn, x, x, platform="tpu", calls=())
    assert exported.mlir_module().count("custom_call @tpu_custom_call(") == kernels
  assert tpu_kernel.config_for(3 * cfg.block_d, batch=1) == cfg
  assert tpu_kernel.config_for(512, batch=1).block_d == 256  # two programs for two cores


def test_impl_on_a_tpu_backend(monkeypatch):
  """For a TPU target (an abstract TPU device): "auto" is XLA, "pallas" runs the TPU kernel
  (here interpreted, through a spy) and needs D a multiple of 128, AFT-local has no TPU
  kernel."""
  with on_target("TPU v5 lite", "tpu"):
    _impl_on_a_tpu(monkeypatch)


def _impl_on_a_tpu(monkeypatch):
  q, k, v, _ = _inputs(40, D, seed=6)
  auto = functools.partial(ops.aft_simple, causal=True)
  assert "pallas_call" not in str(jax.make_jaxpr(auto)(q, k, v))
  calls = []

  def spy(k, v):
    calls.append(k.shape)
    return real(k, v, None, True)

  real = tpu_kernel.causal_mean
  monkeypatch.setattr(tpu_kernel, "causal_mean", spy)
  got = ops.aft_simple(q[None], k[None], v[None], causal=True, impl="pallas")
  assert calls == [(2, 40, D)]  # [1, 2, T, D] flattened to the kernel's [B, T, D]
  want = ops.aft_simple(q, k, v, causal=True, impl="xla")
  chex.assert_trees_all_close(got[0], want, rtol=RTOL, atol=ATOL)
  w = np.zeros((40, 40), np.float32)
  cases = [
    (
      lambda: ops.aft_simple(q[..., :16], k[..., :16], v[..., :16], causal=True, impl="pallas"),
      "channel dim D = 16 is not a multiple of 128",
    ),
    (lambda: ops.aft_simple(q, k, v, impl="pallas"), "the kernel is for causal=True"),
    (
      lambda: ops.aft_local(q, k, v, w, window=2, causal=True, impl="pallas"),
      r"for \('gpu',\), not for the 'tpu' platform \(TPU v5 lite\)",
    ),
    (lambda: ops.aft_full(q, k, v, w, causal=True, impl="pallas"), "no Pallas kernel for this op"),
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


def test_tpu_kernel_rejects_channels_it_cannot_tile():
  x = jnp.zeros((1, 8, 96))
  with pytest.raises(ValueError, match="D = 96 is not a multiple of 128"):
    tpu_kernel.causal_mean(x, x, None, True)
  with pytest.raises(ValueError, match="cannot tile D = 384"):
    tpu_kernel.causal_mean(jnp.zeros((1, 8, 384)), jnp.zeros((1, 8, 384)), tpu_kernel.CONFIGS[1])


def test_accelerator_check_measures_the_tpu_kernel_of_aft_simple_only():
  assert accelerator_check.kernel_impl_for("tpu") == "pallas"
  kernel_rows = lambda platform: [
    n for n in accelerator_check.op_rows("pallas", platform) if n.endswith("/pallas")
  ]
  assert kernel_rows("tpu") == ["aft_simple/pallas"]
  assert "aft_local_32/pallas" in kernel_rows("gpu")
