"""One command that measures an accelerator: the kernels against XLA, the ops (each kernel form
on GPUs) against cuDNN attention, and LM train steps (docs/benchmarks.md; RESULTS.md, "GPU /
TPU"). Rewrites its json and md after each row ("complete": false until the end).

    python -u -m benchmarks.accelerator_check --out benchmarks/results/<device>  # < 8 min, 1 GPU
    python -u -m benchmarks.accelerator_check --max_minutes 7.5 --out "$OUT/h200"  # a lent device
    python -m benchmarks.accelerator_check --quick --out /tmp/check             # CPU, tiny (tests)
"""

from __future__ import annotations

import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax.model import MIXINGS, ModelConfig
from benchmarks import bench_model, bench_ops, common, kernel_form

# Ops with a Pallas kernel (on TPUs only AFT-simple's): rows measured with both implementations.
KERNEL_OPS, TPU_KERNEL_OPS = ("aft_simple", "aft_local_32", "aft_local_128"), ("aft_simple",)
XLA_OPS = ("aft_simple", "aft_local_32", "aft_local_128", "aft_full", "aft_conv1d")
BASELINES = ("softmax_dpa", "peer_scan_simple", "cumsum")
# The GPU kernels' two forms (ops/pallas/triton.py), each timed beside impl="pallas"'s choice.
KERNEL_FORMS = ("sequential", "chunked")
# Arrays of [B, T, D] a row must read or write at least once: q, k, v, out; + ct, dq, dk, dv.
MIN_ARRAYS = {"fwd": 4, "fwd_bwd": 7}
# The WikiText-103 small recipe's model (configs/wikitext103.py), word-level vocabulary.
RECIPE = dict(vocab_size=267735, num_layers=16, d_model=128, num_heads=8, mlp_dim=2048)
RECIPE.update(max_len=256, adaptive_cutoffs=(20000, 40000, 200000))
_cudnn = functools.partial(bench_ops._softmax_dpa, implementation="cudnn")


def op_rows(kernel_impl: str | None, platform: str):
  """name -> bench_ops table row: the xla rows, the kernel rows (and forms), the baselines."""
  xla = bench_ops.op_table(7, "xla")
  rows = {f"{n}/xla": xla[n] for n in XLA_OPS}
  if kernel_impl is not None:
    kern = bench_ops.op_table(7, kernel_impl)
    names = TPU_KERNEL_OPS if platform == "tpu" else KERNEL_OPS
    rows.update({f"{n}/pallas": kern[n] for n in names})
    if platform == "gpu":
      for n, form in itertools.product(names, KERNEL_FORMS):
        fn, extra, cost, what = kern[n]
        fn = kernel_form.forced(form)(fn)  # each call traced in that form
        rows[f"{n}/pallas[{form}]"] = (fn, extra, cost, f"{what}, {form} kernels")
  rows.update({n: xla[n] for n in BASELINES})
  if platform == "gpu":
    rows["softmax_cudnn"] = (_cudnn, None, "quadratic", "causal cuDNN flash attention")
  return rows


def kernel_impl_for(platform: str) -> str | None:
  """Compiled kernels on GPUs and TPUs (there AFT-simple's only), interpreted on CPU."""
  return {"gpu": "pallas", "tpu": "pallas", "cpu": "pallas_interpret"}.get(platform)


def add_bandwidth(records, dtype, peak_gbps, log=print):
  for r in records:
    if r.get("status") == "ok":
      n = r["batch"] * r["T"] * r["d"] * jnp.dtype(dtype).itemsize * MIN_ARRAYS[r["mode"]]
      r["min_bytes"] = float(n)
      r["achieved_gbps"] = n / r["time_s"] / 1e9
      r["fraction_of_peak_hbm"] = None if not peak_gbps else r["achieved_gbps"] / peak_gbps
      log(f"  {r['op']:20s} {r['mode']:8s} T={r['T']:6d} achieved {r['achieved_gbps']:8.1f} GB/s"
          f" (device peak {peak_gbps or '-'} GB/s)")  # fmt: skip


