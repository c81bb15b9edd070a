"""On 4 CPU devices: vmap, grad, jax.checkpoint in ``jax.shard_map`` (check_vma=True)."""

import os

# Must precede the first jax import: the device count is fixed when the CPU backend starts.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from aft_jax import ops  # noqa: E402

SEQ = P(None, "seq")


def main():
  assert jax.device_count() == 4, jax.devices()
  mesh = Mesh(np.array(jax.devices()), ("seq",))
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  runs = {
    "simple": lambda q, k, v, w, **kw: ops.aft_simple(q, k, v, causal=True, impl="xla", **kw),
    "local": lambda q, k, v, w, **kw: ops.aft_local(
      q, k, v, w, window=6, causal=True, impl="xla", **kw
    ),
    "decay": lambda q, k, v, w, **kw: ops.aft_decay(q, k, v, jnp.abs(w[0]), w[1], **kw),
  }
  for name, run in runs.items():
    w = f(2, 3) if name == "decay" else f(16, 16)  # decay and bonus, or the bias
    args = (f(2, 16, 3), f(2, 16, 3), f(2, 16, 3), w)  # 4 positions per device
    # The batch vmapped inside the shard_map (the op sees [T / 4, D] per device), checkpointed.
    body = jax.checkpoint(
      jax.vmap(lambda q, k, v, w: run(q, k, v, w, axis_name="seq"), (0, 0, 0, None))
    )
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(SEQ, SEQ, SEQ, P()), out_specs=SEQ)
    ct = f(2, 16, 3)
    both = lambda fn: jax.jit(
      lambda *a: (fn(*a), jax.grad(lambda *b: jnp.sum(fn(*b) * ct), argnums=(0, 1, 2, 3))(*a))
    )
    for got, want in zip(jax.tree.leaves(both(sharded)(*args)), jax.tree.leaves(both(run)(*args))):
      got, want = np.asarray(got), np.asarray(want)
      assert np.all(np.isfinite(got)), name
      err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
      assert err < 1e-5, (name, err)
  print("checked", *runs)


if __name__ == "__main__":
  main()
