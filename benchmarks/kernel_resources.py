"""Registers, spills and shared memory of every Pallas GPU kernel configuration, per GPU
architecture, compiled without a GPU (docs/kernels.md, "Kernel resources"; RESULTS.md). Needs
``python -m aft_jax.deviceless install cuda ptxas``; restarts itself in the deviceless CUDA
environment without XLA_FLAGS and compilation cache (XLA's defaults; a cache hit dumps nothing).

    python -m benchmarks.kernel_resources --out benchmarks/results
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import glob
import hashlib
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time

from aft_jax import deviceless, files, ops
from benchmarks import common

# An architecture: ptxas' name, the deviceless GPU that gives the limits, Triton's capability,
# and whether XLA compiles Triton for it (from sm_80 up; below, jaxlib's Triton compiler does:
# the Triton IR of each custom call compiled for that capability, then the same ptxas).
Arch = collections.namedtuple("Arch", "sm target capability xla")
ARCHS = (
  Arch("sm_75", "t4", "7.5", xla=False),
  Arch("sm_80", "a100-80", "8.0", xla=True),
  Arch("sm_90", "h100", "9.0", xla=True),
)
_LOWER_ON = "h100"  # whose Triton IR the non-XLA archs compile (it reads the arch for float8 only)
_PLUGIN_CHECK_ARCH = "sm_80"  # where jaxlib's Triton compile is also run, beside XLA's
DTYPES = ("float32", "bfloat16")
# Each op's kernels by (kernel function, outputs): forward, forward keeping the log-normaliser
# (the VJP's), backward, AFT-local's dw; the decay's (sequential only) keep one more output each.
_SIMPLE = {("_fwd_kernel", 1): "fwd", ("_fwd_kernel", 2): "fwd+lse", ("_bwd_kernel", 2): "bwd"}
KERNELS = {"aft_simple": _SIMPLE, "aft_local": {**_SIMPLE, ("_dw_kernel", 1): "dw"},
           "aft_decay": {(f, n + (n > 1)): k for (f, n), k in _SIMPLE.items()}}  # fmt: skip
# The chunk-parallel form's segment totals of the forward and the backward, by operand count.
TOTALS = {2: "totals k, v", 3: "totals L, g, a"}
FORMS = ("sequential", "chunked")
# Configurations (indices into triton.CONFIGS) per form: every one sequential; chunk-parallel,
# plan_for's widest block. Resources do not depend on T or the batch (they bound loops); batch
# 256 makes config_for take the widest block that divides D.
FORM_CONFIGS = {"sequential": (0, 1, 2), "chunked": (0,)}
BATCH, T_LEN, WINDOW = 256, 256, 128
# The kernels' sources: the results name their digest (a test asks that it is today's).
SOURCES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "aft_jax", "ops", "pallas")
PTXAS_FLAGS = ("--warn-on-spills", "-v")  # XLA's own (its log at VLOG 3)
_PTXAS_FIELDS = dict(registers=r"Used (\d+) registers", spill_stores=r"(\d+) bytes spill stores",
                     spill_loads=r"(\d+) bytes spill loads", stack_frame=r"(\d+) bytes stack frame",
                     shared_static=r"(\d+) bytes smem")  # fmt: skip
_THUNK = re.compile(
  r"(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+)"
)
_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)")


def shared_memory_limits(target: str) -> dict[str, int]:
  """A GPU description's per-block shared memory: the default and the opt-in maximum (bytes)."""
  text = open(deviceless.get(target).spec).read()
  get = lambda field: int(re.search(rf"\b{field}:\s*(\d+)", text).group(1))
  return {"default": get("shared_memory_per_block"), "optin": get("shared_memory_per_block_optin")}


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
  """Per entry of ``ptxas -v`` output: ``_PTXAS_FIELDS``; spill warnings dropped."""
  out = {}
  text = "\n".join(line for line in text.splitlines() if not line.startswith("ptxas warning"))
  for chunk in text.split("Compiling entry function '")[1:]:
    name = chunk.split("'", 1)[0]
    if not re.search(r"Used \d+ registers", chunk):
      raise ValueError(f"ptxas printed no register count for {name}:\n{chunk}")
    num = lambda pattern: int(m.group(1)) if (m := re.search(pattern, chunk)) else 0
    out[name] = {k: num(pattern) for k, pattern in _PTXAS_FIELDS.items()}
  return out