def kernel_checks(kernel_impl, quick: bool, log=print):
  """Pallas vs XLA (float32 from the same inputs) per kernel: max relative error of
  outputs and gradients, logits of std 1 and 40."""
  if kernel_impl is None:
    return []
  backend = jax.default_backend()
  t_len, d = (100, 128 if backend == "tpu" else 32) if quick else (1000, 512)  # TPU: tiles 128
  cases = [(jnp.float32, 1.0), (jnp.float32, 40.0), (jnp.bfloat16, 1.0), (jnp.bfloat16, 40.0)]
  names = TPU_KERNEL_OPS if backend == "tpu" else ("aft_simple", "aft_local_32")
  if quick:  # the code path, not the sweep (the tests check every kernel in interpret mode)
    cases, names = cases[1:3], ("aft_simple",)
  tables = {impl: bench_ops.op_table(7, impl) for impl in (kernel_impl, "xla")}
  rng = np.random.default_rng(0)
  f32 = lambda x: x.astype(jnp.float32)
  out = []
  forms = KERNEL_FORMS if backend == "gpu" else (None,)  # each GPU kernel form
  for name, form, (dtype, scale) in itertools.product(names, forms, cases):
    kernel = f"{name} causal" + ("" if form is None else f" [{form}]")
    q, k, v, ct = (rng.normal(size=(2, t_len, d)) for _ in range(4))
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k * scale, v))
    w = jnp.asarray(rng.normal(size=(t_len, t_len)) * scale, jnp.float32)
    extra = (w,) if tables["xla"][name][1] else ()  # AFT-local's w

    def run(impl, *args):
      fn = tables[impl][name][0]
      fn = fn if form is None else kernel_form.forced(form)(fn)
      loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct)
      return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=tuple(range(len(a))))(*a)))(*args)

    tol = 1e-4 if dtype == jnp.float32 else 2e-2  # bfloat16: results rounded to 8 bits
    rec = {"kernel": kernel, "dtype": jnp.dtype(dtype).name, "logit_std": scale, "tolerance": tol}
    try:  # a kernel that fails here is a finding; the other cases still run
      got, want = run(kernel_impl, q, k, v, *extra), run("xla", f32(q), f32(k), f32(v), *extra)
      errs = [
        float(jnp.max(jnp.abs(f32(g) - w))) / max(float(jnp.max(jnp.abs(w))), 1e-30)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))
      ]
      rec.update(status="ok", max_rel_error=max(errs), holds=max(errs) <= tol)
    except Exception as e:  # pylint: disable=broad-except
      rec.update(max_rel_error=None, holds=None, **common.error(e))
    out.append(rec)
    why = f" ({rec['reason']})" if rec["status"] == common.ERROR else ""
    log(f"kernel check {kernel} {rec['dtype']} std {scale:g}: holds {rec['holds']}{why}")
  return out


def model_rows(a, peak, deadline, log, on_row=lambda records: None):
  """Train steps per mixing at the LM size, then the recipe's model; ``on_row`` after each."""
  base = dict(dropout_rate=0.0, dtype=jnp.dtype(a.dtype), scan_layers=True)
  lm = dict(vocab_size=a.vocab, num_layers=a.layers, d_model=a.d_model, num_heads=a.heads,
            mlp_dim=4 * a.d_model, max_len=a.model_t, window=32, **base)  # fmt: skip
  recipe = dict(RECIPE, **base)
  if a.quick:
    recipe.update(vocab_size=300, num_layers=1, adaptive_cutoffs=(50, 100, 200), max_len=32)
  # The two rows the LM targets compare first, so that a time limit cuts the others.
  mixings = ("aft_local", "softmax")
  mixings += () if a.quick else tuple(m for m in MIXINGS if m not in mixings)
  # Softmax on a GPU is cuDNN flash attention (what a user would train there).
  soft = "cudnn" if jax.default_backend() == "gpu" else "auto"
  impl = lambda m: soft if m == "softmax" else "auto"
  cases = [(f"lm/{m}", ModelConfig(mixing=m, impl=impl(m), **lm), a.batch, a.model_t) for m in
           mixings]  # fmt: skip
  # The XLA forms of the kernels' layers too (the LM target takes the faster AFT-local-32).
  extra = [("aft_simple", "xla")] + ([("aft_local", "xla"), ("softmax", "xla")] * (soft == "cudnn"))
  for m, i in extra:
    cases.append((f"lm/{m}/{i}", ModelConfig(mixing=m, impl=i, **lm), a.batch, a.model_t))
  for m in ("aft_local",) if a.quick else ("aft_local", "softmax"):
    cfg = ModelConfig(mixing=m, impl=impl(m), **recipe)
    cases.append((f"wikitext103_small/{m}", cfg, a.recipe_batch, cfg.max_len))
  records = []
  for name, cfg, batch, t_len in cases:
    rec = dict(model=name, T=t_len, batch=batch, layers=cfg.num_layers, d=cfg.d_model)
    rec["impl"] = cfg.impl
    if time.time() > deadline:
      rec.update(common.skipped("--max_minutes reached"))
    else:
      try:
        args = (a.repeats, a.min_seconds, a.max_call_s, peak)
        rec.update(bench_model.measure_step(cfg.validate(), batch, t_len, *args))
      except Exception as e:  # pylint: disable=broad-except  # e.g. out of memory: say so
        rec.update(common.error(e))
    records.append(rec)
    log(f"{name:28s} {rec.get('status')} {common.fmt_time(rec.get('time_s'))}")
    on_row(records)
  return records


