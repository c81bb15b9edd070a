"""Every kernel configuration fits each architecture's shared memory and registers: the committed
``benchmarks.kernel_resources`` figures, of today's kernels, and a compile now that gives them."""

import glob
import json
import os
import re
import sys

import pytest

from aft_jax import deviceless
from aft_jax.ops.pallas import triton
from benchmarks import kernel_resources
from tests.support import prefork
from tests.support.helpers import ROOT

# Spill bytes allowed per kernel: today's and a word or two (docs/kernels.md, "Kernel resources").
SPILL_ALLOWANCE = {"sm_75": 16, "sm_80": 48, "sm_90": 48}
# The kernels per (op, configuration, dtype, architecture); the chunk-parallel form adds the totals.
KERNELS = {"aft_simple": {"fwd", "fwd+lse", "bwd"}, "aft_local": {"fwd", "fwd+lse", "bwd", "dw"},
           "aft_decay": {"fwd", "fwd+lse", "bwd"}}  # (sequential only)  # fmt: skip
TOTALS = {"totals k, v", "totals L, g, a"}
# Configurations per form: sequential every one, chunk-parallel the widest (plan_for's).
FORM_CONFIGS = {"sequential": set(triton.CONFIGS), "chunked": {triton.CONFIGS[0]}}
DTYPES = ("float32", "bfloat16")


def spec_limits() -> dict[str, dict[str, int]]:
  """Per architecture, the smallest limits over ``aft_jax/gpu_specs``."""
  out = {}
  for path in glob.glob(os.path.join(ROOT, "aft_jax", "gpu_specs", "*.txtpb")):
    text = open(path).read()
    # Text format leaves out a zero field (an A100's minor: 0).
    block = re.search(r"cuda_compute_capability\s*{([^}]*)}", text).group(1)
    version = [re.search(rf"{part}:\s*(\d+)", block) for part in ("major", "minor")]
    arch = "sm_" + "".join(m.group(1) if m else "0" for m in version)
    for field in ("shared_memory_per_block_optin", "registers_per_block_limit"):
      value = int(re.search(rf"\b{field}:\s*(\d+)", text).group(1))
      out.setdefault(arch, {})[field] = min(value, out.get(arch, {}).get(field, value))
  return out


def test_the_committed_table_renders_from_its_json_for_any_architectures():
  """The committed .md renders from the .json; without sm_80 rows, no compiler comparison."""
  results = os.path.join(ROOT, "benchmarks", "results", "kernel_resources")
  result = json.load(open(f"{results}.json"))
  assert kernel_resources.markdown(result) == open(f"{results}.md").read()
  result["rows"] = [r for r in result["rows"] if r["arch"] == "sm_90"]
  md = kernel_resources.markdown(result)
  assert "sm_75 route" not in md and "| sm_90 regs f32 / bf16 |" in md


COMMITTED = os.path.join(ROOT, "benchmarks", "results", "kernel_resources.json")
# The fields a compile gives (the rest: the case, the compiler, the limits).
FIGURES = ("registers", "spill_stores", "spill_loads", "stack_frame", "shared_bytes", "grid")
_case = lambda r: (r["op"], r["form"], r["kernel"], r["block_t"], r["block_d"], r["num_warps"],
                   r["num_stages"], r["dtype"], r["arch"])  # fmt: skip


def test_the_committed_figures_are_of_todays_kernels_and_fit_every_architecture():
  """Every kernel of every configuration, once, on each architecture, within its shared memory,
  registers and SPILL_ALLOWANCE; measured from the kernels' sources as they are now."""
  result = json.load(open(COMMITTED))
  assert result["meta"]["sources"] == kernel_resources.source_digest(), (
    "aft_jax/ops/pallas changed since benchmarks/results/kernel_resources.json was written: run "
    "python -m benchmarks.kernel_resources --out benchmarks/results"
  )
  rows = result["rows"]
  expected = {
    (op, form, kernel, tuple(cfg), dtype, arch)
    for form, configs in FORM_CONFIGS.items()
    for op in KERNELS
    if form == "sequential" or op != "aft_decay"
    for kernel in KERNELS[op] | (TOTALS if form == "chunked" else set())
    for cfg in configs
    for dtype in DTYPES
    for arch in SPILL_ALLOWANCE
  }
  cfg = lambda r: (r["block_t"], r["block_d"], r["num_warps"], r["num_stages"])
  got = [(r["op"], r["form"], r["kernel"], cfg(r), r["dtype"], r["arch"]) for r in rows]
  assert len(got) == len(expected) and set(got) == expected

  limits = spec_limits()
  too_big, spilled = [], []
  for r in rows:
    name = f"{r['op']} {r['form']} {r['kernel']} block_d {r['block_d']} {r['dtype']} {r['arch']}"
    lim = limits[r["arch"]]
    threads = 32 * r["num_warps"]
    if r["shared_bytes"] > lim["shared_memory_per_block_optin"]:
      too_big.append(f"{name}: {r['shared_bytes']} B shared memory")
    if r["registers"] * threads > lim["registers_per_block_limit"]:
      too_big.append(f"{name}: {r['registers']} registers x {threads} threads")
    if max(r["spill_stores"], r["spill_loads"]) > SPILL_ALLOWANCE[r["arch"]]:
      spilled.append(f"{name}: {r['spill_stores']} B stored, {r['spill_loads']} B loaded")
  assert not too_big, too_big
  assert not spilled, f"spills beyond SPILL_ALLOWANCE: {spilled}"


@pytest.mark.slow
def test_a_compile_now_gives_the_committed_figures(tmp_path):
  """AFT-simple's kernels, float32, compiled for sm_80 now: the committed rows, figure by figure."""
  missing = [kind for kind in ("cuda", "ptxas") if not deviceless.installed(kind)]
  need = " and ".join(missing)
  assert not missing, (
    f"compiling for a GPU without one needs aft_jax.deviceless' {need} packages: run python -m "
    "aft_jax.deviceless install (or: python -m aft_jax.deviceless install cuda ptxas)"
  )
  # No comparison of compilers; one process compiles every case (ptxas on a second thread).
  cmd = [sys.executable, "-m", "benchmarks.kernel_resources", "--out", str(tmp_path)]
  flags = ["--no_route_check", "--workers", "1", "--archs", "sm_80", "--ops", "aft_simple"]
  done = prefork.run([*cmd, *flags, "--dtypes", "float32"], cwd=ROOT, capture_output=True,
                     text=True, timeout=600)  # fmt: skip
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  with open(tmp_path / "kernel_resources.json") as f:
    rows = json.load(f)["rows"]
  committed = {_case(r): r for r in json.load(open(COMMITTED))["rows"]}
  want = [c for c in committed if (c[0], c[-2], c[-1]) == ("aft_simple", "float32", "sm_80")]
  assert sorted(map(_case, rows)) == sorted(want)
  for r in rows:
    assert {f: r[f] for f in FIGURES} == {f: committed[_case(r)][f] for f in FIGURES}, _case(r)
