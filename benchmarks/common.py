"""Shared helpers for the benchmarks: timing, XLA cost/memory analysis, machine info, output.

Every measurement is taken on a jitted function after compilation: the median wall time of
``repeats`` calls, each ending in ``block_until_ready``. FLOPs come from XLA's cost analysis of
the compiled program and temp memory from its memory analysis (the scratch buffers XLA
allocates besides the arguments and outputs) and program bytes (arguments + outputs + temp -
aliased: the program's own peak). On accelerators the device's peak memory counter
(``memory_stats()['peak_bytes_in_use']``) is recorded too; on CPU it is not available. That
counter is a maximum over the process's life (there is no reset), so a row measured after a
bigger one reports the bigger one's peak: ``program_bytes`` is the per-row figure.

A row that fails (a compile error, out of memory) is recorded as ``error(exc)`` and the
benchmark goes on; results are written atomically (``aft_jax.files``), so a run killed part
way leaves the last complete files.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np

from aft_jax import files
from benchmarks import flops

# Peak dense bf16 TFLOP/s per chip, for model FLOPs utilisation. Matched by substring of
# device_kind (first match wins, so more specific names come first).
PEAK_BF16_TFLOPS = (
  ("H200", 989.0),
  ("H100", 989.0),
  ("A100", 312.0),
  ("L4", 121.0),
  ("A10", 125.0),
  ("V100", 125.0),
  ("v6", 918.0),
  ("v5p", 459.0),
  ("v5 lite", 197.0),
  ("v5e", 197.0),
  ("v4", 275.0),
  ("v3", 123.0),
)

# Peak memory (HBM) bandwidth per chip in GB/s, from the vendors' data sheets; matched the same
# way. (A100 and H100 come in PCIe/SXM variants: the SXM figure.)
PEAK_HBM_GBPS = (
  ("H200", 4800.0),
  ("H100", 3350.0),
  ("A100", 2039.0),
  ("L4", 300.0),
  ("A10", 600.0),
  ("V100", 900.0),
  ("v6", 1640.0),
  ("v5p", 2765.0),
  ("v5 lite", 819.0),
  ("v5e", 819.0),
  ("v4", 1200.0),
  ("v3", 900.0),
)

SKIPPED = "skipped"
ERROR = "error"


def _lookup(table, device_kind: str) -> float | None:
  for name, value in table:
    if name.lower() in device_kind.lower():
      return value
  return None


def peak_tflops(device_kind: str) -> float | None:
  return _lookup(PEAK_BF16_TFLOPS, device_kind)


def peak_hbm_gbps(device_kind: str) -> float | None:
  return _lookup(PEAK_HBM_GBPS, device_kind)


def timed_run(info: dict, fn: Callable):
  """``fn()``, with its wall time recorded in ``info`` (a benchmark's machine description)."""
  t0 = time.time()
  out = fn()
  info["wall_s"] = time.time() - t0
  return out


def machine_info() -> dict[str, Any]:
  """The machine a result was measured on, and when (the result file's header)."""
  dev = jax.devices()[0]
  return {
    "platform": dev.platform,
    "device_kind": dev.device_kind,
    "device_count": jax.device_count(),
    "jax_version": jax.__version__,
    "python": platform.python_version(),
    "cpu_count": os.cpu_count(),
    "machine": platform.machine(),
    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
  }


def _first(x):
  # cost_analysis() returns a dict (new jax) or a list with one dict per program (old jax).
  if isinstance(x, (list, tuple)):
    return x[0] if x else {}
  return x or {}


def compiled_stats(compiled) -> dict[str, float | None]:
  """XLA's FLOP count (loop bodies counted once), the temp and argument bytes of a compiled
  program and its program bytes: arguments + outputs + temp - the outputs aliased to
  (donated) arguments, the most device memory the program holds at once."""
  out = {"xla_flops": None, "temp_bytes": None, "argument_bytes": None, "program_bytes": None}
  try:
    cost = _first(compiled.cost_analysis())
    out["xla_flops"] = float(cost.get("flops", math.nan))
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    mem = compiled.memory_analysis()
    out["temp_bytes"] = float(mem.temp_size_in_bytes)
    out["argument_bytes"] = float(mem.argument_size_in_bytes)
    out["program_bytes"] = float(
      mem.argument_size_in_bytes
      + mem.output_size_in_bytes
      + mem.temp_size_in_bytes
      - mem.alias_size_in_bytes
    )
  except Exception:  # pylint: disable=broad-except
    pass
  return out


def peak_device_bytes() -> float | None:
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return float(stats["peak_bytes_in_use"])


def reset_peak():
  # There is no public reset of the peak counter; clearing caches at least frees buffers.
  jax.clear_caches()


def _block(x):
  return jax.tree_util.tree_map(lambda a: a.block_until_ready(), x)


def compile_fn(fn: Callable, args: tuple, donate_argnums=()):
  """(compiled program, seconds to lower and compile) of ``jax.jit(fn)`` for ``args``."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def measure(
  fn: Callable,
  args: tuple,
  *,
  repeats: int = 5,
  min_repeats: int = 2,
  max_seconds: float = 10.0,
  min_seconds: float = 1.0,
  max_repeats: int = 50,
  compiled=None,
  compile_s=None,
) -> dict[str, Any]:
  """Compile ``jax.jit(fn)`` for ``args`` (unless ``compiled`` is given), then time it.

  Runs ``repeats`` timed calls, more (up to ``max_repeats``) until they have used
  ``min_seconds`` (fast calls: a median over many, robust to bursts of load), fewer (at least
  ``min_repeats``) once they have used ``max_seconds``. Returns median seconds, compile
  seconds, FLOPs (``flops.count``: loops times their trip count; and XLA's own count), temp
  bytes and (on accelerators) peak device bytes.
  """
  if compiled is None:
    compiled, compile_s = compile_fn(fn, args)
  stats = compiled_stats(compiled)
  stats["flops"] = flops.count(fn, *args)
  _block(compiled(*args))  # warm-up
  times = []
  spent = 0.0
  for i in range(max_repeats):
    if i >= repeats and spent >= min_seconds:
      break
    t = time.perf_counter()
    _block(compiled(*args))
    dt = time.perf_counter() - t
    times.append(dt)
    spent += dt
    if i + 1 >= min_repeats and spent > max_seconds:
      break
  return {
    "time_s": statistics.median(times),
    "time_min_s": min(times),
    "repeats": len(times),
    "compile_s": compile_s,
    "flops": stats["flops"],
    "xla_flops": stats["xla_flops"],
    "temp_bytes": stats["temp_bytes"],
    "argument_bytes": stats["argument_bytes"],
    "program_bytes": stats["program_bytes"],
    "peak_bytes": peak_device_bytes(),
  }


def measure_within(fn, args, compiled, compile_s, *, repeats, min_seconds, budget_s):
  """``measure`` of an already compiled ``fn``, timing for at most ~2x a call's budget."""
  return measure(
    fn,
    args,
    repeats=repeats,
    max_seconds=max(2.0, 2 * budget_s),
    min_seconds=min_seconds,
    compiled=compiled,
    compile_s=compile_s,
  )


def budget_exceeded(
  last, t_len: int, cost_class: str, budget_s: float, what: str, flag: str
) -> str | None:
  """Why size ``t_len`` should be skipped, or None: the time of the last measured size
  ``last = (T, seconds)`` extrapolated to ``t_len`` (x2 per doubling of T when ``cost_class``
  is 'linear', x4 when 'quadratic') exceeds ``budget_s``."""
  if last is None:
    return None
  est = last[1] * (4.0 if cost_class == "quadratic" else 2.0) ** math.log2(t_len / last[0])
  if est <= budget_s:
    return None
  return (
    f"estimated {est:.1f} s per {what} (from {last[1]:.2f} s at T={last[0]}, "
    f"{cost_class} in T) > {flag} {budget_s}"
  )


def skipped(reason: str) -> dict[str, str]:
  return {"status": SKIPPED, "reason": reason}


def error(exc: BaseException) -> dict[str, str]:
  """A failed row: the exception's type and the start of its message (XLA's can be pages)."""
  return {"status": ERROR, "reason": f"{type(exc).__name__}: {str(exc)[:300]}"}


def write_json(path: str, obj: Any):
  files.atomic_write(path, json.dumps(obj, indent=1, default=_json_default) + "\n")


def _json_default(x):
  # numpy and jax scalars and arrays (a bool from a comparison, a reduced array) as lists/values.
  if isinstance(x, (np.generic, np.ndarray, jax.Array)):
    return np.asarray(x).tolist()
  raise TypeError(type(x))


def fmt_time(s):
  if s is None or (isinstance(s, float) and not math.isfinite(s)):
    return "-"
  if s < 1e-3:
    return f"{s * 1e6:.0f} us"
  if s < 1:
    return f"{s * 1e3:.1f} ms"
  return f"{s:.2f} s"


def fmt_bytes(b):
  if b is None or (isinstance(b, float) and not math.isfinite(b)):
    return "-"
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if b >= size:
      return f"{b / size:.1f} {unit}"
  return f"{b:.0f} B"


def fmt_flops(f):
  if f is None or (isinstance(f, float) and not math.isfinite(f)):
    return "-"
  for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if f >= size:
      return f"{f / size:.2f} {unit}"
  return f"{f:.0f}"


def write_outputs(
  out: str, name: str, result: dict, md: str, plot_fn=None, *, partial: bool | None = None
) -> None:
  """Writes ``out/<name>.json`` (result), ``.md`` (md) and, given ``plot_fn``, ``.png``
  (``plot_fn(path)``), each atomically; prints md. A ``partial`` result (written as a run goes;
  by default, one without ``plot_fn``) prints one line instead."""
  os.makedirs(out, exist_ok=True)
  write_json(os.path.join(out, f"{name}.json"), result)
  files.atomic_write(os.path.join(out, f"{name}.md"), md)
  if plot_fn is None if partial is None else partial:
    print(f"wrote {out}/{name}.{{json,md}} (so far)", flush=True)
    return
  print(md)
  if plot_fn is None:
    return
  with files.atomic_path(os.path.join(out, f"{name}.png"), suffix=".png") as tmp:
    plot_fn(tmp)
  print(f"wrote {out}/{name}.{{json,md,png}} in {result['machine']['wall_s']:.0f} s")


def finish_log_log_figure(fig, axes, ylabels, path: str, legend_fontsize: int = 8) -> None:
  """Log-log axes against T (labels, grid, legend) for each of ``axes``; saves and closes."""
  for ax, ylabel in zip(axes, ylabels):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_fontsize)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def add_timing_args(parser, unit: str) -> None:
  """--repeats and --min_seconds: how long each size is timed (``unit``: 'steps' or 'calls')."""
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument(
    "--min_seconds",
    type=float,
    default=1.0,
    help=f"keep timing a size (up to 50 {unit}) until the {unit} have used this long",
  )