def target_checks(op_recs, model_recs):
  """The GPU targets (RESULTS.md, "GPU / TPU"), where the rows they need were measured."""
  out = []

  def check(what, num, den, field, target, holds):
    measured = num and den and None not in (num[field], den[field])
    out.append(common.check(what, num[field] / den[field] if measured else None, target, holds))
    if not measured:
      out[-1]["note"] = "not measured"

  op = lambda name, mode, t: common.find(op_recs, op=name, mode=mode, T=t)
  fastest = lambda rs: min((r for r in rs if r), key=lambda r: r["time_s"], default=None)
  cudnn = lambda t: op("softmax_cudnn", "fwd_bwd", t)
  check("softmax_cudnn / aft_simple/pallas fwd+bwd time, T=8192", cudnn(8192),
        op("aft_simple/pallas", "fwd_bwd", 8192), "time_s", ">= 3", lambda x: x >= 3)  # fmt: skip
  local = fastest(op(f"aft_local_32/{i}", "fwd_bwd", 4096) for i in ("pallas", "xla"))
  check("softmax_cudnn / aft_local_32 fwd+bwd time, T=4096", cudnn(4096), local, "time_s",
        ">= 1.5", lambda x: x >= 1.5)  # fmt: skip
  lm_local = fastest(common.find(model_recs, model=n) for n in ("lm/aft_local", "lm/aft_local/xla"))
  lm_soft = common.find(model_recs, model="lm/softmax")
  soft = f"softmax[{lm_soft['impl']}]" if lm_soft else "softmax"  # cudnn on GPUs
  local = "aft_local[xla]" if lm_local and lm_local["model"].endswith("/xla") else "aft_local"
  check(f"LM tokens/s {local} / {soft}", lm_local, lm_soft, "tokens_per_s", ">= 1.3",
        lambda x: x >= 1.3)  # fmt: skip
  # The step's whole footprint: the device's peak counter is a maximum over earlier rows too.
  check(f"LM program memory (params + optimizer state + batch + activations) {local} / {soft}",
        lm_local, lm_soft, "program_bytes", "<= 0.5", lambda x: x <= 0.5)  # fmt: skip
  ok_cumsum = [r["T"] for r in op_recs if r.get("op") == "cumsum" and r.get("status") == "ok"]
  t_max = max(ok_cumsum, default=None)
  simple = op("aft_simple/pallas", "fwd", t_max) or op("aft_simple/xla", "fwd", t_max)
  check(f"aft_simple fwd / cumsum time, T={t_max or 'largest measured'}", simple,
        op("cumsum", "fwd", t_max), "time_s", "<= 2", lambda x: x <= 2)  # fmt: skip
  return out


def _why(r) -> str:  # a row's status and reason, as one table cell
  return f"{r.get('status')}: " + " ".join(str(r.get("reason", "")).split()).replace("|", "/")


def _rows(records, keys, cells):
  """Markdown rows: the ``keys`` of each record, then ``cells(record)`` (6 cells) or why not."""
  for r in records:
    tail = " | ".join(cells(r)) if r.get("status") == "ok" else _why(r) + " |" * 5
    yield f"| {' | '.join(str(r[k]) for k in keys)} | {tail} |"


def _op_cells(r):
  frac = r.get("fraction_of_peak_hbm")
  return (
    common.fmt_time(r["time_s"]),
    *(common.fmt_bytes(r.get(k)) for k in ("temp_bytes", "program_bytes", "peak_bytes")),
    f"{r['achieved_gbps']:.1f}",
    "-" if frac is None else f"{100 * frac:.0f}%",
  )


def _model_cells(r):
  mfu = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
  by = (r.get(k) for k in ("temp_bytes", "program_bytes", "peak_bytes"))
  return (common.fmt_time(r["time_s"]), f"{r['tokens_per_s']:.0f}", mfu, *map(common.fmt_bytes, by))


