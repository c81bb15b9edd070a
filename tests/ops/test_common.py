"""aft_jax/ops/common.py: ``resolve``, kernels added to an op, the device, eager programs."""

import functools
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import ops
from aft_jax.ops import common, local, simple
from aft_jax.ops.common import DeviceFacts
from tests.support.helpers import TRITON, export_for, on_target

CPU = DeviceFacts("cpu", "cpu")
H200 = DeviceFacts("gpu", "NVIDIA H200", (9, 0))
T4 = DeviceFacts("gpu", "Tesla T4", (7, 5))
TPU = DeviceFacts("tpu", "TPU v5 lite")

# (op, impl, causal, D, window, device (None: interpreted)) -> kernel platform, None or error.
CASES = [
  ("aft_simple", "pallas", True, 128, None, H200, "gpu"),
  ("aft_simple", "pallas_interpret", True, 128, None, None, "gpu"),
  ("aft_simple", "pallas", False, 128, None, H200, "the kernel is for causal=True"),
  ("aft_simple", "pallas", True, 12, None, H200, "D = 12 is not a multiple of 16"),
  ("aft_simple", "pallas", True, 128, None, T4, r"Tesla T4 \(compute capability 7.5\), XLA "),
  ("aft_simple", "pallas", True, 128, None, CPU, r"not for the 'cpu' platform \(cpu\)"),
  ("aft_simple", "pallas", True, 128, None, TPU, "tpu"),
  ("aft_simple", "pallas", True, 16, None, TPU, "D = 16 is not a multiple of 128"),
  ("aft_simple", "auto", True, 128, None, H200, "gpu"),
  ("aft_simple", "auto", True, 128, None, TPU, None),  # the TPU kernel is opt-in
  ("aft_simple", "auto", True, 128, None, T4, None),
  ("aft_simple", "auto", True, 12, None, H200, None),
  ("aft_simple", "auto", False, 128, None, H200, None),
  ("aft_local", "pallas", True, 128, 4, H200, "gpu"),
  ("aft_local", "pallas_interpret", True, 128, 2000, None, "window 2000 is larger than .* 1024"),
  ("aft_local", "pallas", True, 24, 4, H200, "D = 24 is not a multiple of 16"),
  ("aft_local", "pallas", True, 128, 4, TPU, r"for \('gpu',\), not for the 'tpu' .*v5 lite\)"),
  ("aft_local", "auto", True, 128, 4, H200, "gpu"),
  ("aft_local", "auto", True, 128, 4, TPU, None),
  ("aft_full", "auto", True, 128, None, H200, None),
  ("aft_full", "pallas", True, 128, None, H200, "there is no Pallas kernel for this op"),
]
KERNELS = {"aft_simple": simple.KERNELS, "aft_local": local.KERNELS, "aft_full": local.FULL_KERNELS}


@pytest.mark.parametrize("op, impl, causal, d, window, device, want", CASES)
def test_resolve(op, impl, causal, d, window, device, want):
  choose = functools.partial(
    common.resolve, op, impl, KERNELS[op], causal=causal, channels=d, window=window
  )
  if want is None or want in ("gpu", "tpu"):
    kernel = choose(device=device)
    assert (kernel and kernel.platform) == want
  else:
    with pytest.raises(ValueError, match=want) as e:
      choose(device=device)
    assert str(e.value).startswith(f"{op}: ") and "\n" not in str(e.value)
  for xla in ("xla",) + (("auto",) if device in (CPU, T4) else ()):
    assert (
      choose.func(op, xla, KERNELS[op], causal=causal, channels=d, window=window, device=device)
      is None
    )


def test_forward_mode_takes_xla():  # (refused for "pallas": test_transforms.py)
  choose = functools.partial(common.resolve, "aft_simple", kernels=simple.KERNELS, causal=True)
  assert choose(impl="auto", channels=128, forward=True, device=H200) is None


@pytest.fixture
def fake_kernel(monkeypatch):
  """AFT-full's "kernel" for this host: a mean of 7, even channels only; calls record interpret."""
  calls = []

  def mean(k, v, w, window, interpret):
    calls.append(interpret)
    return jnp.full(k.shape, 7.0, jnp.float32)

  unsupported = lambda d, window: None if d % 2 == 0 else "the fake kernel takes even channels"
  fake = common.Kernel(jax.devices()[0].platform, mean, unsupported)
  monkeypatch.setattr(local, "FULL_KERNELS", (fake,))
  return fake, calls


