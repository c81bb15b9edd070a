"""The benchmarks' one harness: timing a jitted function, XLA's cost and memory figures, FLOPs
counted on the jaxpr, the machine description, argument parsing, a row run in a child process,
and the results writer (json + md [+ png]). How they measure: docs/benchmarks.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.extend import core

from aft_jax import files

# Per chip (a substring of device_kind, the first match wins): peak dense bf16 TFLOP/s (for MFU)
# and peak HBM GB/s from the vendors' data sheets (SXM figures for A100 and H100).
PEAKS = (("H200", 989.0, 4800.0), ("H100", 989.0, 3350.0), ("A100", 312.0, 2039.0),
         ("L4", 121.0, 300.0), ("A10", 125.0, 600.0), ("V100", 125.0, 900.0),
         ("v6", 918.0, 1640.0), ("v5p", 459.0, 2765.0), ("v5 lite", 197.0, 819.0),
         ("v5e", 197.0, 819.0), ("v4", 275.0, 1200.0), ("v3", 123.0, 900.0))  # fmt: skip

SKIPPED = "skipped"
ERROR = "error"


def peaks(device_kind: str) -> tuple[float | None, float | None]:
  """(peak bf16 TFLOP/s, peak HBM GB/s) of a chip, or (None, None)."""
  return next((p[1:] for p in PEAKS if p[0].lower() in device_kind.lower()), (None, None))


def timed_run(info: dict, fn: Callable):
  """``fn()``, with its wall time recorded in ``info`` (a benchmark's machine description)."""
  t0 = time.time()
  out = fn()
  info["wall_s"] = time.time() - t0
  return out


def machine_info(command: str | None = None, argv=None) -> dict[str, Any]:
  """The machine, jax, the time and, given ``command``, the command line."""
  dev = jax.devices()[0]
  info = dict(platform=dev.platform, device_kind=dev.device_kind, device_count=jax.device_count())
  info.update(jax_version=jax.__version__, python=platform.python_version())
  info.update(cpu_count=os.cpu_count(), machine=platform.machine())
  if command:
    info["command"] = " ".join([command] + (argv or sys.argv[1:]))
  return dict(info, time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def compiled_stats(compiled) -> dict[str, float | None]:
  """XLA's FLOPs (loop bodies once), temp, argument and program bytes (args + outputs + temp -
  aliased: the most memory the program holds at once)."""
  out = {"xla_flops": None, "temp_bytes": None, "argument_bytes": None, "program_bytes": None}
  with contextlib.suppress(Exception):  # pylint: disable=broad-except
    cost = compiled.cost_analysis()  # a list with one dict per program in old jax
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else cost or {}
    out["xla_flops"] = float(cost.get("flops", math.nan))
  with contextlib.suppress(Exception):  # pylint: disable=broad-except
    mem = compiled.memory_analysis()
    out["temp_bytes"] = float(mem.temp_size_in_bytes)
    out["argument_bytes"] = float(mem.argument_size_in_bytes)
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    out["program_bytes"] = float(total - mem.alias_size_in_bytes)
  return out


def peak_device_bytes() -> float | None:
  """The device's peak memory counter (accelerators): a maximum over the process' life."""
  try:
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
  except Exception:  # pylint: disable=broad-except
    return None
  return None if peak is None else float(peak)


def compile_fn(fn: Callable, args: tuple, donate_argnums=()):
  """(compiled program, seconds to lower and compile) of ``jax.jit(fn)`` for ``args``."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def measure(
  fn: Callable, args: tuple, *, repeats: int = 5, min_repeats: int = 2, max_seconds: float = 10.0,
  min_seconds: float = 1.0, max_repeats: int = 50, compiled=None, compile_s=None, budget_s=None,
) -> dict[str, Any]:  # fmt: skip
  """Compiles ``jax.jit(fn)`` (unless ``compiled``) and times it: the median of ``repeats``
  to ``max_repeats`` calls until ``min_seconds``, ``min_repeats`` past ``max_seconds``
  (``budget_s``: 2x it); with FLOPs, temp, argument, program and peak device bytes."""
  if budget_s is not None:
    max_seconds = max(2.0, 2 * budget_s)
  if compiled is None:
    compiled, compile_s = compile_fn(fn, args)
  stats = compiled_stats(compiled)
  stats["flops"] = count_flops(fn, *args)
  jax.block_until_ready(compiled(*args))  # warm-up
  times = []
  for i in range(max_repeats):
    if i >= repeats and sum(times) >= min_seconds:
      break
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t)
    if i + 1 >= min_repeats and sum(times) > max_seconds:
      break
  out = dict(time_s=statistics.median(times), time_min_s=min(times), repeats=len(times))
  return dict(out, compile_s=compile_s, **stats, peak_bytes=peak_device_bytes())


def wall_times(fn: Callable, n: int) -> list[float]:
  """The wall seconds of each of ``n`` calls ``fn(i)``."""
  out = []
  for i in range(n):
    start = time.perf_counter()
    fn(i)
    out.append(time.perf_counter() - start)
  return out


def train(config, workdir: str):
  """(results, wall seconds) of ``train_and_evaluate(config)``: no sample, one save at the end."""
  from aft_jax.trainer import train_lib

  config.sample.length = 0
  config.checkpoint_every_steps = config.num_train_steps
  start = time.perf_counter()
  return train_lib.train_and_evaluate(config, workdir), time.perf_counter() - start


def sweep(sizes, base: dict, cost_class: str, budget_s, what: str, measure_one, log=print):
  """A record ``dict(base, T=t)`` per size: ``measure_one(t)``, or skipped once the last
  time extrapolated (x2 per doubling of T 'linear', x4 'quadratic') is over ``budget_s``,
  or an error (the larger sizes skipped)."""
  records, last, stop = [], None, None
  for t_len in sizes:
    rec = dict(base, T=t_len)
    records.append(rec)
    where = " ".join(str(base[k]) for k in ("op", "mode", "mixing") if k in base)
    if stop is None and last is not None:
      est = last[1] * (4.0 if cost_class == "quadratic" else 2.0) ** math.log2(t_len / last[0])
      if est > budget_s:
        stop = (f"estimated {est:.1f} s per {what} (from {last[1]:.2f} s at T={last[0]}, "
                f"{cost_class} in T) > --max_{what}_s {budget_s}")  # fmt: skip
    if stop is None:
      try:
        m = measure_one(t_len)
      except Exception as e:  # pylint: disable=broad-except  # one row, not the run
        rec.update(error(e))
        log(f"{where} T={t_len:6d} error: {rec['reason']}")
        stop = f"error at T={t_len}"  # a longer T would fail the same way or worse
        continue
      if not isinstance(m, str):
        rec.update({"status": "ok", **m})
        last = (t_len, m["time_s"])
        took, temp, flops = fmt_time(m["time_s"]), fmt_bytes(m["temp_bytes"]), fmt_flops(m["flops"])
        log(f"{where} T={t_len:6d} {took} temp {temp} flops {flops} compile {m['compile_s']:.1f}s")
        continue
      stop = m
    rec.update(skipped(stop))
    log(f"{where} T={t_len:6d} skipped: {stop}")
  return records


def skipped(reason: str) -> dict[str, str]:
  return {"status": SKIPPED, "reason": reason}


def error(exc: BaseException) -> dict[str, str]:
  """A failed row: the exception's type and the start of its message (XLA's can be pages)."""
  return {"status": ERROR, "reason": f"{type(exc).__name__}: {str(exc)[:300]}"}


def find(records, **match) -> dict | None:
  """The first measured (status ok) record whose fields equal ``match`` (None: any value)."""
  for r in records:
    if r.get("status") == "ok" and all(v is None or r.get(k) == v for k, v in match.items()):
      return r
  return None


def check(what: str, value, target: str, holds: Callable) -> dict:
  """A target's record; ``value`` None (a row not measured) holds None."""
  holds = None if value is None else holds(value)
  return {"check": what, "value": value, "target": target, "holds": holds}


def check_line(c) -> str:  # a target's line in a results page
  value = "-" if c["value"] is None else f"{c['value']:.3g}"
  verdict = "n/a" if c["holds"] is None else ("holds" if c["holds"] else "FAILS")
  return f"- {c['check']}: {value} (target {c['target']}: {verdict})"


RESULT = "RESULT "


def child(module: str, args, **kwargs):
  """One row in a fresh ``python -m module args`` (``emit``), or an error with its stderr."""
  cmd = [sys.executable, "-m", module, *map(str, args)]
  proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
  lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
  if proc.returncode or not lines:
    return {"status": ERROR, "reason": proc.stderr.strip()[-2000:]}
  return json.loads(lines[-1][len(RESULT) :])


def emit(result) -> None:
  print(RESULT + json.dumps(result, default=_json_default), flush=True)


def write_json(path: str, obj: Any):
  files.atomic_write(path, json.dumps(obj, indent=1, default=_json_default) + "\n")


def _json_default(x):
  if isinstance(x, (np.generic, np.ndarray, jax.Array)):
    return np.asarray(x).tolist()
  raise TypeError(type(x))


def _fmt(x, units, last: str) -> str:
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return "-"
  for unit, size, spec in units:
    if x >= size:
      return f"{x / size:{spec}} {unit}".rstrip()
  return last.format(x)


def fmt_time(s):
  if s is not None and 0 <= s < 1e-3:
    return f"{s * 1e6:.0f} us"
  return _fmt(s, (("s", 1, ".2f"), ("ms", 1e-3, ".1f")), "{:.2f} s")


def fmt_bytes(b):
  return _fmt(b, (("GiB", 1 << 30, ".1f"), ("MiB", 1 << 20, ".1f"), ("KiB", 1 << 10, ".1f")),
              "{:.0f} B")  # fmt: skip


def fmt_flops(f):
  return _fmt(f, (("T", 1e12, ".2f"), ("G", 1e9, ".2f"), ("M", 1e6, ".2f"), ("k", 1e3, ".2f")),
              "{:.0f}")  # fmt: skip


def table(head, rows, align: str) -> list[str]:
  """A markdown table's lines: ``head``, ``rows``, ``align`` l or r per column."""
  line = lambda cells: "| " + " | ".join(map(str, cells)) + " |"
  rule = "|" + "".join("---:|" if x == "r" else "---|" for x in align)
  return [line(head), rule, *map(line, rows)]


def parser(doc: str, quick: str | None = None, out="benchmarks/results"):
  """A benchmark's argument parser: its docstring's first line, --out and (with help) --quick."""
  p = argparse.ArgumentParser(description=doc.split("\n")[0])
  p.add_argument("--out", default=out)
  if quick:
    p.add_argument("--quick", action="store_true", help=quick)
  return p


def add_timing_args(parser, unit: str) -> None:
  """--repeats and --min_seconds: how long each size is timed (``unit``: 'steps' or 'calls')."""
  parser.add_argument("--repeats", type=int, default=5)
  help = f"keep timing a size (up to 50 {unit}) until the {unit} have used this long"
  parser.add_argument("--min_seconds", type=float, default=1.0, help=help)


def write_outputs(
  out: str, name: str, result: dict, md: str, plot_fn=None, *, partial: bool | None = None
) -> None:
  """``out/<name>.json``, ``.md`` [, ``.png``] written atomically; md printed (partial: a line)."""
  os.makedirs(out, exist_ok=True)
  write_json(os.path.join(out, f"{name}.json"), result)
  files.atomic_write(os.path.join(out, f"{name}.md"), md)
  if plot_fn is None if partial is None else partial:
    print(f"wrote {out}/{name}.{{json,md}} (so far)", flush=True)
  elif plot_fn is None:
    print(md)
  else:
    print(md)
    with files.atomic_path(os.path.join(out, f"{name}.png"), suffix=".png") as tmp:
      plot_fn(tmp)
    print(f"wrote {out}/{name}.{{json,md,png}} in {result['machine']['wall_s']:.0f} s")


def log_log_figure(ncols: int, figsize, ylabels, path: str, draw, legend_fontsize: int = 8):
  """A row of ``ncols`` log-log axes against T, ``draw(plt, axes)`` filling them; saved."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, ncols, figsize=figsize)
  draw(plt, axes)
  for ax, ylabel in zip(axes, ylabels):
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="sequence length T", ylabel=ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_fontsize)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# --------------------------------------------------------------------------- FLOPs
# XLA's cost_analysis counts a loop's body once; this counts on the jaxpr: a scan its length
# times its body, a cond its first branch (aft_jax's fast path), calls their bodies; a dot 2 x
# output x contracted size, elementwise ops 1 per output element, reductions and cumulative ops
# 1 per input element, data movement nothing, and a slice's cotangent added into a loop's
# accumulator the slice's size, as XLA runs it in place (loop-free: XLA's count, tested).

ELEMENTWISE = frozenset(
  """abs add add_any and atan2 cbrt ceil clamp cos div eq erf erf_inv erfc exp exp2 expm1 floor
  ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter not or pow
  rem round rsqrt select_n sign sin sqrt square sub tan tanh xor""".split()
)
REDUCTIONS = frozenset(
  """argmax argmin cumlogsumexp cummax cummin cumprod cumsum reduce_and reduce_max reduce_min
  reduce_or reduce_prod reduce_sum""".split()
)


def _size(aval) -> int:
  return math.prod(getattr(aval, "shape", ()))


def _jaxpr(x):
  return x.jaxpr if hasattr(x, "jaxpr") and not isinstance(x, core.Jaxpr) else x


def _full(jaxpr):
  return [_size(v.aval) for v in _jaxpr(jaxpr).invars]


def _eval(jaxpr, in_nnz):
  """(FLOPs, a bound on each output's nonzero size) of a jaxpr given its inputs' bounds."""
  closed = _jaxpr(jaxpr)
  nnz = dict(zip(closed.invars, in_nnz))
  get = lambda a: nnz.get(a, _size(a.aval)) if not isinstance(a, core.Literal) else _size(a.aval)
  total = 0.0
  for eqn in closed.eqns:
    name, params, outs = eqn.primitive.name, eqn.params, None
    if name == "dot_general":
      (lhs_contract, _), _ = params["dimension_numbers"]
      lhs = eqn.invars[0].aval
      total += 2.0 * _size(eqn.outvars[0].aval) * math.prod(lhs.shape[d] for d in lhs_contract)
    elif name == "add_any":
      a, b = (get(x) for x in eqn.invars)
      total += min(a, b)
      outs = [min(a + b, _size(eqn.outvars[0].aval))]
    elif name in ELEMENTWISE:
      total += sum(_size(v.aval) for v in eqn.outvars)
    elif name in REDUCTIONS:
      total += _size(eqn.invars[0].aval)
    elif name == "broadcast_in_dim" and isinstance(eqn.invars[0], core.Literal):
      outs = [0] if getattr(eqn.invars[0], "val", None) == 0 else None
    elif name == "dynamic_update_slice":
      outs = [min(get(eqn.invars[0]) + _size(eqn.invars[1].aval), _size(eqn.outvars[0].aval))]
    elif name == "scan":  # the carries may fill up: the body sees full bounds
      total += params["length"] * _eval(params["jaxpr"], _full(params["jaxpr"]))[0]
    elif name == "cond":
      flops, outs = _eval(params["branches"][0], [get(x) for x in eqn.invars[1:]])
      total += flops
    elif name == "while":  # trip count unknown statically: one pass, like XLA
      total += sum(_eval(params[k], _full(params[k]))[0] for k in ("cond_jaxpr", "body_jaxpr"))
    else:
      key = next((k for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if params.get(k) is not None), 0)
      if key:
        flops, outs = _eval(params[key], [get(x) for x in eqn.invars])
        total += flops
    if outs is not None:
      nnz.update(zip(eqn.outvars, outs))
  return total, [get(v) for v in closed.outvars]


def count_flops(fn: Callable, *args) -> float:
  """FLOPs of ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct``), loops counted per trip."""
  jaxpr = jax.make_jaxpr(fn)(*args)
  return _eval(jaxpr, _full(jaxpr))[0]