ptx_target = lambda ptx: re.search(r"^\s*\.target\s+(\w+)", ptx, re.M).group(1)  # sm_90a: Hopper


def run_ptxas(ptx: str) -> dict[str, dict[str, int]]:
  """``parse_ptxas`` of ptxas (pip's, as XLA's) on ``ptx`` for its own target."""
  with tempfile.TemporaryDirectory() as tmp:
    src = os.path.join(tmp, "kernel.ptx")
    files.atomic_write(src, ptx)
    cmd = [deviceless.ptxas(), src, "-o", os.path.join(tmp, "kernel.cubin"), *PTXAS_FLAGS]
    done = subprocess.run([*cmd, f"-arch={ptx_target(ptx)}"], capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"ptxas failed ({done.returncode}):\n{done.stderr or done.stdout}")
  return parse_ptxas(done.stdout + done.stderr)


def channels_for(cfg) -> int:
  """The smallest D for which ``config_for`` (``BATCH`` rows) and ``dw_config`` choose ``cfg``."""
  from aft_jax.ops.pallas import triton, triton_local

  step = triton.CONFIGS[-1].block_d
  for d in range(step, 64 * step + 1, step):
    if triton.config_for(d, BATCH) == cfg == triton_local.dw_config(d):
      return d
  raise ValueError(f"no channel count D <= {64 * step} makes the ops choose {cfg}")


def label(op: str, call: dict) -> str | None:
  """A Triton call's kernel name (``KERNELS``, ``TOTALS``), or None."""
  if call["name"] == "_totals_kernel":
    return TOTALS.get(call["operands"])
  return KERNELS[op].get((call["name"], call["results"]))


def lower(op: str, form: str, d: int, dtype: str, device):
  """The op's forward and VJP, its kernels in ``form``, lowered for ``device``."""
  import jax

  from benchmarks import kernel_form

  kw = dict(causal=True, impl="pallas")
  f = {"aft_simple": functools.partial(ops.aft_simple, **kw),
       "aft_decay": functools.partial(ops.aft_decay, **kw),
       "aft_local": functools.partial(ops.aft_local, window=WINDOW, **kw)}[op]  # fmt: skip

  @kernel_form.forced(form)
  def fwd_and_vjp(*args):
    out, vjp = jax.vjp(f, *args)
    return f(*args), vjp(out)

  sharding = jax.sharding.SingleDeviceSharding(device)
  x = jax.ShapeDtypeStruct((BATCH, T_LEN, d), dtype, sharding=sharding)
  shapes = {"aft_simple": [], "aft_local": [(T_LEN, T_LEN)], "aft_decay": [(d,)]}[op]
  w = [jax.ShapeDtypeStruct(s, "float32", sharding=sharding) for s in shapes]
  with jax.set_mesh(jax.sharding.Mesh([device], ("x",))):
    return jax.jit(fwd_and_vjp).lower(x, x, x, *w)


def triton_calls(lowered) -> list[dict]:
  """Every Triton custom call of a lowering: operands, results, grid, warps, stages, IR."""
  from jax._src.lib.mlir import ir

  calls = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          if child.operation.name == "stablehlo.custom_call":
            target = ir.StringAttr(child.attributes["call_target_name"]).value
            if target == ops.KERNEL_CALLS["gpu"]:
              cfg = ir.DictAttr(child.attributes["mhlo.backend_config"])
              num = lambda key: int(ir.IntegerAttr(cfg[key]).value)
              call = dict(name=ir.StringAttr(cfg["name"]).value, operands=len(child.operands))
              call.update(results=len(child.results), grid=[num(f"grid_{a}") for a in "xyz"])
              call.update(num_warps=num("num_warps"), num_stages=num("num_stages"))
              calls.append(dict(call, ir=ir.StringAttr(cfg["ir"]).value_bytes))
          walk(child.operation)

  walk(lowered.compiler_ir("stablehlo").operation)
  return calls