def _full_inputs(d):
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 6, d)), jnp.float32) for _ in range(3))
  return q, k, v, jnp.asarray(rng.normal(size=(6, 6)), jnp.float32)


def test_a_kernel_added_to_an_op_is_what_it_runs(fake_kernel):
  fake, calls = fake_kernel
  q, k, v, w = _full_inputs(4)
  seven = jax.nn.sigmoid(q) * 7.0
  for impl, interpret in (("pallas", False), ("pallas_interpret", True), ("auto", False)):
    chex.assert_trees_all_close(ops.aft_full(q, k, v, w, causal=True, impl=impl), seven)
    assert calls[-1] is interpret, impl
  assert common.resolve("aft_full", "auto", local.FULL_KERNELS, causal=True, channels=4) == fake
  # jit: "auto" holds the kernel and XLA, one branch per platform; this one takes the kernel.
  jitted = jax.jit(functools.partial(ops.aft_full, causal=True))(q, k, v, w)
  chex.assert_trees_all_close(jitted, seven)
  assert not np.allclose(ops.aft_full(q, k, v, w, causal=True, impl="xla"), seven)


def test_a_kernel_added_to_an_op_says_why_not(fake_kernel):
  q, k, v, w = _full_inputs(3)
  xla = ops.aft_full(q, k, v, w, causal=True, impl="xla")
  chex.assert_trees_all_close(ops.aft_full(q, k, v, w, causal=True), xla)  # "auto": XLA
  with pytest.raises(ValueError, match=r"aft_full: impl='pallas' is not available: the fake "):
    ops.aft_full(q, k, v, w, causal=True, impl="pallas")


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


def test_device_of_abstract_and_default_devices():
  assert ops.device_facts() == DeviceFacts("cpu", jax.devices()[0].device_kind)
  with on_target("NVIDIA H200"):
    assert ops.device_facts() == H200
  with on_target("Tesla T4"):
    t4 = ops.device_facts()
  assert t4.compute_capability == (7, 5) and "compute capability 7.5" in str(t4)
  with on_target("TPU v5 lite", "tpu"):
    assert ops.device_facts().platform == "tpu"
  with on_target("Some Future GPU"):
    assert "not known" in common.gpu_kernels_refused(ops.device_facts())
  # The longest name wins: an A10 is not an A100, an A100 not an A10.
  assert common.capability_of_kind("NVIDIA A10") == (8, 6)
  assert common.capability_of_kind("NVIDIA A100-SXM4-40GB") == (8, 0)


def _export(fn, args, platforms, device):
  with on_target(device):
    return jax.export.export(
      jax.jit(fn),
      platforms=platforms,
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)],
    )(*args)


def test_auto_takes_xla_for_each_platform_without_kernels():
  """Lowered for the CPU under an H200, or CPU and CUDA under a T4: XLA's values here."""
  q, k, v, w = _inputs()
  fn = jax.value_and_grad(_loss(OPS["aft_local"]), argnums=(0, 1, 2, 3))
  want = jax.jit(
    jax.value_and_grad(_loss(functools.partial(OPS["aft_local"], impl="xla")), argnums=(0, 1, 2, 3))
  )(q, k, v, w)
  for platforms, device in ((["cpu"], "NVIDIA H200"), (["cpu", "cuda"], "Tesla T4")):
    exported = _export(fn, (q, k, v, w), platforms, device)
    assert TRITON not in exported.mlir_module()
    chex.assert_trees_all_close(exported.call(q, k, v, w), want, rtol=1e-5, atol=1e-5)
  assert TRITON in _export(fn, (q, k, v, w), ["cuda"], "NVIDIA H200").mlir_module()


