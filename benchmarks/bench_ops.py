"""Benchmark the mixing ops: AFT-full/local/simple/conv1d against softmax attention.

For each op and sequence length T: forward and forward+backward (gradient of
``sum(out * cotangent)`` with respect to every input, the bias ``w`` / kernel included), causal,
``[B, T, D]`` float32 inputs. Records the median wall time after compilation, the FLOP count
(``flops.count``: loops counted once per trip; XLA's own count, which counts a loop body
once, is kept as ``xla_flops``), the compiled program's temp memory and its whole footprint
(``program_bytes``: arguments + outputs + temp) and (on accelerators) the process's peak device
memory so far. ``cumsum`` is one ``jnp.cumsum`` over the same ``[B, T, D]`` tensor: the
floor for causal AFT-simple.

    python -m benchmarks.bench_ops --out benchmarks/results           # full sweep
    python -m benchmarks.bench_ops --quick --out /tmp/bench           # < 1 minute on CPU

Sizes whose estimated time per call (extrapolated from the previous size) exceeds
``--max_call_s`` or whose compiled temp memory exceeds ``--max_temp_gib`` are recorded as
``{"status": "skipped", "reason": ...}``; a size that fails to compile or run (out of memory,
a kernel that does not compile) as ``{"status": "error", "reason": ...}``, and the larger sizes
of that op and mode as skipped.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax import ops
from benchmarks import common

HEADS = 8
MODES = ("fwd", "fwd_bwd")
FIELDS = ("time_s", "flops", "xla_flops", "temp_bytes", "program_bytes", "compile_s", "repeats")


def _softmax_einsum(q, k, v):
  """Causal multi-head softmax attention written out: [B, T, D] -> [B, T, D]."""
  b, t, d = q.shape
  split = lambda x: x.reshape(b, t, HEADS, d // HEADS)
  q, k, v = split(q), split(k), split(v)
  logits = jnp.einsum("bthc,bshc->bhts", q, k) / math.sqrt(d // HEADS)
  mask = jnp.tril(jnp.ones((t, t), bool))
  logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhts,bshc->bthc", probs, v).reshape(b, t, d)


def _softmax_dpa(q, k, v):
  b, t, d = q.shape
  split = lambda x: x.reshape(b, t, HEADS, d // HEADS)
  out = jax.nn.dot_product_attention(split(q), split(k), split(v), is_causal=True)
  return out.reshape(b, t, d)


def _conv1d(q, k, v, kernel, impl="auto"):
  b, t, d = q.shape
  split = lambda x: x.reshape(b, t, HEADS, d // HEADS)
  # One key per head (the head's first channel), as in AFT-conv.
  out = ops.aft_conv1d(split(q), split(k)[..., 0], split(v), kernel, causal=True, impl=impl)
  return out.reshape(b, t, d)


def _dense_aft(q, k, v, w, window: int):
  """Causal AFT-local/full the way the PyTorch implementations write it: dense [T, T] exp(w)
  matrix products, num = exp(w) @ (exp(k) v), den = exp(w) @ exp(k) (one shift per row of w
  and per channel of k, so not exact for large logits)."""
  t = q.shape[-2]
  idx = jnp.arange(t)
  w = jnp.where(jnp.abs(idx[:, None] - idx[None, :]) < window, w, 0.0)
  w = jnp.where(idx[:, None] >= idx[None, :], w, -jnp.inf)
  ew = jnp.exp(w - jnp.max(w, axis=1, keepdims=True))
  ek = jnp.exp(k - jnp.max(k, axis=-2, keepdims=True))
  num = jnp.einsum("ts,bsd->btd", ew, ek * v)
  den = jnp.einsum("ts,bsd->btd", ew, ek)
  return jax.nn.sigmoid(q) * num / den


def scan_simple(q, k, v):
  """Causal AFT-simple as the strongest ten-line recurrence a JAX user would write (how JAX
  ports of RWKV write WKV): ``jax.lax.scan`` over T carrying a ``(max, num, den)`` tuple of
  ``[D]`` arrays, vmapped over the batch; q, k, v ``[B, T, D]``. Exact in any float dtype.
  (Stacking num and den into one ``[2, B, D]`` array every step is several times slower.)"""

  def one_row(k, v):  # [T, D]
    def step(carry, kv):
      m0, num0, den0 = carry
      k1, v1 = kv
      m = jnp.maximum(m0, k1)
      s0, s1 = jnp.exp(m0 - m), jnp.exp(k1 - m)
      num, den = num0 * s0 + v1 * s1, den0 * s0 + s1
      return (m, num, den), num / den

    zero = jnp.zeros(k.shape[1:], k.dtype)
    return jax.lax.scan(step, (zero - jnp.inf, zero, zero), (k, v))[1]

  return jax.nn.sigmoid(q) * jax.vmap(one_row)(k, v)


def op_table(conv_kernel: int, impl: str = "auto"):
  """name -> (fn(q, k, v, extra), extra-shape(T) or None, cost class, description).

  ``impl`` is passed to the AFT ops; ``peer_*`` rows are other projects' formulations."""
  return {
    "aft_full": (
      lambda q, k, v, w: ops.aft_full(q, k, v, w, causal=True, impl=impl),
      lambda t: (t, t),
      "quadratic",
      "causal AFT-full, w [T, T]",
    ),
    "aft_local_32": (
      lambda q, k, v, w: ops.aft_local(q, k, v, w, window=32, causal=True, impl=impl),
      lambda t: (t, t),
      "linear",
      "causal AFT-local, s = 32",
    ),
    "aft_local_128": (
      lambda q, k, v, w: ops.aft_local(q, k, v, w, window=128, causal=True, impl=impl),
      lambda t: (t, t),
      "linear",
      "causal AFT-local, s = 128",
    ),
    "aft_simple": (
      lambda q, k, v: ops.aft_simple(q, k, v, causal=True, impl=impl),
      None,
      "linear",
      "causal AFT-simple",
    ),
    "aft_conv1d": (
      functools.partial(_conv1d, impl=impl),
      lambda t: (HEADS, conv_kernel),
      "linear",
      f"causal AFT-conv1d, {HEADS} heads, kernel {conv_kernel}",
    ),
    "peer_scan_simple": (
      scan_simple,
      None,
      "linear",
      "peer: causal AFT-simple as a lax.scan carrying (max, num, den), vmapped over B",
    ),
    "peer_dense_local_32": (
      lambda q, k, v, w: _dense_aft(q, k, v, w, 32),
      lambda t: (t, t),
      "quadratic",
      "peer: causal AFT-local, s = 32, dense T x T exp(w) products",
    ),
    "peer_dense_full": (
      lambda q, k, v, w: _dense_aft(q, k, v, w, q.shape[-2]),
      lambda t: (t, t),
      "quadratic",
      "peer: causal AFT-full, dense T x T exp(w) products",
    ),
    "softmax_einsum": (
      lambda q, k, v: _softmax_einsum(q, k, v),
      None,
      "quadratic",
      f"causal softmax attention, einsum, {HEADS} heads",
    ),
    "softmax_dpa": (
      lambda q, k, v: _softmax_dpa(q, k, v),
      None,
      "quadratic",
      f"causal jax.nn.dot_product_attention, {HEADS} heads",
    ),
    "cumsum": (
      lambda q, k, v: jnp.cumsum(k, axis=-2),
      None,
      "linear",
      "floor: one jnp.cumsum over [B, T, D]",
    ),
  }