def xla_kernels(lowered) -> list[dict]:
  """XLA's deviceless compile of ``lowered``, from its dump: per Triton kernel (an entry named
  as a custom call, ``__N`` where names repeat) its parameter count, launch and PTX."""
  nvcc = os.path.dirname(os.path.dirname(deviceless.ptxas()))
  names = {c["name"] for c in triton_calls(lowered)}
  with tempfile.TemporaryDirectory() as dump:
    # XLA uses the ptxas run_ptxas runs; its own ptxas run (for an executable never run) at
    # -O0 to save CPU: the figures are run_ptxas' -O3 of the same PTX.
    options = {"xla_dump_to": dump, "xla_gpu_cuda_data_dir": nvcc}
    lowered.compile(compiler_options={**options, "xla_gpu_disable_gpuasm_optimizations": True})
    read = lambda name: open(os.path.join(dump, name)).read()
    (thunks,) = [f for f in os.listdir(dump) if f.endswith("thunk_sequence.txt")]
    launches = {}
    for m in _THUNK.finditer(read(thunks)):
      g = [int(x) for x in m.groups()[1:]]
      launches[m.group(1)] = {"grid": g[:3], "threads": g[3] * g[4] * g[5], "shared_dynamic": g[6]}
    kernels = []
    for name in sorted(f for f in os.listdir(dump) if f.endswith(".ptx")):
      ptx = read(name)
      for m in _ENTRY.finditer(ptx):
        if re.sub(r"__\d+$", "", m.group(1)) in names:
          entry, params = m.group(1), m.group(2).count(".param")
          kernels.append({"entry": entry, "params": params, **launches[entry], "ptx": ptx})
  return kernels


def plugin_kernel(call: dict, arch: Arch) -> dict:
  """jaxlib's Triton compile of a custom call's IR for ``arch``: its PTX and shared memory."""
  from jax._src.lib import triton

  if not triton.has_compilation_handler("CUDA"):
    raise RuntimeError("no Triton compiler for CUDA: the jax-cuda12 plugin did not register one")
  warps, stages = call["num_warps"], call["num_stages"]
  done = triton.compile("CUDA", call["ir"], arch.capability, num_warps=warps, num_ctas=1,
                        num_stages=stages)  # fmt: skip
  return dict(entry=call["name"], grid=call["grid"], threads=32 * warps, ptx=done.asm,
              shared_dynamic=int(done.smem_bytes))  # fmt: skip


def match(calls: list[dict], kernels: list[dict]) -> list[tuple[dict, dict]]:
  """Each custom call with XLA's kernel of its name and parameter count (one-to-one)."""
  pairs, left = [], list(kernels)
  same_name = lambda call, k: re.sub(r"__\d+$", "", k["entry"]) == call["name"]
  like = lambda call, k: same_name(call, k) and k["params"] == call["operands"] + call["results"]
  for call in calls:
    same = [k for k in left if like(call, k)]
    if not same:  # a repeated call (the same kernel on the same operands) XLA compiled once
      same = [k for c, k in pairs if like(call, k) and c["ir"] == call["ir"]][:1]
    if len(same) != 1:
      raise RuntimeError(f"{len(same)} kernels in XLA's dump match {call['name']} {call['grid']}")
    pairs.append((call, same[0]))
    if same[0] in left:
      left.remove(same[0])
  return pairs


def _row(op, form, call, cfg, d, dtype, arch, compiler, kernel, ptxas_info, limits):
  """A kernel's configuration, resources and limits, its launch checked against ``cfg``."""
  name = label(op, call)
  if name is None:
    raise RuntimeError(f"{op}: a kernel this script does not know: {call['name']}")
  segments = form == "chunked" and name != "dw"  # chunk-parallel: the segments on axis 2
  grid = call["grid"]
  if grid[1] != d // cfg.block_d or call["num_warps"] != cfg.num_warps or (grid[2] > 1) != segments:
    raise RuntimeError(f"{op} {name}: grid {call['grid']}, not the {form} one of {cfg} at D = {d}")
  if kernel["threads"] != 32 * cfg.num_warps:
    raise RuntimeError(f"{op} {name}: {kernel['threads']} threads, not {cfg.num_warps} warps")
  info = ptxas_info[kernel["entry"]]
  shared = kernel["shared_dynamic"]
  row = dict(op=op, form=form, kernel=name)
  row.update({k: getattr(cfg, k) for k in ("block_t", "block_d", "num_warps", "num_stages")})
  row.update(channels=d, dtype=dtype, arch=arch.sm, gpu=arch.target, compiler=compiler)
  row.update(ptx_target=ptx_target(kernel["ptx"]), **info, shared_dynamic=shared,
             shared_bytes=shared + info["shared_static"], shared_limit_default=limits["default"],
             shared_limit_optin=limits["optin"], grid=grid)  # fmt: skip
  return row


