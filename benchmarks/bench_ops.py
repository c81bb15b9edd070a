"""The mixing ops against softmax attention: time, FLOPs and compiled memory per T, forward and
forward+backward (docs/benchmarks.md; the tables in benchmarks/RESULTS.md, "Ops").

    python -m benchmarks.bench_ops --out benchmarks/results   # full sweep
    python -m benchmarks.bench_ops --quick --out /tmp/bench   # < 1 minute on CPU
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax import ops
from aft_jax.ops import decay
from benchmarks import common

HEADS = 8
MODES = ("fwd", "fwd_bwd")
FWD_ONLY = ("cumsum", "aft_simple_steps", "aft_decay_steps")  # no backward pass timed
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


def _softmax_dpa(q, k, v, implementation=None):
  b, t, d = q.shape
  split = lambda x: x.reshape(b, t, HEADS, d // HEADS)
  out = jax.nn.dot_product_attention(*map(split, (q, k, v)), is_causal=True,
                                     implementation=implementation)  # fmt: skip
  return out.reshape(b, t, d)


def _conv1d(q, k, v, kernel, impl="auto"):  # one key per head (its first channel), as AFT-conv
  b, t, d = q.shape
  split = lambda x: x.reshape(b, t, HEADS, d // HEADS)
  out = ops.aft_conv1d(split(q), split(k)[..., 0], split(v), kernel, causal=True, impl=impl)
  return out.reshape(b, t, d)


def _per_head(w, d):  # w [2, HEADS] -> aft_decay's decay (>= 0) and bonus [D], one per head
  return jnp.repeat(jnp.abs(w[0]), d // HEADS), jnp.repeat(w[1], d // HEADS)


def _decay(q, k, v, w):
  return ops.aft_decay(q, k, v, *_per_head(w, q.shape[-1]), impl="xla")  # its only impl


def _steps(step):
  """T one-token steps (``step(state, q_t, k_t, v_t, *params)``) in a ``lax.scan``: the decode
  loop's cost per token, [B, T, D] -> [B, T, D]."""

  def run(q, k, v, *params):
    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v))
    body = lambda s, x: step(s, *x, *params)[::-1]
    return jnp.swapaxes(jax.lax.scan(body, ops.aft_simple_init(xs[0].shape[1:]), xs)[1], 0, 1)

  return run


def _dense_aft(q, k, v, w, window: int):
  """Causal AFT-local/full as the PyTorch implementations write it: num = exp(w) @ (exp(k) v),
  den = exp(w) @ exp(k), dense [T, T] (one shift per row of w and channel of k: not exact)."""
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
  """Causal AFT-simple as a JAX user would write it (as JAX ports of RWKV write WKV): a
  vmapped ``lax.scan`` over T carrying ``(max, num, den)``; exact, several times slower."""

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
  """name -> (fn(q, k, v[, extra]), extra-shape(T) or None, cost class, description); ``impl``
  for the AFT ops; ``peer_*`` rows are other projects' formulations."""
  tt = lambda t: (t, t)
  local = lambda s: lambda q, k, v, w: ops.aft_local(q, k, v, w, window=s, causal=True, impl=impl)
  dense = lambda s: lambda q, k, v, w: _dense_aft(q, k, v, w, s or q.shape[-2])
  return {
    "aft_full": (lambda q, k, v, w: ops.aft_full(q, k, v, w, causal=True, impl=impl), tt,
                 "quadratic", "causal AFT-full, w [T, T]"),
    "aft_local_32": (local(32), tt, "linear", "causal AFT-local, s = 32"),
    "aft_local_128": (local(128), tt, "linear", "causal AFT-local, s = 128"),
    "aft_simple": (lambda q, k, v: ops.aft_simple(q, k, v, causal=True, impl=impl), None,
                   "linear", "causal AFT-simple"),
    "aft_conv1d": (functools.partial(_conv1d, impl=impl), lambda t: (HEADS, conv_kernel),
                   "linear", f"causal AFT-conv1d, {HEADS} heads, kernel {conv_kernel}"),
    "aft_decay": (_decay, lambda t: (2, HEADS), "linear",
                  f"causal AFT with a learned decay and bonus per head, chunk {decay.CHUNK}"),
    "aft_simple_steps": (_steps(ops.aft_simple_step), None, "linear",
                         "T one-token aft_simple_step calls in a lax.scan (forward only)"),
    "aft_decay_steps": (lambda q, k, v, w: _steps(ops.aft_decay_step)(q, k, v, *_per_head(
      w, q.shape[-1])), lambda t: (2, HEADS), "linear", "the same for aft_decay_step"),
    "peer_scan_simple": (scan_simple, None, "linear", "peer: causal AFT-simple as a lax.scan "
                         "carrying (max, num, den), vmapped over B"),
    "peer_dense_local_32": (dense(32), tt, "quadratic",
                            "peer: causal AFT-local, s = 32, dense T x T exp(w) products"),
    "peer_dense_full": (dense(None), tt, "quadratic",
                        "peer: causal AFT-full, dense T x T exp(w) products"),
    "softmax_einsum": (_softmax_einsum, None, "quadratic",
                       f"causal softmax attention, einsum, {HEADS} heads"),
    "softmax_dpa": (_softmax_dpa, None, "quadratic",
                    f"causal jax.nn.dot_product_attention, {HEADS} heads"),
    "cumsum": (lambda q, k, v: jnp.cumsum(k, axis=-2), None, "linear",
               "floor: one jnp.cumsum over [B, T, D]"),
  }  # fmt: skip


