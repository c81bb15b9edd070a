"""Compiling for GPUs and TPUs that are not here (``aft_jax.deviceless``), ``impl="auto"``
choosing right for each. The compiles run once per session in two processes (one per compiler
plugin, in ``deviceless.environment(kind)``: tests/support/deviceless_worker.py) side by side;
the tests assert on their JSON. A missing plugin fails them with its install command."""

import collections
import json
import math
import re
import subprocess
import sys

import pytest

from aft_jax import deviceless
from aft_jax.ops import common
from aft_jax.ops.pallas import mosaic_simple, triton, triton_local
from tests.support import shared
from tests.support.deviceless_worker import GPUS, LOWER_ONLY, TRAIN_STEP_MIXINGS, representatives
from tests.support.helpers import ROOT

pytestmark = pytest.mark.slow

# The CUDA worker needs ~3 CPU-minutes, the TPU one ~25 CPU-seconds; a hung compile must not
# hold CI for its whole job.
TIMEOUT_S = 900
KERNEL_MIXINGS = {"aft_local", "aft_simple"}  # the mixing layers with Pallas GPU kernels
MIXINGS = ("aft_full", "aft_local", "aft_simple", "aft_conv1d", "softmax")


def _run_workers(folder) -> dict:
  """{kind: the worker's JSON, or {"error": ...}}, both workers run at once."""
  procs, out = {}, {}
  try:
    for kind in ("cuda", "tpu"):
      try:
        env = deviceless.environment(kind)
      except RuntimeError as e:  # a missing plugin
        out[kind] = {"error": f"{e}\n(all of them at once: python -m aft_jax.deviceless install)"}
        continue
      if kind == "cuda":  # XLA's ptxas at -O0 (a fifth of the CPU at -O3): what is asserted is
        # decided before ptxas; registers and spills at -O3: tests/ops/test_kernel_resources.py
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_gpu_disable_gpuasm_optimizations"
      cmd = [sys.executable, "-m", "tests.support.deviceless_worker", kind]
      with open(folder / f"{kind}.stderr", "w") as err:
        procs[kind] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err)
    for kind, proc in procs.items():
      try:
        stdout = proc.communicate(timeout=TIMEOUT_S)[0].decode().strip().splitlines()
        out[kind] = json.loads(stdout[-1])
      except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError):
        proc.kill()
        proc.wait()
        tail = "\n".join((folder / f"{kind}.stderr").read_text().strip().splitlines()[-30:])
        out[kind] = {"error": f"{proc.args} exited with {proc.returncode}:\n{tail}"}
  finally:
    for proc in procs.values():
      proc.kill()
  return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return shared.once(tmp_path_factory, "deviceless", _run_workers)[1]


def _item(results: dict, kind: str, name: str):
  """The worker's result for ``name``; the test fails with the worker's error where it has one."""
  if "error" in results[kind]:
    pytest.fail(results[kind]["error"], pytrace=False)
  item = results[kind][name]
  if not item["ok"]:
    pytest.fail(f"the worker's {name!r} raised: {item['error']}", pytrace=False)
  return item["result"]


def _compiled(res: dict, what: str) -> dict:
  assert res["ok"], f"{what} did not compile: {res['error']}"
  return res


def _capability(name: str) -> tuple[int, int]:
  major, minor = re.search(r"sm_(\d+)(\d)\b", deviceless.get(name).description).groups()
  return int(major), int(minor)


def _takes_kernels(name: str) -> bool:
  return _capability(name) >= common.TRITON_MIN_CAPABILITY


