"""Registers, spills and shared memory of every Pallas GPU kernel, per GPU architecture,
compiled on this machine without a GPU.

    python -m benchmarks.kernel_resources            # writes benchmarks/results/kernel_resources.*
    python -m benchmarks.kernel_resources --out DIR

Why: a kernel that needs more registers than an architecture has per thread spills to local
memory (slow), and one that needs more shared memory than a block may have does not launch.
Neither shows on a CPU machine, and a GPU to try every configuration on is rarely at hand; the
compiler for the target tells both.

What. Every block configuration the ops can choose with ``impl="auto"`` / ``"pallas"`` (``CONFIGS``
of ``aft_jax/ops/pallas/triton.py``: AFT-simple's and AFT-local's ``config_for`` and AFT-local's
``dw_config``), each kernel of causal AFT-simple (forward, forward with the log-normaliser that
training keeps, backward) and causal AFT-local (the same and the dw kernel), float32 and bfloat16
inputs, for sm_75 (T4), sm_80 (A100) and sm_90 (H100/H200); and the chunk-parallel form
(``aft_jax/ops/pallas/triton.py``: its segment totals, forward and backward kernels with the fold of
the totals) at the channel block it takes wherever D is a multiple of 64 (``FORM_CONFIGS``). The ops
are called through their public API, in each form (``benchmarks.kernel_form.forced``), with shapes
for which their own choice (``config_for``, ``dw_config``) is each configuration, and each kernel's
launch grid is checked against it.

How. For sm_80 and sm_90 this is what runs there: XLA's deviceless compile for the target
(``aft_jax.deviceless``, the A100 and H100 descriptions in ``aft_jax/gpu_specs``) of the
forward and the VJP, with its dump: the PTX of each Triton kernel (XLA's Triton pipeline; the
kernels are ``__gpu$xla.gpu.triton`` custom calls in jaxlib 0.10.2), assembled again by the
same ptxas with XLA's flags (``-arch=... --warn-on-spills -v``) for the register and spill
counts, and the dynamic shared memory of each launch from XLA's thunk sequence. XLA refuses
Triton below compute capability 8.0, so sm_75 is what the kernels would take if it did not:
the Triton IR that the lowering serialises into each custom call, compiled for 7.5 by jaxlib's
Triton compiler (registered by the CUDA plugin, ``jax._src.lib.triton.compile``, the path
later jaxlibs take for every architecture), then the same ptxas. The two pipelines are not
identical: by tens of registers in places, so the JSON's ``plugin_check`` rows give jaxlib's
figures at sm_80 beside XLA's (``--no_route_check`` skips them). ptxas is pip's
``nvidia-cuda-nvcc-cu12`` (what ``jax[cuda12]`` installs), and XLA is pointed at it too
(``xla_gpu_cuda_data_dir``) rather than at whichever ptxas is on PATH. So these are the
compilers' numbers for each target, not measurements on a GPU.

Resources do not depend on T or the batch (T and the window only bound loops the compiler
keeps), so the shapes are small: batch 256 (so that ``config_for`` takes the widest block that
divides D), T 256 and AFT-local's window 128. (Checked with jaxlib's compile for sm_90: T 64
to 4096 change nothing; window 32 gives the dw kernel 2 registers fewer than 128 or 1024.)

The measurement runs in a process started in ``deviceless.environment("cuda")`` (this command
restarts itself so), without the caller's ``XLA_FLAGS`` (the figures are for XLA's defaults;
the test suite's ``--xla_backend_optimization_level=0`` would change them) and without the
persistent compilation cache (a cached executable is not compiled again, so nothing would be
dumped). Needs ``python -m aft_jax.deviceless install cuda ptxas``; about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from aft_jax import deviceless, files, ops


@dataclasses.dataclass(frozen=True)
class Arch:
  """An architecture: ``sm`` (ptxas' name), ``target`` (the ``deviceless`` GPU whose
  description gives the limits), ``capability`` (Triton's arch name) and whether XLA compiles
  Triton kernels for it (else the plugin's Triton compiler does, see the module docstring)."""

  sm: str
  target: str
  capability: str
  xla: bool


ARCHS = (
  Arch("sm_75", "t4", "7.5", xla=False),
  Arch("sm_80", "a100-80", "8.0", xla=True),
  Arch("sm_90", "h100", "9.0", xla=True),
)
# The architecture whose lowering gives the Triton IR compiled for the non-XLA ones (the IR
# does not depend on it: jax's Triton lowering reads the capability only for float8 casts).
_LOWER_ON = "h100"
DTYPES = ("float32", "bfloat16")
# The kernels of each op, by (the kernel function's name, number of outputs), as the ops'
# forward (the mean only) and VJP (its forward keeps the log-normaliser L) launch them.
KERNELS = {
  "aft_simple": {
    ("_fwd_kernel", 1): "fwd",
    ("_fwd_kernel", 2): "fwd+lse",
    ("_bwd_kernel", 2): "bwd",
  },
  "aft_local": {
    ("_fwd_kernel", 1): "fwd",
    ("_fwd_kernel", 2): "fwd+lse",
    ("_bwd_kernel", 2): "bwd",
    ("_dw_kernel", 1): "dw",
  },
}
# The chunk-parallel form's kernels (``pallas/triton.py``): the segment totals of the forward
# (k, v) and of the backward (L, g, a), told apart by their operands.
TOTALS = {2: "totals k, v", 3: "totals L, g, a"}
FORMS = ("sequential", "chunked")
# The configurations measured per form (indices into ``triton.CONFIGS``): every one in
# the sequential form; in the chunk-parallel form the block ``plan_for`` takes wherever D is a
# multiple of 64 (its widest), whose kernels hold the most per thread (the others differ only
# in the channel block, as in the sequential form, where the three give the same ordering).
FORM_CONFIGS = {"sequential": (0, 1, 2), "chunked": (0,)}
BATCH, T_LEN, WINDOW = 256, 256, 128
# The flags XLA gives ptxas (its log at VLOG 3 shows them), so the counts are its build's.
PTXAS_FLAGS = ("--warn-on-spills", "-v")
_PLUGIN_CHECK_ARCH = "sm_80"  # where the plugin's Triton compile is also run, to compare


def shared_memory_limits(target: str) -> dict[str, int]:
  """A GPU description's per-block shared memory: the default and the opt-in maximum (bytes)."""
  text = open(deviceless.get(target).spec).read()
  get = lambda field: int(re.search(rf"\b{field}:\s*(\d+)", text).group(1))
  return {
    "default": get("shared_memory_per_block"),
    "optin": get("shared_memory_per_block_optin"),
  }


# --------------------------------------------------------------------------- ptxas


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
  """Per entry function of ``ptxas -v`` output: registers, spill stores and loads, stack frame
  and static shared memory (bytes)."""
  out = {}
  # --warn-on-spills' warnings (on stderr, so out of order here) repeat the properties' figures.
  text = "\n".join(line for line in text.splitlines() if not line.startswith("ptxas warning"))
  for chunk in text.split("Compiling entry function '")[1:]:
    name = chunk.split("'", 1)[0]
    num = lambda pattern: int(m.group(1)) if (m := re.search(pattern, chunk)) else 0
    if not re.search(r"Used \d+ registers", chunk):
      raise ValueError(f"ptxas printed no register count for {name}:\n{chunk}")
    out[name] = {
      "registers": num(r"Used (\d+) registers"),
      "spill_stores": num(r"(\d+) bytes spill stores"),
      "spill_loads": num(r"(\d+) bytes spill loads"),
      "stack_frame": num(r"(\d+) bytes stack frame"),
      "shared_static": num(r"(\d+) bytes smem"),
    }
  return out


def ptx_target(ptx: str) -> str:
  """The ``.target`` of a PTX module (sm_90a for Hopper: Triton's and XLA's choice)."""
  return re.search(r"^\s*\.target\s+(\w+)", ptx, re.M).group(1)


def run_ptxas(ptx: str) -> dict[str, dict[str, int]]:
  """``parse_ptxas`` of ptxas on ``ptx`` for its own target; a RuntimeError with ptxas' output
  if it fails."""
  with tempfile.TemporaryDirectory() as tmp:
    src = os.path.join(tmp, "kernel.ptx")
    with open(src, "w") as f:
      f.write(ptx)
    cmd = [deviceless.ptxas(), src, "-o", os.path.join(tmp, "kernel.cubin")]
    done = subprocess.run(
      [*cmd, f"-arch={ptx_target(ptx)}", *PTXAS_FLAGS], capture_output=True, text=True
    )
  if done.returncode:
    raise RuntimeError(f"ptxas failed ({done.returncode}):\n{done.stderr or done.stdout}")
  return parse_ptxas(done.stdout + done.stderr)


def ptxas_version() -> str:
  """'ptxas 12.9.86' (from its --version)."""
  done = subprocess.run([deviceless.ptxas(), "--version"], capture_output=True, text=True)
  m = re.search(r"release [\d.]+, V([\d.]+)", done.stdout)
  return f"ptxas {m.group(1) if m else done.stdout.strip().splitlines()[-1]}"


# --------------------------------------------------------------------------- the programs


def channels_for(cfg) -> int:
  """The smallest channel count D for which both ops (``config_for`` at ``BATCH`` rows) and
  the dw kernel (``dw_config``) choose ``cfg``."""
  from aft_jax.ops.pallas import triton, triton_local

  step = triton.CONFIGS[-1].block_d
  for d in range(step, 64 * step + 1, step):
    chosen = (
      triton.config_for(d, BATCH),
      triton_local.dw_config(d),
    )
    if all(c == cfg for c in chosen):
      return d
  raise ValueError(f"no channel count D <= {64 * step} makes the ops choose {cfg}")


def label(op: str, call: dict) -> str | None:
  """A Triton call's kernel (``KERNELS``, ``TOTALS``), or None if this script does not know it."""
  if call["name"] == "_totals_kernel":
    return TOTALS.get(call["operands"])
  return KERNELS[op].get((call["name"], call["results"]))


def program(op: str, form: str = "sequential"):
  """A function of the op's arguments returning its forward (the mean only) and its VJP (the
  forward with L, the backward, for AFT-local also dw), through the public op, the kernels in
  ``form`` (T_LEN holds two segments of the chunk-parallel form)."""
  import jax

  from aft_jax import ops
  from benchmarks import kernel_form

  if op == "aft_simple":
    f = lambda q, k, v: ops.aft_simple(q, k, v, causal=True, impl="pallas")
  else:
    f = lambda q, k, v, w: ops.aft_local(q, k, v, w, window=WINDOW, causal=True, impl="pallas")

  def fwd_and_vjp(*args):
    with kernel_form.forced(form):
      out, vjp = jax.vjp(f, *args)
      return f(*args), vjp(out)

  return fwd_and_vjp


def arguments(op: str, d: int, dtype: str, device):
  """ShapeDtypeStructs of the op's arguments on ``device`` (q, k, v; AFT-local's w float32)."""
  import jax

  sharding = jax.sharding.SingleDeviceSharding(device)
  x = jax.ShapeDtypeStruct((BATCH, T_LEN, d), dtype, sharding=sharding)
  if op == "aft_simple":
    return (x, x, x)
  return (x, x, x, jax.ShapeDtypeStruct((T_LEN, T_LEN), "float32", sharding=sharding))


def triton_calls(module) -> list[dict]:
  """Every ``__gpu$xla.gpu.triton`` custom call of a lowered StableHLO module: its kernel's
  name, operand and result counts, grid, warps, stages and serialised Triton IR."""
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
              calls.append(
                {
                  "name": ir.StringAttr(cfg["name"]).value,
                  "operands": len(child.operands),
                  "results": len(child.results),
                  "grid": [num("grid_x"), num("grid_y"), num("grid_z")],
                  "num_warps": num("num_warps"),
                  "num_stages": num("num_stages"),
                  "ir": ir.StringAttr(cfg["ir"]).value_bytes,
                }
              )
          walk(child.operation)

  walk(module.operation)
  return calls


# --------------------------------------------------------------------------- the compilers

_THUNK = re.compile(
  r"(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+)"
)
_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)")


def xla_kernels(lowered) -> list[dict]:
  """XLA's deviceless compile of ``lowered`` with its dump: per Triton kernel (an entry whose
  name is a custom call's, with XLA's ``__N`` suffix where names repeat) its PTX parameter
  count, launch (grid, threads, dynamic shared memory) and PTX."""
  nvcc = os.path.dirname(os.path.dirname(deviceless.ptxas()))
  names = {c["name"] for c in triton_calls(lowered.compiler_ir("stablehlo"))}
  with tempfile.TemporaryDirectory() as dump:
    # xla_gpu_cuda_data_dir: XLA's ptxas is the one this script runs again (not one on PATH).
    # xla_gpu_disable_gpuasm_optimizations: XLA's own ptxas run (for the executable, which is
    # never run here) at -O0, a third less CPU than at -O3 (20 -> 13 CPU-s for sm_80's cases);
    # the figures are from run_ptxas' -O3 of the same PTX, which XLA's LLVM made before ptxas.
    options = {"xla_dump_to": dump, "xla_gpu_cuda_data_dir": nvcc}
    lowered.compile(compiler_options={**options, "xla_gpu_disable_gpuasm_optimizations": True})
    listing = os.listdir(dump)
    (thunks,) = [f for f in listing if f.endswith("thunk_sequence.txt")]
    launches = {}
    for m in _THUNK.finditer(open(os.path.join(dump, thunks)).read()):
      launches[m.group(1)] = {
        "grid": [int(m.group(i)) for i in (2, 3, 4)],
        "threads": int(m.group(5)) * int(m.group(6)) * int(m.group(7)),
        "shared_dynamic": int(m.group(8)),
      }
    kernels = []
    for name in sorted(f for f in listing if f.endswith(".ptx")):
      ptx = open(os.path.join(dump, name)).read()
      for m in _ENTRY.finditer(ptx):
        entry = m.group(1)
        if re.sub(r"__\d+$", "", entry) in names:
          params = m.group(2).count(".param")
          kernels.append({"entry": entry, "params": params, **launches[entry], "ptx": ptx})
  return kernels


def plugin_kernel(call: dict, arch: Arch) -> dict:
  """jaxlib's Triton compile of a custom call's IR for ``arch``: its PTX and shared memory."""
  from jax._src.lib import triton

  if not triton.has_compilation_handler("CUDA"):
    raise RuntimeError("no Triton compiler for CUDA: the jax-cuda12 plugin did not register one")
  done = triton.compile(
    "CUDA",
    call["ir"],
    arch.capability,
    num_warps=call["num_warps"],
    num_ctas=1,
    num_stages=call["num_stages"],
  )
  return {
    "entry": call["name"],
    "grid": call["grid"],
    "threads": 32 * call["num_warps"],
    "shared_dynamic": int(done.smem_bytes),
    "ptx": done.asm,
  }


def match(calls: list[dict], kernels: list[dict]) -> list[tuple[dict, dict]]:
  """Each custom call with XLA's kernel of the same name and parameters (operands + results:
  the forward and its with-L variant differ by one output); a RuntimeError unless one-to-one."""
  pairs, left = [], list(kernels)
  like = lambda call, k: (
    re.sub(r"__\d+$", "", k["entry"]) == call["name"]
    and k["params"] == call["operands"] + call["results"]
  )
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


# --------------------------------------------------------------------------- the measurement


def _row(op, form, call, cfg, d, dtype, arch, compiler, kernel, ptxas_info, limits):
  """One table row: a kernel's configuration, the compiler's resources and the limits."""
  name = label(op, call)
  if name is None:
    raise RuntimeError(f"{op}: a kernel this script does not know: {call['name']}")
  # The launch must be the configuration's: D / block_d channel blocks, num_warps warps, and
  # (chunk-parallel, but for the dw kernel) the segments as the third axis.
  segments = form == "chunked" and name != "dw"
  if (
    call["grid"][1] != d // cfg.block_d
    or call["num_warps"] != cfg.num_warps
    or (call["grid"][2] > 1) != segments
  ):
    raise RuntimeError(f"{op} {name}: grid {call['grid']}, not the {form} one of {cfg} at D = {d}")
  if kernel["threads"] != 32 * cfg.num_warps:
    raise RuntimeError(f"{op} {name}: {kernel['threads']} threads, not {cfg.num_warps} warps")
  info = ptxas_info[kernel["entry"]]
  return {
    "op": op,
    "form": form,
    "kernel": name,
    "block_t": cfg.block_t,
    "block_d": cfg.block_d,
    "num_warps": cfg.num_warps,
    "num_stages": cfg.num_stages,
    "channels": d,
    "dtype": dtype,
    "arch": arch.sm,
    "gpu": arch.target,
    "compiler": compiler,
    "ptx_target": ptx_target(kernel["ptx"]),
    **info,
    "shared_dynamic": kernel["shared_dynamic"],
    "shared_bytes": kernel["shared_dynamic"] + info["shared_static"],
    "shared_limit_default": limits["default"],
    "shared_limit_optin": limits["optin"],
    "grid": call["grid"],
  }


def _order(row: dict) -> tuple:
  """Rows by op, form, block (widest first), kernel (as ``KERNELS`` lists them, then
  ``TOTALS``), dtype, arch."""
  kernels = list(KERNELS[row["op"]].values()) + list(TOTALS.values())
  return (
    list(KERNELS).index(row["op"]),
    FORMS.index(row["form"]),
    -row["block_d"],
    kernels.index(row["kernel"]),
    DTYPES.index(row["dtype"]),
    [a.sm for a in ARCHS].index(row["arch"]),
  )


def cases() -> list[tuple[str, int, str, str]]:
  """(op, index in ``triton.CONFIGS``, dtype, form) of every measurement
  (``FORM_CONFIGS``), the costliest first (AFT-local's kernels, the chunk-parallel form, wider
  blocks), so that dealing them out in turn balances the shards."""
  return [
    (op, i, dtype, form)
    for op in sorted(KERNELS, key=lambda op: -len(KERNELS[op]))
    for form in reversed(FORMS)
    for i in FORM_CONFIGS[form]
    for dtype in DTYPES
  ]


def measure_cases(selected, route_check: bool = True, say=print, archs=None) -> dict:
  """``selected`` cases (``cases``) on the architectures named in ``archs`` (default every one
  of ``ARCHS``): rows (``_row``) and, with
  ``route_check``, the plugin's figures at ``_PLUGIN_CHECK_ARCH`` (``plugin_check``: how far
  the sm_75 route is from XLA's), ptxas running beside the compiles. Runs in
  ``deviceless.environment("cuda")``."""
  import jax

  from aft_jax.ops.pallas import triton

  jax.config.update("jax_enable_compilation_cache", False)  # a cache hit dumps nothing
  devices = {a.target: deviceless.devices(a.target)[0] for a in ARCHS if a.xla}
  devices.setdefault(_LOWER_ON, deviceless.devices(_LOWER_ON)[0])
  limits = {a.sm: shared_memory_limits(a.target) for a in ARCHS}
  (check,) = [dataclasses.replace(a, xla=False) for a in ARCHS if a.sm == _PLUGIN_CHECK_ARCH]
  chosen = [a for a in ARCHS if archs is None or a.sm in archs]
  pending = []  # (row arguments, shared-memory limits, future of ptxas' figures)
  pool = concurrent.futures.ThreadPoolExecutor(2)
  # ptxas -v reports every entry of a PTX module: a module that holds several of the kernels
  # is run once (sm_80 here: 59 runs for 64 kernels).
  ptxas_runs = {}

  def ptxas_of(ptx):
    if ptx not in ptxas_runs:
      ptxas_runs[ptx] = pool.submit(run_ptxas, ptx)
    return ptxas_runs[ptx]

  def lowered_on(target, op, d, dtype, form):
    device = devices[target]
    with jax.set_mesh(jax.sharding.Mesh([device], ("x",))):
      return jax.jit(program(op, form)).lower(*arguments(op, d, dtype, device))

  for op, i, dtype, form in selected:
    t0 = time.time()
    cfg = triton.CONFIGS[i]
    d = channels_for(cfg)
    lowerings = {}  # target -> the case lowered for it, each lowered once and only if asked

    def lowered_for(target):
      if target not in lowerings:
        lowerings[target] = lowered_on(target, op, d, dtype, form)
      return lowerings[target]

    calls = []
    for arch in (*chosen, check) if route_check else chosen:
      if arch.xla:
        lowered = lowered_for(arch.target)
        calls = triton_calls(lowered.compiler_ir("stablehlo"))
        pairs = match(calls, xla_kernels(lowered))
        compiler = "xla"
      else:
        # jaxlib's Triton takes the custom calls' IR as lowered for _LOWER_ON.
        calls = triton_calls(lowered_for(_LOWER_ON).compiler_ir("stablehlo"))
        pairs = [(c, plugin_kernel(c, arch)) for c in calls]
        compiler = "triton (jaxlib)" + (", check" if arch is check else "")
      # The forward program and the VJP's forward may hold the same totals kernel twice.
      seen = set()
      for call, kernel in pairs:
        if (label(op, call), call["results"]) in seen:
          continue
        seen.add((label(op, call), call["results"]))
        args = (op, form, call, cfg, d, dtype, arch, compiler, kernel)
        pending.append((args, limits[arch.sm], ptxas_of(kernel["ptx"])))
    say(
      f"  {op} {form} block_d {cfg.block_d} {dtype}: {len(calls)} kernels, {time.time() - t0:.1f} s"
    )
    sys.stdout.flush()
  rows, plugin_check = [], []
  for args, lim, future in pending:
    row = _row(*args, future.result(), lim)
    (plugin_check if row["compiler"].endswith("check") else rows).append(row)
  pool.shutdown()
  return {"rows": rows, "plugin_check": plugin_check}


def measure(workers: int | None = None, route_check: bool = True, say=print, archs=None) -> dict:
  """Every case (``cases``) on ``archs`` (default every architecture; ``measure_cases``), dealt
  out to
  ``workers`` processes (default: one per core; much of a compile is single-threaded, so one
  process leaves cores idle)."""
  workers = max(1, min(workers or os.cpu_count() or 1, len(cases())))
  if workers == 1:
    result = measure_cases(cases(), route_check, say, archs)
  else:
    with tempfile.TemporaryDirectory() as tmp:
      procs = [
        subprocess.Popen(
          [
            sys.executable,
            "-m",
            "benchmarks.kernel_resources",
            "--out",
            tmp,
            "--shard",
            f"{i}/{workers}",
            *([] if route_check else ["--no_route_check"]),
            *(["--archs", *archs] if archs else []),
          ]
        )
        for i in range(workers)
      ]
      if any(p.wait() for p in procs):
        raise RuntimeError("a measurement worker failed (its error is printed above)")
      result = {"rows": [], "plugin_check": []}
      for i in range(workers):
        with open(os.path.join(tmp, f"shard-{i}.json")) as f:
          shard = json.load(f)
        for key in result:
          result[key] += shard[key]
  return {key: sorted(rows, key=_order) for key, rows in result.items()}


# --------------------------------------------------------------------------- the report


def _kib(b: int) -> str:
  return f"{b / 1024:g} KiB"


def headline(rows: list[dict]) -> list[str]:
  """Per architecture: the most registers, the spills and the most shared memory."""
  out = []
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
      spills = (
        f"{len(spilled)} kernel{'s' * (len(spilled) > 1)} spilling (most: {worst['op']} "
        f"{worst['form']} {worst['kernel']}, block_d {worst['block_d']}, {worst['dtype']}: "
        f"{worst['spill_stores']} B stored, {worst['spill_loads']} B loaded)"
      )
    out.append(
      f"{arch.sm} ({arch.target}, {rs[0]['compiler']}): at most {top['registers']} registers "
      f"({top['op']} {top['form']} {top['kernel']}, block_d {top['block_d']}, {top['dtype']}), "
      f"{spills}, at "
      f"most {_kib(big['shared_bytes'])} shared memory per block (limit "
      f"{_kib(big['shared_limit_default'])} default, {_kib(big['shared_limit_optin'])} opt-in)"
    )
  return out


def compact_table(rows: list[dict]) -> list[str]:
  """One line per (op, kernel, block_d): registers float32/bfloat16 and shared memory per
  architecture (spills are in the headline and the full table)."""
  key = lambda r: (r["op"], r["form"], r["kernel"], r["block_d"])
  by = {(key(r), r["arch"], r["dtype"]): r for r in rows}
  archs = [a.sm for a in ARCHS if any(r["arch"] == a.sm for r in rows)]
  head = ["op", "form", "kernel", "block (t x d)"]
  head += [f"{a} regs f32 / bf16" for a in archs] + [f"{a} smem f32 / bf16" for a in archs]
  lines = ["| " + " | ".join(head) + " |", "|---|---|---|---|" + "---:|" * (2 * len(archs))]
  seen = []
  for r in rows:
    if key(r) not in seen:
      seen.append(key(r))
  for k in seen:
    cells = [*k[:3], f"{by[(k, archs[0], DTYPES[0])]['block_t']} x {k[3]}"]
    for field, fmt in (("registers", str), ("shared_bytes", _kib)):
      for a in archs:
        cells.append(" / ".join(fmt(by[(k, a, dt)][field]) for dt in DTYPES))
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def full_table(rows: list[dict]) -> list[str]:
  head = (
    "| op | form | kernel | block (t x d, warps, stages) | dtype | arch | compiler | registers | "
    "spill stores / loads (B) | shared memory | limit per block (default / opt-in) |"
  )
  lines = [head, "|---|---|---|---|---|---|---|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
      f"| {r['op']} | {r['form']} | {r['kernel']} | {r['block_t']} x {r['block_d']}, "
      f"{r['num_warps']}, {r['num_stages']} | {r['dtype']} | {r['arch']} | {r['compiler']} | "
      f"{r['registers']} | "
      f"{r['spill_stores']} / {r['spill_loads']} | {_kib(r['shared_bytes'])} | "
      f"{_kib(r['shared_limit_default'])} / {_kib(r['shared_limit_optin'])} |"
    )
  return lines


def route_gap(result: dict) -> str:
  """How far the plugin's Triton compile (the sm_75 route) is from XLA's at the check arch."""
  xla = {
    (r["op"], r["form"], r["kernel"], r["block_d"], r["dtype"]): r["registers"]
    for r in result["rows"]
    if r["arch"] == _PLUGIN_CHECK_ARCH
  }
  diffs = [
    r["registers"] - xla[(r["op"], r["form"], r["kernel"], r["block_d"], r["dtype"])]
    for r in result["plugin_check"]
  ]
  if not diffs:
    return ""
  return (
    f"jaxlib's Triton compile (the sm_75 route) against XLA's at {_PLUGIN_CHECK_ARCH}: "
    f"{min(diffs):+d} to {max(diffs):+d} registers per kernel."
  )


def markdown(result: dict) -> str:
  meta = result["meta"]
  rows = result["rows"]
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
    *[f"- {line}" for line in headline(rows) + [route_gap(result)] if line],
    "",
    *compact_table(rows),
    "",
    *full_table(rows),
    "",
  ]
  return "\n".join(lines)