def _order(row: dict) -> tuple:
  """Rows by op, form, block (widest first), kernel, dtype, arch."""
  kernels = list(KERNELS[row["op"]].values()) + list(TOTALS.values())
  at = lambda seq, key: list(seq).index(row[key])
  return (at(KERNELS, "op"), at(FORMS, "form"), -row["block_d"], at(kernels, "kernel"),
          at(DTYPES, "dtype"), at((a.sm for a in ARCHS), "arch"))  # fmt: skip


def source_digest() -> str:
  """sha256 over the kernels' sources (``SOURCES``), by file name and bytes."""
  h = hashlib.sha256()
  for path in sorted(glob.glob(os.path.join(SOURCES, "*.py"))):
    h.update(os.path.basename(path).encode() + b"\0" + open(path, "rb").read())
  return h.hexdigest()


def cases(ops=tuple(KERNELS), dtypes=DTYPES) -> list[tuple[str, int, str, str]]:
  """(op, ``triton.CONFIGS`` index, dtype, form) per measurement, the costliest first."""
  costliest = sorted(KERNELS, key=lambda op: -len(KERNELS[op]))
  forms = [(form, i) for form in reversed(FORMS) for i in FORM_CONFIGS[form]]
  return [(op, i, dtype, form) for op in costliest if op in ops for form, i in forms
          if form == "sequential" or op != "aft_decay" for dtype in dtypes]  # fmt: skip


def measure_cases(selected, route_check: bool, archs) -> dict:
  """Rows of ``selected`` cases on ``archs`` (and jaxlib's Triton figures: ``plugin_check``)."""
  import jax

  from aft_jax.ops.pallas import triton

  jax.config.update("jax_enable_compilation_cache", False)  # a cache hit dumps nothing
  targets = {a.target for a in ARCHS if a.xla} | {_LOWER_ON}
  devices = {target: deviceless.devices(target)[0] for target in targets}
  (check,) = [a._replace(xla=False) for a in ARCHS if a.sm == _PLUGIN_CHECK_ARCH]
  chosen = [a for a in ARCHS if a.sm in archs] + [check] * route_check
  pending = []  # (row arguments, shared-memory limits, future of ptxas' figures)
  pool = concurrent.futures.ThreadPoolExecutor(2)
  # ptxas -v reports every entry of a PTX module: each module is run once.
  ptxas_of = functools.cache(lambda ptx: pool.submit(run_ptxas, ptx))
  for op, i, dtype, form in selected:
    t0 = time.time()
    cfg = triton.CONFIGS[i]
    d = channels_for(cfg)
    lowered_for = functools.cache(lambda target: lower(op, form, d, dtype, devices[target]))
    for arch in chosen:
      if arch.xla:
        calls = triton_calls(lowered_for(arch.target))
        pairs, compiler = match(calls, xla_kernels(lowered_for(arch.target))), "xla"
      else:  # jaxlib's Triton takes the custom calls' IR as lowered for _LOWER_ON
        calls = triton_calls(lowered_for(_LOWER_ON))
        pairs = [(c, plugin_kernel(c, arch)) for c in calls]
        compiler = "triton (jaxlib)" + (", check" if arch is check else "")
      # The forward program and the VJP's forward may hold the same totals kernel twice.
      unique = {}
      for call, kernel in pairs:
        unique.setdefault((label(op, call), call["results"]), (call, kernel))
      for call, kernel in unique.values():
        args = (op, form, call, cfg, d, dtype, arch, compiler, kernel)
        pending.append((args, shared_memory_limits(arch.target), ptxas_of(kernel["ptx"])))
    print(f"  {op} {form} block_d {cfg.block_d} {dtype}: {len(calls)} kernels, "
          f"{time.time() - t0:.1f} s", flush=True)  # fmt: skip
  out = {"rows": [], "plugin_check": []}
  for args, lim, future in pending:
    row = _row(*args, future.result(), lim)
    out["plugin_check" if row["compiler"].endswith("check") else "rows"].append(row)
  pool.shutdown()
  return out


