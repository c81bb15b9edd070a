"""impl="auto" follows the device a computation is lowered for (aft_jax.ops.target), not the
host: kernels for an abstract H200, XLA for an abstract T4 (XLA refuses Triton below compute
capability 8.0), a one-line error for impl="pallas" there, both paths in one module exported
for CPU and CUDA, and XLA with one warning where jax has no Pallas Triton backend."""

import functools
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import ops
from aft_jax.ops import plain, target
from tests.support.helpers import TRITON, export_for, on_target

T, D = 40, 32


def _inputs(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, T, D)), dtype) for _ in range(3))
  w = jnp.asarray(rng.normal(size=(T, T)), jnp.float32)
  return q, k, v, w


OPS = {
  "aft_simple": lambda q, k, v, w, impl="auto": ops.aft_simple(q, k, v, causal=True, impl=impl),
  "aft_local": lambda q, k, v, w, impl="auto": ops.aft_local(
    q, k, v, w, window=8, causal=True, impl=impl
  ),
}


def _loss(op):
  return lambda q, k, v, w: jnp.sum(op(q, k, v, w).astype(jnp.float32) ** 2)


def test_target_of_abstract_and_default_devices():
  assert target.current() == target.DeviceFacts("cpu", jax.devices()[0].device_kind)
  with on_target("NVIDIA H200"):
    assert target.current() == target.DeviceFacts("gpu", "NVIDIA H200", (9, 0))
  with on_target("Tesla T4"):
    t4 = target.current()
  assert t4.compute_capability == (7, 5) and "compute capability 7.5" in str(t4)
  with on_target("TPU v5 lite", "tpu"):
    assert target.current().platform == "tpu"
  with on_target("Some Future GPU"):
    assert "not known" in target.gpu_kernels_refused(target.current())
  # The longest name wins: an A10 is not an A100, an A100 not an A10.
  assert target.capability_of_kind("NVIDIA A10") == (8, 6)
  assert target.capability_of_kind("NVIDIA A100-SXM4-40GB") == (8, 0)


@pytest.mark.parametrize("name", sorted(OPS))
def test_auto_exports_kernels_for_an_h200_and_none_for_a_t4(name):
  """jax.export for CUDA from this CPU host, forward and forward+backward: the Triton calls are
  there under an abstract H200 and absent under an abstract T4."""
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _inputs(jnp.bfloat16)]
  for fn in (OPS[name], jax.grad(_loss(OPS[name]), argnums=(0, 1, 2))):
    h200 = export_for(fn, *args, device="NVIDIA H200").mlir_module()
    t4 = export_for(fn, *args, device="Tesla T4").mlir_module()
    assert f"custom_call @{TRITON}(" in h200
    assert TRITON not in t4 and "stablehlo" in t4


@pytest.mark.parametrize("name", sorted(OPS))
def test_pallas_for_a_t4_names_the_capability(name):
  q, k, v, w = _inputs()
  with (
    on_target("Tesla T4"),
    pytest.raises(ValueError, match=r"Tesla T4 \(compute capability 7.5\)"),
  ):
    jax.eval_shape(functools.partial(OPS[name], impl="pallas"), q, k, v, w)


def _export(fn, args, platforms, device):
  with on_target(device):
    return jax.export.export(
      jax.jit(fn),
      platforms=platforms,
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)],
    )(*args)


def test_auto_takes_xla_for_each_platform_without_kernels():
  """The kernel is chosen per lowering platform (jax.lax.platform_dependent): lowered for the
  CPU under an H200 target, the program takes the XLA branch and runs here; under a T4, one
  module for CPU and CUDA runs here too. Value and gradients equal XLA's. (A module for both
  CPU and CUDA *with* the kernels is refused by jax 0.10: pallas_call's CPU lowering rule
  rejects compiled kernels in every branch; docs/kernels.md.)"""
  q, k, v, w = _inputs()
  fn = jax.value_and_grad(_loss(OPS["aft_local"]), argnums=(0, 1, 2, 3))
  want = jax.value_and_grad(
    _loss(functools.partial(OPS["aft_local"], impl="xla")), argnums=(0, 1, 2, 3)
  )(q, k, v, w)
  for platforms, device in ((["cpu"], "NVIDIA H200"), (["cpu", "cuda"], "Tesla T4")):
    exported = _export(fn, (q, k, v, w), platforms, device)
    assert TRITON not in exported.mlir_module()
    chex.assert_trees_all_close(exported.call(q, k, v, w), want, rtol=1e-5, atol=1e-5)
  assert TRITON in _export(fn, (q, k, v, w), ["cuda"], "NVIDIA H200").mlir_module()


def test_without_a_triton_backend_auto_warns_once_and_pallas_names_the_jax(monkeypatch):
  """jax builds without Pallas' Triton backend (deprecated from jax 0.11): simulated by making
  its module unimportable."""
  import jax.experimental.pallas as pallas

  monkeypatch.delattr(pallas, "triton", raising=False)
  monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
  monkeypatch.setattr(plain, "_SAID", set())  # the warnings given so far
  assert jax.__version__ in target.triton_missing()
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _inputs()]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
      module = export_for(OPS["aft_simple"], *args, calls=(), device="NVIDIA H200").mlir_module()
      assert TRITON not in module
  said = [w for w in caught if "Pallas Triton backend" in str(w.message)]
  assert len(said) == 1, [str(w.message) for w in caught]
  with on_target("NVIDIA H200"), pytest.raises(ValueError, match=f"jax {jax.__version__} has no"):
    jax.eval_shape(functools.partial(OPS["aft_simple"], impl="pallas"), *args)


def test_an_eager_call_is_one_program_per_shape_and_device():
  """Called on concrete arrays, an op compiles one program (not one per primitive), reused by
  the next call of that shape; a call made for another device (what impl="auto" reads) is a
  program of its own, never the cached one."""
  q, k, v = (np.asarray(x)[:, :7] for x in _inputs()[:3])  # a shape no other test uses
  compiles = []
  listener = lambda event, secs, **_: compiles.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    before = ops._program._cache_size()
    first = ops.aft_simple(q, k, v, causal=True, impl="auto")
    backend = "/jax/core/compile/backend_compile_duration"
    assert compiles.count(backend) == 1, compiles
    compiles.clear()
    chex.assert_trees_all_equal(ops.aft_simple(q, k, v, causal=True, impl="auto"), first)
    assert backend not in compiles and ops._program._cache_size() == before + 1
    with on_target("Tesla T4"):  # the same call for another device: a program of its own
      chex.assert_trees_all_equal(ops.aft_simple(q, k, v, causal=True, impl="auto"), first)
    assert ops._program._cache_size() == before + 2
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