def kernel_forms(op_recs) -> list[dict]:
  """Per kernel op, mode and T with both forms measured: their times and the faster one."""
  out = []
  measured = {(r["op"].split("/")[0], r["mode"], r["T"]) for r in op_recs if "/pallas[" in r["op"]}
  for op, mode, t_len in sorted(measured):
    find = lambda form: common.find(op_recs, op=f"{op}/pallas[{form}]", mode=mode, T=t_len)
    got = {form: find(form) for form in KERNEL_FORMS}
    if all(got.values()):
      times = {f: r["time_s"] for f, r in got.items()}
      out.append({"op": op, "mode": mode, "T": t_len, **times, "faster": min(times, key=times.get)})
  return out


def _form_lines(op_recs) -> list[str]:
  rows = [(r["op"], r["mode"], r["T"], *(common.fmt_time(r[f]) for f in KERNEL_FORMS), r["faster"])
          for r in kernel_forms(op_recs)]  # fmt: skip
  title = "\n## Kernel forms (GPU: sequential vs chunk-parallel, `aft_jax/ops/pallas/triton.py`)\n"
  head = ("op", "mode", "T", *KERNEL_FORMS, "faster")
  return [title, *common.table(head, rows, "llrrrl")] if rows else []


def markdown(info, op_recs, model_recs, kchecks, tchecks, complete=True, errors=()):
  peak = "device memory (process peak so far)"  # the device's counter never resets
  kernel_rows = [
    (c["kernel"], c["dtype"], f"{c['logit_std']:g}",
     f"{c['max_rel_error']:.2e}" if c.get("status", "ok") == "ok" else _why(c),
     f"{c['tolerance']:g}", c["holds"])
    for c in kchecks
  ]  # fmt: skip
  lines = [
    f"# Accelerator check: {info['device_kind']} ({info['platform']})\n",
    f"`{info['command']}`, jax {info['jax_version']}, {info['wall_s']:.0f} s, "
    f"inputs {info['dtype']}, d {info['d']}, batch {info['batch']}; peak HBM "
    f"{info['peak_hbm_gbps'] or '-'} GB/s, peak bf16 {info['peak_bf16_tflops'] or '-'} TFLOP/s.\n",
  ]
  if not complete:
    lines.append(
      "**Partial: the run had not finished when this was written** (still running, or stopped "
      "at a time limit); the sections below hold the rows measured so far.\n"
    )
  lines += [f"- section {e['section']}: {_why(e)}" for e in errors]
  lines += [
    "## Kernels against the XLA path\n",
    *common.table(("kernel", "dtype", "logit std", "max rel. error", "tolerance", "holds"),
                  kernel_rows, "llrrrl"),  # fmt: skip
    "\n## Ops (causal)\n",
    *common.table(("op", "mode", "T", "time", "temp memory", "program memory", peak,
                   "GB/s (min bytes)", "of peak"), (), "llrrrrrrr"),  # fmt: skip
    *_rows(op_recs, ("op", "mode", "T"), _op_cells),
    *_form_lines(op_recs),
    "\n## Train step\n",
    *common.table(("model", "T", "batch", "time", "tokens/s", "MFU", "temp memory",
                   "program memory", peak), (), "lrrrrrrrr"),  # fmt: skip
    *_rows(model_recs, ("model", "T", "batch"), _model_cells),
    "\n## Targets (the GPU targets; on other devices for reference)\n",
    *(common.check_line(c) if c["value"] is not None else
      f"- {c['check']}: not measured (target {c['target']})" for c in tchecks),
  ]  # fmt: skip
  return "\n".join(lines) + "\n"


# Rows the targets need, measured first so that a time limit cuts the others.
TARGET_ROWS = ("softmax_cudnn", "aft_simple/pallas", "aft_local_32/pallas", "cumsum")
OPS_SHARE = 0.6  # the op rows stop at this share of --max_minutes: the model rows hold targets
# The sizes: ops (T, d, batch, dtype), the LM and the recipe's batch, timing.
QUICK = dict(sizes=[32], d=32, batch=1, dtype="float32", layers=1, d_model=32, heads=4, vocab=128,
             model_t=32, recipe_batch=2, repeats=2, min_seconds=0.0, max_call_s=2.0)  # fmt: skip
FULL = dict(sizes=[1024, 4096, 8192, 16384], d=512, batch=8, dtype="bfloat16", layers=12,
            d_model=768, heads=12, vocab=32768, model_t=1024, recipe_batch=96, repeats=5,
            min_seconds=0.2, max_call_s=1.0)  # fmt: skip