def make_inputs(batch, t_len, d, extra_shape, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype)
  args = [arr(batch, t_len, d) for _ in range(3)]
  if extra_shape is not None:
    args.append(arr(*extra_shape(t_len)) * 0.1)
  cotangent = arr(batch, t_len, d)
  return tuple(args), cotangent


def fwd_bwd(fn):
  """All input gradients of sum(fn(*args) * cotangent)."""

  def loss(*args_and_ct):
    *args, ct = args_and_ct
    return jnp.sum(fn(*args) * ct)

  def grads(*args_and_ct):
    return jax.grad(loss, argnums=tuple(range(len(args_and_ct) - 1)))(*args_and_ct)

  return grads


def run(
  sizes,
  *,
  batch,
  d,
  conv_kernel,
  names,
  repeats,
  max_call_s,
  max_temp_gib,
  min_seconds=1.0,
  log=print,
  table=None,
  dtype=jnp.float32,
):
  """Measure ``names`` (rows of ``table``, default ``op_table(conv_kernel)``) at ``sizes``
  with ``dtype`` inputs; returns the records."""
  table = table or op_table(conv_kernel)
  records = []
  for name in names:
    fn, extra, cost_class, _ = table[name]
    for mode in MODES:
      if name == "cumsum" and mode == "fwd_bwd":
        continue
      last = None  # (T, seconds) of the last measured size
      stop_reason = None
      for t_len in sizes:
        rec = {"op": name, "mode": mode, "T": t_len, "batch": batch, "d": d}
        if stop_reason is None:
          stop_reason = common.budget_exceeded(
            last, t_len, cost_class, max_call_s, "call", "--max_call_s"
          )
        if stop_reason is not None:
          rec.update(common.skipped(stop_reason))
          records.append(rec)
          log(f"{name:15s} {mode:8s} T={t_len:6d} skipped: {stop_reason}")
          continue
        try:
          m = _measure_size(
            fn, extra, mode, batch, t_len, d, dtype, max_temp_gib, repeats, min_seconds, max_call_s
          )
        except Exception as e:  # pylint: disable=broad-except  # one row, not the run
          rec.update(common.error(e))
          records.append(rec)
          log(f"{name:15s} {mode:8s} T={t_len:6d} error: {rec['reason']}")
          # A longer sequence would fail the same way or worse (memory): stop growing T.
          stop_reason = f"error at T={t_len}"
          continue
        if isinstance(m, str):  # over the memory limit
          stop_reason = m
          rec.update(common.skipped(stop_reason))
          records.append(rec)
          log(f"{name:15s} {mode:8s} T={t_len:6d} skipped: {stop_reason}")
          continue
        rec.update(status="ok", **m)
        records.append(rec)
        last = (t_len, m["time_s"])
        log(
          f"{name:15s} {mode:8s} T={t_len:6d} {common.fmt_time(m['time_s']):>10s} "
          f"temp {common.fmt_bytes(m['temp_bytes']):>10s} flops "
          f"{common.fmt_flops(m['flops']):>9s} compile {m['compile_s']:.1f}s"
        )
  return records