def make_inputs(batch, t_len, d, extra_shape, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype)
  args = [arr(batch, t_len, d) for _ in range(3)]
  if extra_shape is not None:
    args.append(arr(*extra_shape(t_len)) * 0.1)
  return tuple(args), arr(batch, t_len, d)


def fwd_bwd(fn):
  """All input gradients of sum(fn(*args) * cotangent), as a function of (*args, cotangent)."""
  loss = lambda *a: jnp.sum(fn(*a[:-1]) * a[-1])
  return lambda *a: jax.grad(loss, argnums=tuple(range(len(a) - 1)))(*a)


def run(
  sizes, *, batch, d, conv_kernel, names, repeats, max_call_s, max_temp_gib, min_seconds=1.0,
  log=print, table=None, dtype=jnp.float32,
):  # fmt: skip
  """Records of ``names`` at ``sizes``: a size over ``max_call_s`` (extrapolated) or
  ``max_temp_gib`` skipped; after an error the larger ones skipped."""
  table = table or op_table(conv_kernel)
  records = []
  for name in names:
    fn, extra, cost_class, _ = table[name]
    for mode in MODES[: 1 if name in FWD_ONLY else 2]:

      def measure_one(t_len):
        args, ct = make_inputs(batch, t_len, d, extra, dtype=dtype)
        f, args = (fn, args) if mode == "fwd" else (fwd_bwd(fn), args + (ct,))
        compiled, compile_s = common.compile_fn(f, args)  # the memory checked before a run
        temp = common.compiled_stats(compiled)["temp_bytes"]
        if temp is not None and temp > max_temp_gib * (1 << 30):
          return f"compiled temp memory {common.fmt_bytes(temp)} > --max_temp_gib {max_temp_gib}"
        kw = dict(compiled=compiled, compile_s=compile_s, budget_s=max_call_s)
        return common.measure(f, args, repeats=repeats, min_seconds=min_seconds, **kw)

      base = {"op": name, "mode": mode, "batch": batch, "d": d}
      records += common.sweep(sizes, base, cost_class, max_call_s, "call", measure_one, log)
  return records


