"""Runs in its own process with 4 simulated CPU devices (tests/ops/test_transforms.py):
``python -m tests.support.transforms_worker OUT.json``. The ops' axis_name forms inside
``jax.shard_map`` with its defaults (check_vma=True): XLA (values and gradients against the
unsharded op), the compiled kernels lowered for an abstract H200 and TPU v5e mesh, and
impl="pallas_interpret" refused in one line.
"""

import json
import os
import sys

# Must precede the first jax import: the device count is fixed when the CPU backend starts.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from aft_jax import ops  # noqa: E402

T = 16  # 4 positions per device
SEQ = P(None, "seq")


def _inputs(op, size):
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  if op == "conv1d":
    return f(2, T, 2, 2), f(2, T, 2), f(2, T, 2, 2), f(2, size)
  if op == "local_factors":
    return f(2, T, 3), f(2, T, 3), f(2, T, 3), (f(T, 2), f(T, 2))
  return f(2, T, 3), f(2, T, 3), f(2, T, 3), f(T, T)


def _op(op, size, impl="xla"):
  def run(q, k, v, bias, **kw):
    if op == "simple":
      return ops.aft_simple(q, k, v, causal=True, impl=impl, **kw)
    if op.startswith("local"):
      return ops.aft_local(q, k, v, bias, window=size, causal=True, impl=impl, **kw)
    return ops.aft_conv1d(q, k, v, bias, causal=True, impl=impl, **kw)

  return run


def _close(got, want, what):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert np.all(np.isfinite(g)), what
    err = float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30))
    assert err < 1e-5, (what, err)


def _xla(mesh):
  done = []
  # (tests/support/mesh_worker.py sequence checks every axis_name form, the factors and
  # AFT-conv1d too, with shard_map's defaults; here the transformations inside the shard_map.)
  for op, size in (("simple", 0), ("local", 6)):
    run = _op(op, size)
    args = _inputs(op, size)
    # The batch vmapped inside the shard_map (the op sees [T / 4, D] per device), checkpointed.
    body = jax.checkpoint(
      jax.vmap(lambda q, k, v, b: run(q, k, v, b, axis_name="seq"), (0, 0, 0, None))
    )
    bias_spec = jax.tree.map(lambda _: P(), args[3])
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(SEQ, SEQ, SEQ, bias_spec), out_specs=SEQ)
    ct = jnp.asarray(np.random.default_rng(1).normal(size=args[0].shape), jnp.float32)
    both = lambda f: jax.jit(
      lambda *a: (f(*a), jax.grad(lambda *b: jnp.sum(f(*b) * ct), argnums=(0, 1, 2, 3))(*a))
    )
    _close(both(sharded)(*args), both(run)(*args), op)
    done.append(op)
  return done


def _lowered(device_kind, platform, call, d):
  """How many grad programs (aft_simple, and on a GPU aft_local, with impl="pallas" and
  axis_name) lowered for ``platform`` with their kernels (``call`` custom calls) in them."""
  device = jax.sharding.AbstractDevice(
    device_kind=device_kind, num_cores=1, platform={"cuda": "gpu"}.get(platform, platform)
  )
  mesh = jax.sharding.AbstractMesh((4,), ("seq",), abstract_device=device)
  sds = lambda shape, spec: jax.ShapeDtypeStruct(
    shape, jnp.float32, sharding=NamedSharding(mesh, spec)
  )
  qkv = [sds((2, 256, d), SEQ)] * 3
  w = sds((256, 256), P())
  names = ["simple"] + (["local"] if platform == "cuda" else [])
  counts = []
  for op in names:
    run = _op(op, 4, impl="pallas")
    f = jax.shard_map(
      lambda q, k, v, b: run(q, k, v, b, axis_name="seq"),
      mesh=mesh,
      in_specs=(SEQ, SEQ, SEQ, P()),
      out_specs=SEQ,
    )
    g = lambda *a: jax.grad(lambda *b: jnp.sum(f(*b)), argnums=(0, 1, 2, 3))(*a)
    with jax.sharding.use_abstract_mesh(mesh):  # the grad: forward and backward kernels
      exported = jax.export.export(
        jax.jit(g),
        platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(call)],
      )(*qkv, w)
      counts.append(exported.mlir_module().count(call))
  assert all(n >= 2 for n in counts), counts  # the forward and backward kernels at least
  return len(counts)


def _interpret(mesh):
  args = (*(jnp.ones((2, 64, 16)),) * 3, None)  # the kernel's tile: D 16
  run = _op("simple", 0, impl="pallas_interpret")
  f = jax.shard_map(
    lambda q, k, v, b: run(q, k, v, b, axis_name="seq"),
    mesh=mesh,
    in_specs=(SEQ, SEQ, SEQ, P()),
    out_specs=SEQ,
  )
  try:
    jax.jit(f).lower(*args)
  except ValueError as e:
    assert "\n" not in str(e), str(e)
    return str(e)
  raise AssertionError("impl='pallas_interpret' ran under check_vma=True")


def main(out_path):
  assert jax.device_count() == 4, jax.devices()
  mesh = Mesh(np.array(jax.devices()), ("seq",))
  report = {
    "xla": _xla(mesh),
    "lowered": {
      "triton": _lowered("NVIDIA H200", "cuda", ops.KERNEL_CALLS["gpu"], 64),
      "mosaic": _lowered("TPU v5 lite", "tpu", ops.KERNEL_CALLS["tpu"], 128),
    },
    "interpret": _interpret(mesh),
  }
  with open(out_path, "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