def measure(workers: int, route_check: bool, archs, selected) -> dict:
  """The ``selected`` cases on ``archs``, dealt out to ``workers`` processes."""
  n = max(1, min(workers, len(selected)))
  if n == 1:
    shards = [measure_cases(selected, route_check, archs)]
  else:
    spawn = multiprocessing.get_context("spawn")  # each worker its own jax
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=spawn) as pool:
      jobs = [pool.submit(measure_cases, selected[i::n], route_check, archs) for i in range(n)]
      shards = [job.result() for job in jobs]
  return {k: sorted(sum((s[k] for s in shards), []), key=_order) for k in ("rows", "plugin_check")}


_kib = lambda b: f"{b / 1024:g} KiB"


def headline(rows: list[dict]) -> list[str]:
  """Per architecture: the most registers, the spills and the most shared memory."""
  out = []
  which = lambda r: f"{r['op']} {r['form']} {r['kernel']}, block_d {r['block_d']}, {r['dtype']}"
  for arch in ARCHS:
    rs = [r for r in rows if r["arch"] == arch.sm]
    if not rs:
      continue
    top = max(rs, key=lambda r: r["registers"])
    big = max(rs, key=lambda r: r["shared_bytes"])
    spilled = [r for r in rs if r["spill_stores"] or r["spill_loads"]]
    spills = "no spills"
    if spilled:
      worst = max(spilled, key=lambda r: r["spill_stores"] + r["spill_loads"])
      spills = (f"{len(spilled)} kernel{'s' * (len(spilled) > 1)} spilling (most: {which(worst)}: "
                f"{worst['spill_stores']} B stored, {worst['spill_loads']} B loaded)")  # fmt: skip
    limits = (
      f"{_kib(big['shared_limit_default'])} default, {_kib(big['shared_limit_optin'])} opt-in"
    )
    out.append(f"{arch.sm} ({arch.target}, {rs[0]['compiler']}): at most {top['registers']} "
               f"registers ({which(top)}), {spills}, at most {_kib(big['shared_bytes'])} shared "
               f"memory per block (limit {limits})")  # fmt: skip
  return out