def _expected_grid(kernel: str, batch: int, t: int, d: int) -> list[int]:
  """A kernel's grid under ``config_for``'s configuration (AFT-local's bias gradient: query
  chunks x ``dw_config``'s channel blocks)."""
  if kernel == "_dw_kernel":
    cfg = triton_local.dw_config(d)
    return [math.ceil(t / cfg.block_t), d // cfg.block_d, 1]
  return [batch, d // triton.config_for(d, batch).block_d, 1]


def _kernels_per_layer(kernels: dict, op: str) -> int:
  counts = {
    len(e)
    for c, e in zip(kernels["cases"], kernels["expected"])
    if c["op"] == op and c["mode"] == "grad"
  }
  assert len(counts) == 1, f"{op}: the forward+backward kernel count varies with shape: {counts}"
  return counts.pop()


def test_kernel_cases_cover_every_configuration(results):
  """Per op, mode and dtype the cases take every configuration, with its grids; a
  forward+backward holds more kernels than the forward."""
  kernels = _item(results, "cuda", "gpu_kernels")
  cases, expected = kernels["cases"], kernels["expected"]
  for op in ("aft_simple", "aft_local"):
    for mode in ("fwd", "grad"):
      for dtype in ("float32", "bfloat16"):
        mine = [c for c in cases if (c["op"], c["mode"], c["dtype"]) == (op, mode, dtype)]
        chosen = {triton.config_for(c["d"], c["batch"]) for c in mine}
        assert chosen == set(triton.CONFIGS), (op, mode, dtype, chosen)
  windows = {c["window"] for c in cases if c["op"] == "aft_local"}
  assert len(windows) >= 2 and max(windows) <= triton_local.MAX_WINDOW, windows
  count = {}  # kernels per (op, d, batch, window, dtype, mode)
  for case, kern in zip(cases, expected):
    for name, *grid in kern:
      assert grid == _expected_grid(name, case["batch"], case["t"], case["d"]), (case, name)
    count[tuple(case[k] for k in ("op", "d", "batch", "window", "dtype", "mode"))] = len(kern)
  for *key, mode in count:
    forward = count[(*key, "fwd")]
    assert forward >= 1 if mode == "fwd" else count[(*key, mode)] > forward, (key, mode, count)


@pytest.mark.parametrize("name", GPUS)
def test_every_kernel_configuration_compiles(results, name):
  """One program of one case per op, mode and dtype (``representatives``: every configuration)
  compiles for ``name`` with exactly the cases' kernels where impl="auto" takes them; for a T4
  it is lowered (``LOWER_ONLY``) and holds no Triton call."""
  targets = _item(results, "cuda", "targets")
  cc = targets[name]["compute_capability"]
  assert cc == "{}.{}".format(*_capability(name)), f"{name}: the topology's device is {cc}"
  kernels = _item(results, "cuda", "gpu_kernels")
  res = kernels["compiled"][name]
  assert res["ok"], (
    f"the kernel matrix did not compile for {name}: {res['error']}\nthe cases that fail "
    f"alone: {json.dumps(res.get('failing_cases'), indent=1)}"
  )
  assert res["compiled"] == (name not in LOWER_ONLY), name
  chosen = representatives(kernels["cases"])
  kinds = {(c["op"], c["mode"], c["dtype"]) for c in kernels["cases"]}
  assert res["cases"] == len(chosen) == len(kinds), res
  configs = {
    triton.config_for(kernels["cases"][i]["d"], kernels["cases"][i]["batch"]) for i in chosen
  }
  assert configs == set(triton.CONFIGS), configs
  want = [tuple(call) for i in chosen for call in kernels["expected"][i]]
  assert len(want) >= len(chosen)
  want = collections.Counter(want if _takes_kernels(name) else [])
  assert collections.Counter(tuple(c) for c in res["calls"]) == want, name


def test_pallas_for_a_t4_is_a_value_error_naming_its_capability(results):
  """An explicit impl="pallas" for a T4 is a ValueError naming its compute capability."""
  assert not _takes_kernels("t4")
  cc = "{}.{}".format(*_capability("t4"))
  for op, res in _item(results, "cuda", "pallas_on_t4").items():
    assert not res["ok"] and res["error"].startswith("ValueError: "), (op, res)
    assert f"compute capability {cc}" in res["error"] and op in res["error"], res


def _check_step(res: dict, name: str, model: dict, batch: int, seq_len: int, kernels: dict):
  """impl 'auto' kept, nothing said, one forward+backward kernel set per layer where impl="auto"
  takes the kernels, no Triton call elsewhere."""
  mixing = model["mixing"]
  what = f"{mixing} for {name}"
  res = _compiled(res, what)
  assert res["impl"] == "auto" and res["said"] == [], (what, res["impl"], res["said"])
  if _takes_kernels(name) and mixing in KERNEL_MIXINGS:
    assert len(res["calls"]) == model["num_layers"] * _kernels_per_layer(kernels, mixing), what
    for kernel, *grid in res["calls"]:
      assert grid == _expected_grid(kernel, batch, seq_len, model["d_model"]), what
  else:
    assert res["calls"] == [], what


@pytest.mark.parametrize("name", sorted(TRAIN_STEP_MIXINGS))
def test_quickstart_train_step_of_every_mixing_compiles(results, name):
  """configs/quickstart.py with model.impl="auto", built as aft-train builds it, compiles for a
  T4 with every mixing but AFT-local (the notebook's) and for an H100 with AFT-simple's kernels
  (AFT-local's: tests/trainer/test_dry_run.py)."""
  from configs import quickstart

  config = quickstart.get_config()
  steps = _item(results, "cuda", "train_steps")[name]
  kernels = _item(results, "cuda", "gpu_kernels")
  assert sorted(steps) == sorted(TRAIN_STEP_MIXINGS[name])
  # Every layer compiles for a T4 somewhere: AFT-local's step is the notebook's.
  notebook = _item(results, "cuda", "notebook")["model"]["mixing"]
  assert set(TRAIN_STEP_MIXINGS["t4"]) | {notebook} == set(MIXINGS)
  for mixing in TRAIN_STEP_MIXINGS[name]:
    model = {**config.model.to_dict(), "mixing": mixing}
    _check_step(steps[mixing], name, model, config.batch_size, config.seq_len, kernels)


def test_notebook_gpu_model_compiles_for_a_t4(results):
  """notebooks/quickstart.ipynb's GPU model (bfloat16, a mixing with kernels): no Triton call."""
  nb = _item(results, "cuda", "notebook")
  model = nb["model"]
  assert model["dtype"] == "bfloat16" and model["mixing"] in KERNEL_MIXINGS, model
  kernels = _item(results, "cuda", "gpu_kernels")
  _check_step(nb["t4"], "t4", model, nb["batch_size"], nb["seq_len"], kernels)


def test_auto_is_decided_for_the_device_before_compiling(results):
  """The ops' ``resolve``, asked before anything is traced, takes the Triton kernels exactly
  where XLA's rule allows them (an H100, not a T4), as the compiled train steps hold them."""
  decided = _item(results, "cuda", "decided")
  steps = _item(results, "cuda", "train_steps")
  assert sorted(decided) == sorted(GPUS), decided
  for name in GPUS:
    assert decided[name]["kernel"] == ("gpu" if _takes_kernels(name) else None), decided[name]
    assert "compute capability {}.{}".format(*_capability(name)) in decided[name]["device"]
    step = _compiled(steps[name]["aft_simple"], f"aft_simple for {name}")
    assert bool(step["calls"]) == (decided[name]["kernel"] is not None), (name, step["calls"])


@pytest.mark.parametrize("name", ["v5e", "v6e"])
def test_tpu_kernel_compiles_and_needs_less_memory_than_xla(results, name):
  """The Mosaic AFT-simple kernel at a long T compiles for ``name`` (forward, and backward) with
  its jaxpr's calls and grids, and less temp memory than the XLA path."""
  item = _item(results, "tpu", "tpu_kernel")
  assert item["shape"] == [1, 16384, 512] and item["dtype"] == "bfloat16", item
  res, (b, t, d) = item[name], item["shape"]
  cfg = mosaic_simple.config_for(d, b)
  count = {}
  for mode in ("fwd", "grad"):
    kernel = _compiled(res[f"pallas_{mode}"], f"the TPU kernel ({mode}) for {name}")
    xla = _compiled(res[f"xla_{mode}"], f"the XLA path ({mode}) for {name}")
    count[mode] = kernel["mosaic"]
    assert kernel["mosaic"] == len(kernel["jaxpr_kernels"]) >= 1, (name, mode, kernel)
    for _, *grid in kernel["jaxpr_kernels"]:
      assert grid == [b, d // cfg.block_d, t // cfg.block_t], (name, mode, grid)
    assert xla["mosaic"] == 0 and xla["jaxpr_kernels"] == [], (name, mode, xla)
    assert kernel["temp_bytes"] < xla["temp_bytes"], (name, mode)
  assert count["grad"] > count["fwd"], count


def test_tpu_lm_train_step_compiles_for_v5e(results):
  """The quickstart LM with AFT-simple, impl="pallas": one kernel set per layer, for a v5e."""
  res = _item(results, "tpu", "tpu_train_step")
  model = res["model"]
  assert model["mixing"] == "aft_simple" and model["impl"] == "pallas", model
  assert model["d_model"] % mosaic_simple.LANES == 0, model
  step = _compiled(res["step"], "the AFT-simple LM train step for v5e")
  per_layer = len(_item(results, "tpu", "tpu_kernel")["v5e"]["pallas_grad"]["jaxpr_kernels"])
  assert step["impl"] == "pallas" and step["mosaic"] == model["num_layers"] * per_layer, step