def _measure_size(
  fn, extra, mode, batch, t_len, d, dtype, max_temp_gib, repeats, min_seconds, max_call_s
):
  """``common.measure`` of one op, mode and size, or why it was skipped (a string: its
  compiled temp memory is over ``max_temp_gib``). Compile and run errors propagate."""
  args, ct = make_inputs(batch, t_len, d, extra, dtype=dtype)
  f = fn if mode == "fwd" else fwd_bwd(fn)
  call_args = args if mode == "fwd" else args + (ct,)
  # Check memory before running: compile only.
  compiled, compile_s = common.compile_fn(f, call_args)
  temp = common.compiled_stats(compiled)["temp_bytes"]
  if temp is not None and temp > max_temp_gib * (1 << 30):
    return f"compiled temp memory {common.fmt_bytes(temp)} > --max_temp_gib {max_temp_gib}"
  return common.measure_within(
    f,
    call_args,
    compiled,
    compile_s,
    repeats=repeats,
    min_seconds=min_seconds,
    budget_s=max_call_s,
  )


def _get(records, op, mode, t_len):
  for r in records:
    if r["op"] == op and r["mode"] == mode and r["T"] == t_len and r.get("status") == "ok":
      return r
  return None


def checks(records):
  """The ops' targets (RESULTS.md, "Targets for the ops"), where their sizes were measured."""
  out = []

  def ratio(a, b, field):
    if a is None or b is None or not a.get(field) or not b.get(field):
      return None
    return a[field] / b[field]

  ref4 = _get(records, "softmax_einsum", "fwd_bwd", 4096)
  for op, max_time in (("aft_simple", 0.02), ("aft_local_128", 0.05)):
    r4 = _get(records, op, "fwd_bwd", 4096)
    r1 = _get(records, op, "fwd_bwd", 1024)
    tr, mr, gr = ratio(r4, ref4, "time_s"), ratio(r4, ref4, "temp_bytes"), ratio(r4, r1, "time_s")
    out.append(
      {
        "check": f"{op} fwd+bwd time / softmax_einsum at T=4096",
        "value": tr,
        "target": f"<= {max_time}",
        "holds": None if tr is None else tr <= max_time,
      }
    )
    out.append(
      {
        "check": f"{op} fwd+bwd temp memory / softmax_einsum at T=4096",
        "value": mr,
        "target": "<= 0.05",
        "holds": None if mr is None else mr <= 0.05,
      }
    )
    out.append(
      {
        "check": f"{op} fwd+bwd time growth T=1024 -> 4096",
        "value": gr,
        "target": "<= ~5",
        "holds": None if gr is None else gr <= 5.0,
      }
    )
  fr = ratio(
    _get(records, "aft_simple", "fwd", 4096), _get(records, "cumsum", "fwd", 4096), "time_s"
  )
  out.append(
    {
      "check": "aft_simple fwd time / cumsum floor at T=4096",
      "value": fr,
      "target": "<= 2",
      "holds": None if fr is None else fr <= 2.0,
    }
  )
  return out


def check_line(c):
  value = "-" if c["value"] is None else f"{c['value']:.3g}"
  verdict = "n/a" if c["holds"] is None else ("holds" if c["holds"] else "FAILS")
  return f"- {c['check']}: {value} (target {c['target']}: {verdict})"