def markdown(result: dict) -> str:
  meta, rows = result["meta"], result["rows"]
  key = lambda r: (r["op"], r["form"], r["kernel"], r["block_d"])
  # Per (op, form, kernel, block_d): registers and shared memory, float32 / bfloat16.
  by = {(key(r), r["arch"], r["dtype"]): r for r in rows}
  archs = [a.sm for a in ARCHS if any(r["arch"] == a.sm for r in rows)]
  dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in rows)]
  head = ["op", "form", "kernel", "block (t x d)"]
  short = " / ".join({"float32": "f32", "bfloat16": "bf16"}[d] for d in dtypes)
  head += [f"{a} regs {short}" for a in archs] + [f"{a} smem {short}" for a in archs]
  compact = [head]
  for k in dict.fromkeys(map(key, rows)):
    cells = [*k[:3], f"{by[(k, archs[0], dtypes[0])]['block_t']} x {k[3]}"]
    for field, fmt in (("registers", str), ("shared_bytes", _kib)):
      cells += [" / ".join(fmt(by[(k, a, dt)][field]) for dt in dtypes) for a in archs]
    compact.append(cells)
  full = [
    (r["op"], r["form"], r["kernel"], f"{r['block_t']} x {r['block_d']}, {r['num_warps']}, "
     f"{r['num_stages']}", r["dtype"], r["arch"], r["compiler"], r["registers"],
     f"{r['spill_stores']} / {r['spill_loads']}", _kib(r["shared_bytes"]),
     f"{_kib(r['shared_limit_default'])} / {_kib(r['shared_limit_optin'])}")
    for r in rows
  ]  # fmt: skip
  full_head = ("op", "form", "kernel", "block (t x d, warps, stages)", "dtype", "arch", "compiler",
               "registers", "spill stores / loads (B)", "shared memory",
               "limit per block (default / opt-in)")  # fmt: skip
  # How far jaxlib's Triton compile (the sm_75 route) is from XLA's at the check arch.
  check_key = lambda r: (*key(r), r["dtype"])
  xla = {check_key(r): r["registers"] for r in rows if r["arch"] == _PLUGIN_CHECK_ARCH}
  gap = [r["registers"] - xla[check_key(r)] for r in result["plugin_check"] if check_key(r) in xla]
  notes = headline(rows)
  if gap:
    notes.append(
      f"jaxlib's Triton compile (the sm_75 route) against XLA's at "
      f"{_PLUGIN_CHECK_ARCH}: {min(gap):+d} to {max(gap):+d} registers per kernel."
    )
  lines = [
    "# Kernel resources per architecture (compiled without a device)",
    "",
    f"From the compilers for each target on a machine without a GPU ({meta['ptxas']}, jax "
    f"{meta['jax']}, jaxlib {meta['jaxlib']}), not measured on a GPU. sm_80 and sm_90: XLA's "
    "own build of the kernels (deviceless compile); sm_75: jaxlib's Triton compile of the same "
    "Triton IR, since XLA refuses Triton below compute capability 8.0 (what the kernels would "
    f"take if it did not). Shapes: batch {BATCH}, T {T_LEN}, AFT-local window {WINDOW}.",
    "Regenerate: `python -m benchmarks.kernel_resources` (benchmarks/kernel_resources.py).",
    "",
    *[f"- {line}" for line in notes],
    "",
    *common.table(compact[0], compact[1:], "l" * 4 + "r" * 2 * len(archs)),
    "",
    *common.table(full_head, full, "l" * 7 + "r" * 4),
    "",
  ]
  return "\n".join(lines)


def main(argv=None) -> int:
  p = common.parser(__doc__)
  help = "processes (default: one per core; much of a compile is single-threaded)"
  p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help=help)
  help = "skip compiling with jaxlib's Triton for sm_80 too (the comparison with XLA's build)"
  p.add_argument("--no_route_check", action="store_true", help=help)
  archs = [a.sm for a in ARCHS]
  p.add_argument("--archs", nargs="+", choices=archs, default=archs, help="only these")
  p.add_argument(
    "--ops", nargs="+", choices=list(KERNELS), default=list(KERNELS), help="only these"
  )
  p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=DTYPES, help="only these")
  args = p.parse_args(argv)
  if os.environ.get(deviceless.CHILD_ENV) != "cuda":
    for kind in ("cuda", "ptxas"):
      deviceless.install(kind)
    flags = sys.argv[1:] if argv is None else argv
    cmd = [sys.executable, "-m", "benchmarks.kernel_resources", *flags]
    sys.stdout.flush()
    caches = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith(caches)}
    os.execve(sys.executable, cmd, deviceless.environment("cuda", base=base))
  import jax
  import jaxlib

  t0 = time.time()
  print(f"Compiling every kernel configuration for {', '.join(args.archs)} (no GPU needed)")
  result = measure(args.workers, not args.no_route_check, args.archs, cases(args.ops, args.dtypes))
  version = subprocess.run([deviceless.ptxas(), "--version"], capture_output=True, text=True)
  m = re.search(r"release [\d.]+, V([\d.]+)", version.stdout)
  ptxas = f"ptxas {m.group(1) if m else version.stdout.strip().splitlines()[-1]}"
  result["meta"] = dict(jax=jax.__version__, jaxlib=jaxlib.__version__, ptxas=ptxas, batch=BATCH,
                        t_len=T_LEN, window=WINDOW, sources=source_digest(),
                        wall_s=round(time.time() - t0, 1))  # fmt: skip
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "kernel_resources")
  common.write_json(f"{path}.json", result)
  files.atomic_write(f"{path}.md", markdown(result))
  print("\n".join(headline(result["rows"])))
  print(f"wrote {path}.{{json,md}} in {time.time() - t0:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