def main(argv=None):
  dev = jax.devices()[0]
  out = f"benchmarks/results/{dev.device_kind.replace(' ', '_')}"
  p = common.parser(__doc__, "tiny sizes, for tests (CPU, ~1 min)", out)
  help = "no row starts after this (the op rows: 60%% of it); later rows are skipped"
  p.add_argument("--max_minutes", type=float, default=7.5, help=help)
  a = p.parse_args(argv)
  vars(a).update(QUICK if a.quick else FULL)
  platform = dev.platform
  if a.quick and platform == "tpu":
    a.d = 128  # the TPU kernel tiles 128
  t0 = time.time()
  deadline = t0 + 60 * a.max_minutes
  kernel_impl = kernel_impl_for(platform)
  chip = dev.device_kind if platform != "cpu" else ""  # no peaks for a CPU
  peak_tflops, peak_gbps = common.peaks(chip)
  info = common.machine_info("python -m benchmarks.accelerator_check", argv)
  info.update({k: v for k, v in vars(a).items() if k != "out"})
  info.update(kernel_impl=kernel_impl, peak_hbm_gbps=peak_gbps, peak_bf16_tflops=peak_tflops)
  log = functools.partial(print, flush=True)  # a killed run keeps its log up to the kill
  result = dict(machine=info, complete=False, errors=[], kernel_checks=[], ops={}, records=[],
                model=[], checks=[])  # fmt: skip

  def save(plot_fn=None):
    info["wall_s"] = time.time() - t0
    try:
      result["checks"] = target_checks(result["records"], result["model"])
      parts = ("records", "model", "kernel_checks", "checks", "complete", "errors")
      md = markdown(info, *map(result.get, parts))
    except Exception as e:  # pylint: disable=broad-except  # the JSON has the rows anyway
      why = common.error(e)["reason"]
      md = f"# Accelerator check\n\nThe summary failed ({why}): see the JSON.\n"
    try:  # a partial write that fails must not stop the measurements; the next one may work
      common.write_outputs(a.out, "accelerator_check", result, md, plot_fn)
    except Exception as e:  # pylint: disable=broad-except
      if plot_fn is not None:
        raise
      log(f"writing the partial results failed: {common.error(e)['reason']}")

  def section(name, fn, default):
    try:
      return fn()
    except Exception as e:  # pylint: disable=broad-except
      result["errors"].append({"section": name, **common.error(e)})
      log(f"{name}: {result['errors'][-1]['reason']}")
      return default

  save()
  # The kernel checks first: the cheapest section, and whether the kernels are right matters most.
  checks = lambda: kernel_checks(kernel_impl, a.quick, log)
  result["kernel_checks"] = section("kernel_checks", checks, [])
  save()

  rows = section("op_rows", lambda: op_rows(kernel_impl, platform), {})
  if a.quick:  # the code paths, not the sweep: one AFT op both ways and the floors
    rows = {n: r for n, r in rows.items() if n.startswith("aft_simple/") or n in BASELINES}
  result["ops"] = {n: r[3] for n, r in rows.items()}
  ops_deadline = t0 + 60 * a.max_minutes * OPS_SHARE
  max_temp_gib = 0.5 * (dev.memory_stats() or {}).get("bytes_limit", 16 << 30) / (1 << 30)
  kw = dict(batch=a.batch, d=a.d, conv_kernel=7, repeats=a.repeats, min_seconds=a.min_seconds)
  kw.update(max_call_s=a.max_call_s, max_temp_gib=max_temp_gib, table=rows, log=log)
  placeholders = lambda name, status: [
    {"op": name, "mode": mode, "T": t, "batch": a.batch, "d": a.d, **status}
    for mode in bench_ops.MODES for t in a.sizes
  ]  # fmt: skip
  for name in sorted(rows, key=lambda n: n not in TARGET_ROWS):
    if time.time() > ops_deadline:
      why = f"--max_minutes reached (op rows: {100 * OPS_SHARE:.0f}% of it)"
      result["records"] += placeholders(name, common.skipped(why))
      continue
    try:
      recs = bench_ops.run(a.sizes, names=[name], dtype=jnp.dtype(a.dtype), **kw)
    except Exception as e:  # pylint: disable=broad-except  # bench_ops.run catches per row
      recs = placeholders(name, common.error(e))
    add_bandwidth(recs, a.dtype, peak_gbps, log)
    result["records"] += recs
    save()

  def on_model_row(records):
    result["model"] = records
    save()

  section("model_rows", lambda: model_rows(a, peak_tflops, deadline, log, on_model_row), None)
  result["complete"] = True
  plot = lambda path: bench_ops.plot(result["records"], list(rows), path)
  try:
    save(plot)
  except Exception as e:  # pylint: disable=broad-except  # the JSON and markdown are written
    log(f"the plot failed: {common.error(e)['reason']}")


if __name__ == "__main__":
  main()