def test_without_a_triton_backend_auto_warns_once_and_pallas_names_the_jax(monkeypatch):
  """Pallas' Triton backend (deprecated from jax 0.11) made unimportable."""
  import jax.experimental.pallas as pallas

  monkeypatch.delattr(pallas, "triton", raising=False)
  monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
  monkeypatch.setattr(common, "_SAID", set())  # the warnings given so far
  assert jax.__version__ in common.triton_missing()
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _inputs()]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
      module = export_for(OPS["aft_simple"], *args, calls=(), device="NVIDIA H200").mlir_module()
      assert TRITON not in module
  said = [str(w.message) for w in caught if "Pallas Triton backend" in str(w.message)]
  assert len(said) == 1, [str(w.message) for w in caught]
  assert said[0].startswith("aft_jax.ops: impl='auto' takes the XLA path: on NVIDIA H200"), said
  with on_target("NVIDIA H200"), pytest.raises(ValueError, match=f"jax {jax.__version__} has no"):
    jax.eval_shape(functools.partial(OPS["aft_simple"], impl="pallas"), *args)


def test_an_eager_call_is_one_program_per_shape_and_device():
  """One program (not one per primitive), reused; for another device a program of its own."""
  q, k, v = (np.asarray(x)[:, :7] for x in _inputs()[:3])  # a shape no other test uses
  compiles = []
  listener = lambda event, secs, **_: compiles.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    before = common._program._cache_size()
    first = ops.aft_simple(q, k, v, causal=True, impl="auto")
    backend = "/jax/core/compile/backend_compile_duration"
    assert compiles.count(backend) == 1, compiles
    compiles.clear()
    chex.assert_trees_all_equal(ops.aft_simple(q, k, v, causal=True, impl="auto"), first)
    assert backend not in compiles and common._program._cache_size() == before + 1
    with on_target("Tesla T4"):  # the same call for another device: a program of its own
      chex.assert_trees_all_equal(ops.aft_simple(q, k, v, causal=True, impl="auto"), first)
    assert common._program._cache_size() == before + 2
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def test_pieces_called_eagerly_are_one_program():  # the offset (the state's index) traced
  q, k, v = (np.asarray(x)[:1, :20, :3] for x in _inputs()[:3])  # a shape no other test uses
  w = np.asarray(jax.random.normal(jax.random.key(1), (20, 20)))
  state, ys = ops.aft_local_init((1, 3), 3), []
  before = common._program._cache_size()
  for at in range(0, 20, 4):
    piece = (x[:, at : at + 4] for x in (q, k, v))
    kw = dict(window=3, causal=True, initial_state=state, output_final_state=True)
    y, state = ops.aft_local(*piece, w, **kw)
    ys.append(y)
  assert common._program._cache_size() == before + 1
  whole = ops.aft_local(q, k, v, w, window=3, causal=True)
  np.testing.assert_allclose(np.concatenate(ys, 1), whole, rtol=1e-5, atol=1e-6)


def test_a_traced_call_enters_at_most_three_modules():
  """A reader's path to the maths: one XLA call of an op or AFTLocal.apply, traced, enters at most
  3 modules of aft_jax/ops (the op's, the triple's, common.py)."""
  import os

  from aft_jax import layers

  root = os.path.dirname(os.path.abspath(ops.__file__)) + os.sep
  x = jax.ShapeDtypeStruct((2, 13, 5), jnp.float32)  # shapes no other test traces (jax's caches)
  w = jax.ShapeDtypeStruct((13, 13), jnp.float32)
  layer = layers.AFTLocal(max_len=13, window=4, hidden_dim=5, causal=True)
  cases = {
    "aft_simple": (lambda q, k, v: ops.aft_simple(q, k, v, causal=True, impl="xla"), (x, x, x)),
    "aft_local": (
      lambda q, k, v, w: ops.aft_local(q, k, v, w, window=4, causal=True, impl="xla"),
      (x, x, x, w),
    ),
    "aft_full": (lambda q, k, v, w: ops.aft_full(q, k, v, w, impl="xla"), (x, x, x, w)),
    "aft_decay": (lambda q, k, v: ops.aft_decay(q, k, v, jnp.ones(5), impl="xla"), (x, x, x)),
    "AFTLocal.apply": (layer.apply, (jax.eval_shape(layer.init, jax.random.key(0), x), x)),
  }
  for name, (fn, args) in cases.items():
    seen = set()

    def hook(frame, event, _):
      if event == "call" and frame.f_code.co_filename.startswith(root):
        seen.add(frame.f_code.co_filename[len(root) :])

    sys.setprofile(hook)
    try:
      jax.jit(fn).lower(*args)
    finally:
      sys.setprofile(None)
    assert "common.py" in seen and len(seen) <= 3, (name, sorted(seen))
