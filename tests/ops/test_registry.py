"""The dispatch table of the ops (aft_jax/ops/registry.py): every entry's ``supports`` and its
reasons, and ``impl`` resolved from the table by ``registry.resolve`` alone (a kernel added to
the table in a fixture is what the ops then run)."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import ops
from aft_jax.ops import registry
from aft_jax.ops.registry import OpArgs
from aft_jax.ops.target import DeviceFacts

CPU = DeviceFacts("cpu", "cpu")
H200 = DeviceFacts("gpu", "NVIDIA H200", (9, 0))
T4 = DeviceFacts("gpu", "Tesla T4", (7, 5))
TPU = DeviceFacts("tpu", "TPU v5 lite")


def _args(d=128, causal=True, window=None, t_len=8):
  x, w = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, t_len, d), (t_len, t_len)))
  return OpArgs(x, x, x, w, causal=causal, window=window)


# Per entry of the table: (args, device, a piece of the reason, or None: supported).
SUPPORTS = {
  ("aft_simple", "triton"): [
    (_args(), H200, None),
    (_args(), None, None),  # interpreted: the arguments alone
    (_args(causal=False), H200, "the kernel is for causal=True"),
    (_args(d=12), H200, "D = 12 is not a multiple of 16"),
    (_args(), T4, r"Tesla T4 \(compute capability 7.5\), XLA compiles Triton kernels only"),
    (_args(), CPU, "not for 'cpu'"),
  ],
  ("aft_simple", "mosaic"): [
    (_args(), TPU, None),
    (_args(causal=False), TPU, "the kernel is for causal=True"),
    (_args(d=16), TPU, "D = 16 is not a multiple of 128"),
    (_args(), CPU, "compiles for the 'tpu' platform, not for 'cpu'"),
    (_args(), H200, "not for 'gpu'"),
  ],
  ("aft_local", "triton"): [
    (_args(window=4), H200, None),
    (_args(window=4, causal=False), H200, "the kernel is for causal=True"),
    (_args(window=2000), None, "the window 2000 is larger than the kernel's 1024"),
    (_args(d=24, window=4), H200, "D = 24 is not a multiple of 16"),
    (_args(window=4), T4, "compute capability 7.5"),
    (_args(window=4), TPU, r"compiles for the 'gpu' platform, not for 'tpu' \(TPU v5 lite\)"),
  ],
}
XLA_CASES = [
  (_args(d=d, causal=c), dev, None)
  for d in (12, 128)
  for c in (False, True)
  for dev in (None, CPU, T4, TPU)
]


def _entries():
  return [(op, impl) for op, impls in registry.TABLE.items() for impl in impls]


@pytest.mark.parametrize("op, impl", _entries(), ids=lambda x: getattr(x, "name", x))
def test_every_entry_says_what_it_supports(op, impl):
  cases = XLA_CASES if impl.name == "xla" else SUPPORTS[op, impl.name]
  for args, device, reason in cases:
    why = impl.supports(args, device)
    if reason is None:
      assert why is None, (args, device, why)
    else:
      assert why is not None and re.search(reason, why), (device, why)


def test_the_table_lists_xla_first_and_the_gpu_kernels_before_others():
  for op, impls in registry.TABLE.items():
    assert impls[0].name == "xla" and impls[0].platform is None, op
    platforms = [k.platform for k in impls[1:]]
    assert platforms == sorted(platforms, key=lambda p: p != "gpu"), op
  assert [k.name for k in registry.TABLE["aft_simple"] if k.auto] == ["triton"]


# --------------------------------------------------------------------------- a kernel added


@pytest.fixture
def fake_kernel(monkeypatch):
  """A "kernel" of AFT-full for this host's platform, in the table for the test: it returns 7
  everywhere and takes even channel counts only. The calls record ``interpret``."""
  calls = []

  def run(args, interpret):
    calls.append(interpret)
    return jnp.full(args.q.shape, 7.0, args.q.dtype)

  def supports(args, device):
    return None if args.q.shape[-1] % 2 == 0 else "the fake kernel takes even channel counts"

  platform = jax.devices()[0].platform
  fake = registry.Impl("fake", run, supports, platform=platform, auto=True)
  monkeypatch.setitem(registry.TABLE, "aft_full", registry.TABLE["aft_full"] + (fake,))
  return fake, calls


def _full_inputs(d):
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 6, d)), jnp.float32) for _ in range(3))
  return q, k, v, jnp.asarray(rng.normal(size=(6, 6)), jnp.float32)


def test_a_kernel_added_to_the_table_is_what_the_op_runs(fake_kernel):
  fake, calls = fake_kernel
  q, k, v, w = _full_inputs(4)
  for impl, interpret in (("pallas", False), ("pallas_interpret", True), ("auto", False)):
    np.testing.assert_array_equal(ops.aft_full(q, k, v, w, causal=True, impl=impl), 7.0)
    assert calls[-1] is interpret, impl
  choice = registry.resolve("aft_full", "auto", OpArgs(q, k, v, w, causal=True))
  assert choice == registry.Choice(fake, fallback=registry.TABLE["aft_full"][0])
  # jit: "auto" holds the kernel and XLA, one branch per platform; this one takes the kernel.
  jitted = jax.jit(functools.partial(ops.aft_full, causal=True))(q, k, v, w)
  np.testing.assert_array_equal(jitted, 7.0)
  want = ops.aft_full(q, k, v, w, causal=True, impl="xla")
  assert not np.allclose(want, 7.0)


def test_a_kernel_added_to_the_table_says_why_not(fake_kernel):
  q, k, v, w = _full_inputs(3)
  xla = ops.aft_full(q, k, v, w, causal=True, impl="xla")
  chex.assert_trees_all_close(ops.aft_full(q, k, v, w, causal=True), xla)  # "auto": XLA
  with pytest.raises(ValueError, match=r"aft_full: impl='pallas' is not available: the fake "):
    ops.aft_full(q, k, v, w, causal=True, impl="pallas")


def test_without_kernels_only_xla_resolves():
  q, k, v, w = _full_inputs(4)
  args = OpArgs(q, k, v, w, causal=True)
  for impl in ("auto", "xla"):
    assert registry.resolve("aft_full", impl, args).impl.name == "xla"
  for impl in ("pallas", "pallas_interpret"):
    with pytest.raises(ValueError, match="no Pallas kernel for this op"):
      registry.resolve("aft_full", impl, args)
  with pytest.raises(ValueError, match="impl must be one of"):
    registry.resolve("aft_full", "triton", args)


def test_auto_takes_xla_with_a_warning_where_this_jax_cannot_build_the_kernel(monkeypatch):
  """``Impl.missing``: the reason is the Choice's warning (the ops give it once)."""
  supports = lambda args, device: device and "this jax has no fake backend"
  platform = jax.devices()[0].platform
  fake = registry.Impl("fake", None, supports, platform, auto=True, missing=lambda: "none here")
  monkeypatch.setitem(registry.TABLE, "aft_full", registry.TABLE["aft_full"][:1] + (fake,))
  q, k, v, w = _full_inputs(4)
  choice = registry.resolve("aft_full", "auto", OpArgs(q, k, v, w, causal=True))
  assert choice.impl.name == "xla" and choice.fallback is None
  assert (
    choice.warning == "aft_jax.ops: impl='auto' takes the XLA path: this jax has no fake backend"
  )