# --------------------------------------------------------------------------- the command


def child_environment() -> dict:
  """``deviceless.environment("cuda")`` without XLA_FLAGS and the persistent compilation
  cache (module docstring)."""
  base = {
    k: v
    for k, v in os.environ.items()
    if k != "XLA_FLAGS" and not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
  }
  return deviceless.environment("cuda", base=base)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=os.path.join("benchmarks", "results"))
  p.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
  p.add_argument(
    "--no_route_check",
    action="store_true",
    help="skip compiling with jaxlib's Triton for sm_80 too (the comparison with XLA's build)",
  )
  p.add_argument(
    "--archs",
    nargs="+",
    choices=[a.sm for a in ARCHS],
    default=None,
    help="only these architectures (default: all; the committed table has all)",
  )
  # Internal: one worker's share of the cases (i/n), written to OUT/shard-i.json.
  p.add_argument("--shard", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if os.environ.get(deviceless.CHILD_ENV) != "cuda":
    for kind in ("cuda", "ptxas"):
      deviceless.install(kind)
    argv = sys.argv[1:] if argv is None else list(argv)
    cmd = [sys.executable, "-m", "benchmarks.kernel_resources", *argv]
    sys.stdout.flush()
    os.execve(sys.executable, cmd, child_environment())
  if args.shard:
    i, n = map(int, args.shard.split("/"))
    shard = measure_cases(cases()[i::n], not args.no_route_check, archs=args.archs)
    files.atomic_write(os.path.join(args.out, f"shard-{i}.json"), json.dumps(shard) + "\n")
    return 0
  import jax
  import jaxlib

  t0 = time.time()
  archs = args.archs or [a.sm for a in ARCHS]
  print(f"Compiling every kernel configuration for {', '.join(archs)} (no GPU needed)")
  result = measure(args.workers, not args.no_route_check, archs=args.archs)
  result["meta"] = {
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "ptxas": ptxas_version(),
    "batch": BATCH,
    "t_len": T_LEN,
    "window": WINDOW,
    "wall_s": round(time.time() - t0, 1),
  }
  md = markdown(result)
  os.makedirs(args.out, exist_ok=True)
  files.atomic_write(
    os.path.join(args.out, "kernel_resources.json"), json.dumps(result, indent=1) + "\n"
  )
  files.atomic_write(os.path.join(args.out, "kernel_resources.md"), md)
  print("\n".join(headline(result["rows"])))
  print(f"wrote {args.out}/kernel_resources.{{json,md}} in {time.time() - t0:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