def checks(records):
  """The ops' targets (RESULTS.md, "Targets for the ops"), where their sizes were measured."""
  get = lambda op, mode, t: common.find(records, op=op, mode=mode, T=t)

  def ratio(a, b, field):
    return a[field] / b[field] if a and b and a.get(field) and b.get(field) else None

  out = []
  ref4 = get("softmax_einsum", "fwd_bwd", 4096)
  for op, max_time in (("aft_simple", 0.02), ("aft_local_128", 0.05)):
    r4, r1 = get(op, "fwd_bwd", 4096), get(op, "fwd_bwd", 1024)
    out += [
      common.check(f"{op} fwd+bwd time / softmax_einsum at T=4096", ratio(r4, ref4, "time_s"),
                   f"<= {max_time}", lambda x: x <= max_time),
      common.check(f"{op} fwd+bwd temp memory / softmax_einsum at T=4096",
                   ratio(r4, ref4, "temp_bytes"), "<= 0.05", lambda x: x <= 0.05),
      common.check(f"{op} fwd+bwd time growth T=1024 -> 4096", ratio(r4, r1, "time_s"),
                   "<= ~5", lambda x: x <= 5.0),
    ]  # fmt: skip
  fr = ratio(get("aft_simple", "fwd", 4096), get("cumsum", "fwd", 4096), "time_s")
  floor = common.check("aft_simple fwd time / cumsum floor at T=4096", fr, "<= 2", lambda x: x <= 2)
  # the decay op's targets: its fwd+bwd and its one-token steps against aft_simple's
  dr = ratio(get("aft_decay", "fwd_bwd", 4096), get("aft_simple", "fwd_bwd", 4096), "time_s")
  sr = ratio(get("aft_decay_steps", "fwd", 4096), get("aft_simple_steps", "fwd", 4096), "time_s")
  return out + [
    floor,
    common.check("aft_decay fwd+bwd time / aft_simple at T=4096", dr, "<= 1.5", lambda x: x <= 1.5),
    common.check("aft_decay_steps time / aft_simple_steps at T=4096", sr, "<= 1.2",
                 lambda x: x <= 1.2),
  ]  # fmt: skip


def markdown(records, sizes, names, info):
  lines = []
  by = {(r["op"], r["mode"], r["T"]): r for r in records}
  for mode, title in (("fwd_bwd", "forward+backward"), ("fwd", "forward")):
    for field, label, fmt in (
      ("time_s", "median time", common.fmt_time),
      ("temp_bytes", "XLA temp memory", common.fmt_bytes),
      ("flops", "FLOPs (loops counted per trip)", common.fmt_flops),
    ):
      lines.append(f"\n**{title}, {label}** (batch {info['batch']}, d {info['d']}, causal)\n")
      rows = []
      for name in (n for n in names if mode == "fwd" or n not in FWD_ONLY):
        cells = [by.get((name, mode, t), {}) for t in sizes]  # else "skipped" or "error"
        rows.append([name] + [fmt(r[field]) if r.get("status") == "ok" else r.get("status", "")
                              for r in cells])  # fmt: skip
      lines += common.table(["op", *(f"T={t}" for t in sizes)], rows, "l" + "r" * len(sizes))
  return "\n".join(lines) + "\n"


def plot(records, names, path):
  def draw(plt, axes):
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
          mib = [max(r["temp_bytes"], 1) / 2**20 for r in rs]
          axes[1].plot(ts, mib, style, marker="o", color=color, label=name)

  ylabels = ("median time (s)", "XLA temp memory, fwd+bwd (MiB)")
  common.log_log_figure(2, (12, 4.5), ylabels, path, draw, legend_fontsize=7)


def main(argv=None):
  p = common.parser(__doc__, "tiny sizes, for tests (< 1 min on CPU)")
  p.add_argument("--sizes", type=int, nargs="+", default=None)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--d", type=int, default=512)
  p.add_argument("--conv_kernel", type=int, default=7)
  p.add_argument("--ops", nargs="+", default=None, help="subset of ops (default: all)")
  common.add_timing_args(p, "calls")
  help = "skip a size when its extrapolated time per call exceeds this"
  p.add_argument("--max_call_s", type=float, default=None, help=help)
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
  info = common.machine_info("python -m benchmarks.bench_ops", argv)
  info.update(batch=a.batch, d=a.d, heads=HEADS, conv_kernel=a.conv_kernel, sizes=sizes)
  info.update(quick=a.quick, max_call_s=max_call_s, max_temp_gib=a.max_temp_gib)
  kw = dict(batch=a.batch, d=a.d, conv_kernel=a.conv_kernel, names=names, repeats=a.repeats)
  kw.update(min_seconds=a.min_seconds, max_call_s=max_call_s, max_temp_gib=a.max_temp_gib)
  records = common.timed_run(info, lambda: run(sizes, **kw))
  ops_run = {n: table[n][3] for n in names}
  result = dict(machine=info, ops=ops_run, records=records, checks=checks(records))
  md = markdown(records, sizes, names, info)
  md += "\n" + "\n".join(common.check_line(c) for c in result["checks"]) + "\n"
  common.write_outputs(a.out, "bench_ops", result, md, lambda path: plot(records, names, path))


if __name__ == "__main__":
  main()
