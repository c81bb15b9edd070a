"""What a change to the ops costs: forward+backward time and compiled memory of the XLA path in
two source trees, each row in a subprocess importing ``aft_jax`` from its tree, the trees
interleaved row by row, with the scan peer in the same run (docs/benchmarks.md).

    git worktree add /tmp/before 5cf0850
    python -m benchmarks.before_after --before /tmp/before --out benchmarks/results/before_after
    python -m benchmarks.before_after --before . --quick --out /tmp/ba      # seconds, for tests
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this tree's root

# (op of bench_ops.op_table, batch, T): causal AFT-simple and AFT-local-32 at both shapes,
# AFT-full where its [T, T] bias is cheap (at T 16384 w alone is 1 GiB).
ROWS = [(op, b, t) for op in ("aft_simple", "aft_local_32") for b, t in ((8, 2048), (1, 16384))]
ROWS += [("aft_full", 8, 2048)]
QUICK_ROWS = (("aft_simple", 2, 64),)
PEER = "peer_scan_simple"


def _worker(root: str, op: str, batch: int, t_len: int, d: int, repeats: int, min_seconds: float):
  """One row, in this process: aft_jax from ``root``, the benchmark code from this tree."""
  sys.path.insert(0, os.path.abspath(root))
  import aft_jax  # noqa: F401 (first: from root)

  sys.path.insert(0, HERE)
  import jax.numpy as jnp

  from benchmarks import bench_ops, common

  fn, extra, _, _ = bench_ops.op_table(7, impl="xla")[op]
  args, ct = bench_ops.make_inputs(batch, t_len, d, extra, dtype=jnp.float32)
  m = common.measure(bench_ops.fwd_bwd(fn), args + (ct,), repeats=repeats, min_seconds=min_seconds)
  return {"aft_jax": os.path.dirname(aft_jax.__file__), **m}


def _run_row(root, op, batch, t_len, a) -> dict:
  """``_worker`` in a subprocess (its record, or the error it ended with)."""
  from benchmarks import common

  args = ["--worker", root, "--op", op, "--batch", batch, "--t", t_len, "--d", a.d]
  args += ["--repeats", a.repeats, "--min_seconds", a.min_seconds]
  env = dict(os.environ, PYTHONPATH=HERE)
  rec = common.child("benchmarks.before_after", args, cwd=HERE, env=env)
  return rec if rec.get("status") == common.ERROR else {"status": "ok", **rec}


def _table(records, trees) -> str:
  """Markdown: per row, each tree's time and temp memory, their ratio, the peer's."""
  from benchmarks import common

  before, after = trees
  head = ("op, batch, T", "before", "after", "after / before", "strong scan", "scan / after",
          "temp before / after / scan")  # fmt: skip
  lines = common.table(head, [], "l" + "r" * 6)
  get = lambda rec, f: rec.get(f) if rec.get("status") == "ok" else None
  for r in records:
    b, t = r[before], r[after]
    p = r.get(PEER, {}) if r["op"] == "aft_simple" else {}
    ratio = lambda x, y: "-" if x is None or y is None else f"{x / y:.2f}x"
    tb, ta, tp = (get(x, "time_s") for x in (b, t, p))
    mem = " / ".join(common.fmt_bytes(get(x, "temp_bytes")) for x in (b, t, p))
    lines.append(
      f"| {r['op']}, {r['batch']}, {r['T']} | {common.fmt_time(tb)} | {common.fmt_time(ta)} "
      f"| {ratio(ta, tb)} | {common.fmt_time(tp)} | {ratio(tp, ta)} | {mem} |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None):
  # Nothing from aft_jax or benchmarks.common before a worker has put its tree first.
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="benchmarks/results/before_after")
  p.add_argument("--quick", action="store_true", help="one tiny row, for tests")
  p.add_argument("--before", help="the other source tree (e.g. a git worktree of a commit)")
  p.add_argument("--after", default=HERE, help="default: this tree")
  p.add_argument("--d", type=int, default=512)
  for flag, kind in (("--worker", str), ("--op", str), ("--batch", int), ("--t", int)):
    p.add_argument(flag, type=kind, help=argparse.SUPPRESS)  # a worker's row
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--min_seconds", type=float, default=1.0)
  a = p.parse_args(argv)
  if a.worker:
    rec = _worker(a.worker, a.op, a.batch, a.t, a.d, a.repeats, a.min_seconds)
    from benchmarks import common

    return common.emit(rec)
  if not a.before:
    p.error("--before is required")
  from benchmarks import common

  rows = QUICK_ROWS if a.quick else ROWS
  if a.quick:
    a.d, a.repeats, a.min_seconds = 32, 2, 0.0
  trees = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after)}
  info = dict(common.machine_info("python -m benchmarks.before_after", argv), trees=trees, d=a.d)

  def run():
    records, peers = [], {}
    for op, batch, t_len in rows:
      rec = {"op": op, "batch": batch, "T": t_len, "d": a.d}
      for name, root in trees.items():
        rec[name] = _run_row(root, op, batch, t_len, a)
        print(op, batch, t_len, name, common.fmt_time(rec[name].get("time_s")), flush=True)
      if (batch, t_len) not in peers:
        peers[batch, t_len] = _run_row(trees["after"], PEER, batch, t_len, a)
      rec[PEER] = peers[batch, t_len]
      records.append(rec)
    return records

  records = common.timed_run(info, run)
  result = {"machine": info, "records": records}
  md = _table(records, list(trees))
  common.write_outputs(a.out, "before_after", result, md, partial=False)


if __name__ == "__main__":
  main()
