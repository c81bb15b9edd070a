"""AFT with a learned decay against causal AFT-simple: forward+backward at one size (gradients in
q, k, v and, for the decay op, its decay and bonus) per chunk size, and the one-token step.

    python -m benchmarks.bench_decay --out benchmarks/results            # B 8, T 4096, D 512
    python -m benchmarks.bench_decay --quick --out /tmp/bench            # seconds on CPU
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax import ops
from aft_jax.ops import decay as decay_op
from benchmarks import common
from benchmarks.bench_ops import fwd_bwd, make_inputs


def _decay_params(d: int):
  rng = np.random.default_rng(1)
  return jnp.asarray(rng.uniform(0.0, 1.0, d), jnp.float32), jnp.zeros(d, jnp.float32)


def _steps(step, n: int):  # n one-token steps in one jitted scan: (state, x [n, B, D] x 3) -> y
  def run(state, q, k, v):
    return jax.lax.scan(lambda s, x: step(s, *x)[::-1], state, (q, k, v))[1]

  return run


def main(argv=None):
  p = common.parser(__doc__, "tiny sizes, for tests (seconds on CPU)")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--t_len", type=int, default=4096)
  p.add_argument("--d", type=int, default=512)
  p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 3, 4, 8])
  p.add_argument("--steps", type=int, default=256, help="tokens per timed scan of steps")
  common.add_timing_args(p, "calls")
  a = p.parse_args(argv)
  if a.quick:
    a.batch, a.t_len, a.d, a.chunks, a.steps, a.repeats, a.min_seconds = 2, 64, 16, [2], 8, 2, 0.0
  info = common.machine_info("python -m benchmarks.bench_decay", argv)
  info.update(batch=a.batch, t_len=a.t_len, d=a.d)
  (q, k, v), ct = make_inputs(a.batch, a.t_len, a.d, None)
  lam, u = _decay_params(a.d)
  timing = dict(repeats=a.repeats, min_seconds=a.min_seconds)
  rows = {}
  simple = lambda q, k, v: ops.aft_simple(q, k, v, causal=True)
  rows["aft_simple"] = common.measure(fwd_bwd(simple), (q, k, v, ct), **timing)
  default = decay_op.CHUNK
  try:  # read when the op is traced
    for c in a.chunks:
      decay_op.CHUNK = c
      rec = common.measure(fwd_bwd(ops.aft_decay), (q, k, v, lam, u, ct), **timing)
      rows[f"aft_decay (chunk {c})"] = rec
  finally:
    decay_op.CHUNK = default
  x = jnp.swapaxes(q[:, : a.steps], 0, 1)  # [steps, B, D] (steps <= T)
  init = ops.aft_simple_init(x.shape[1:])
  decay_step = lambda s, q, k, v: ops.aft_decay_step(s, q, k, v, lam, u)
  for name, step in (("aft_simple_step", ops.aft_simple_step), ("aft_decay_step", decay_step)):
    rows[f"{name} x {a.steps} (scan)"] = common.measure(_steps(step, a.steps), (init, x, x, x),
                                                         **timing)  # fmt: skip
    one = jax.jit(step)
    jax.block_until_ready(one(init, x[0], x[0], x[0]))
    times = []
    for _ in range(200):
      t0 = time.perf_counter()
      jax.block_until_ready(one(init, x[0], x[0], x[0]))
      times.append(time.perf_counter() - t0)
    rows[f"{name} (one jitted call)"] = dict(time_s=float(np.median(times)), temp_bytes=None)
  base = rows["aft_simple"]["time_s"]
  lines = [f"\nbatch {a.batch}, T {a.t_len}, D {a.d}, {info['device_kind']}\n"]
  table = []
  for name, r in rows.items():
    ref = base
    if "step" in name:
      ref = rows[name.replace("aft_decay_step", "aft_simple_step")]["time_s"]
    table.append([name, common.fmt_time(r["time_s"]), f"{r['time_s'] / ref:.2f}x",
                  common.fmt_bytes(r["temp_bytes"]) if r.get("temp_bytes") else ""])  # fmt: skip
  lines += common.table(["form", "median time", "/ aft_simple's", "XLA temp"], table, "lrrr")
  md = "\n".join(lines) + "\n"
  common.write_outputs(a.out, "bench_decay", dict(machine=info, records=rows), md, partial=False)


if __name__ == "__main__":
  main()
