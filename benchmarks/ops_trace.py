"""How many modules of ``aft_jax/ops`` one traced call enters (docs/kernels.md): causal
AFT-simple, causal AFT-local, AFT-full (XLA) and ``AFTLocal.apply`` (impl "auto").

    python -m benchmarks.ops_trace
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

from aft_jax import layers, ops


def modules_entered(fn, *args, fresh: bool = True) -> list[str]:
  """The files of ``aft_jax/ops`` whose frames ``jax.jit(fn).lower(*args)`` enters (a profile
  hook); ``fresh``: jax's caches cleared first."""
  root = os.path.dirname(os.path.abspath(ops.__file__)) + os.sep
  seen = set()

  def hook(frame, event, _):
    if event == "call" and frame.f_code.co_filename.startswith(root):
      seen.add(frame.f_code.co_filename[len(root) :])

  if fresh:
    jax.clear_caches()
  sys.setprofile(hook)
  try:
    jax.jit(fn).lower(*args)
  finally:
    sys.setprofile(None)
  return sorted(seen)


def cases(t_len: int = 16, d: int = 8) -> dict:
  x = jax.ShapeDtypeStruct((2, t_len, d), jnp.float32)
  w = jax.ShapeDtypeStruct((t_len, t_len), jnp.float32)
  layer = layers.AFTLocal(max_len=t_len, window=4, hidden_dim=d, causal=True)
  params = jax.eval_shape(layer.init, jax.random.key(0), x)
  return {
    "aft_simple causal": (
      lambda q, k, v: ops.aft_simple(q, k, v, causal=True, impl="xla"),
      (x,) * 3,
    ),
    "aft_local causal": (
      lambda q, k, v, w: ops.aft_local(q, k, v, w, window=4, causal=True, impl="xla"),
      (x, x, x, w),
    ),
    "aft_full": (lambda q, k, v, w: ops.aft_full(q, k, v, w, impl="xla"), (x, x, x, w)),
    "AFTLocal.apply": (layer.apply, (params, x)),
  }


def main() -> None:
  for name, (fn, args) in cases().items():
    files = modules_entered(fn, *args)
    print(f"{name:18s} {len(files)}  {' '.join(files)}")


if __name__ == "__main__":
  main()