def markdown(records, sizes, names, info):
  lines = []
  for mode, title in (("fwd_bwd", "forward+backward"), ("fwd", "forward")):
    for field, label, fmt in (
      ("time_s", "median time", common.fmt_time),
      ("temp_bytes", "XLA temp memory", common.fmt_bytes),
      ("flops", "FLOPs (loops counted per trip)", common.fmt_flops),
    ):
      lines.append(f"\n**{title}, {label}** (batch {info['batch']}, d {info['d']}, causal)\n")
      lines.append("| op | " + " | ".join(f"T={t}" for t in sizes) + " |")
      lines.append("|---|" + "---:|" * len(sizes))
      for name in names:
        if name == "cumsum" and mode == "fwd_bwd":
          continue
        cells = []
        for t_len in sizes:
          r = [x for x in records if x["op"] == name and x["mode"] == mode and x["T"] == t_len]
          if not r:
            cells.append("")
          elif r[0]["status"] != "ok":
            cells.append(r[0]["status"])  # "skipped" or "error" (the JSON says why)
          else:
            cells.append(fmt(r[0][field]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def plot(records, names, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for i, name in enumerate(names):
    color = plt.get_cmap("tab10")(i % 10)
    for mode, style in (("fwd_bwd", "-"), ("fwd", ":")):
      rs = [r for r in records if r["op"] == name and r["mode"] == mode and r["status"] == "ok"]
      if not rs:
        continue
      ts = [r["T"] for r in rs]
      label = f"{name} ({'fwd+bwd' if mode == 'fwd_bwd' else 'fwd'})"
      axes[0].plot(ts, [r["time_s"] for r in rs], style, marker="o", color=color, label=label)
      if mode == "fwd_bwd":
        axes[1].plot(
          ts,
          [max(r["temp_bytes"], 1) / 2**20 for r in rs],
          style,
          marker="o",
          color=color,
          label=name,
        )
  ylabels = ("median time (s)", "XLA temp memory, fwd+bwd (MiB)")
  common.finish_log_log_figure(fig, axes, ylabels, path, legend_fontsize=7)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="benchmarks/results")
  p.add_argument("--quick", action="store_true", help="tiny sizes, for tests (< 1 min on CPU)")
  p.add_argument("--sizes", type=int, nargs="+", default=None)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--d", type=int, default=512)
  p.add_argument("--conv_kernel", type=int, default=7)
  p.add_argument("--ops", nargs="+", default=None, help="subset of ops (default: all)")
  common.add_timing_args(p, "calls")
  p.add_argument(
    "--max_call_s",
    type=float,
    default=None,
    help="skip a size when its extrapolated time per call exceeds this",
  )
  p.add_argument("--max_temp_gib", type=float, default=8.0)
  a = p.parse_args(argv)
  on_cpu = jax.devices()[0].platform == "cpu"
  if a.quick:
    sizes = a.sizes or [64, 128]
    a.d, a.repeats, a.min_seconds = min(a.d, 64), 2, 0.0
    max_call_s = a.max_call_s or 1.0
  else:
    sizes = a.sizes or [256, 512, 1024, 2048, 4096, 8192, 16384]
    max_call_s = a.max_call_s or (15.0 if on_cpu else 2.0)
  table = op_table(a.conv_kernel)
  names = a.ops or list(table)
  info = common.machine_info()
  info.update(
    batch=a.batch,
    d=a.d,
    heads=HEADS,
    conv_kernel=a.conv_kernel,
    sizes=sizes,
    quick=a.quick,
    max_call_s=max_call_s,
    max_temp_gib=a.max_temp_gib,
    command=" ".join(["python -m benchmarks.bench_ops"] + (argv or sys.argv[1:])),
  )
  records = common.timed_run(
    info,
    lambda: run(
      sizes,
      batch=a.batch,
      d=a.d,
      conv_kernel=a.conv_kernel,
      names=names,
      repeats=a.repeats,
      min_seconds=a.min_seconds,
      max_call_s=max_call_s,
      max_temp_gib=a.max_temp_gib,
    ),
  )
  result = {
    "machine": info,
    "ops": {n: table[n][3] for n in names},
    "records": records,
    "checks": checks(records),
  }
  md = markdown(records, sizes, names, info)
  md += "\n" + "\n".join(check_line(c) for c in result["checks"]) + "\n"
  common.write_outputs(a.out, "bench_ops", result, md, lambda path: plot(records, names, path))


if __name__ == "__main__":
  main()
