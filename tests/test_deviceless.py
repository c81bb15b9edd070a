"""Compiling for GPUs and TPUs that are not here (``aft_jax.deviceless``), ``impl="auto"`` right
for each: two workers (tests/support/deviceless_worker.py) compile once per session."""

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

TIMEOUT_S = 900  # the CUDA worker needs ~3 CPU-minutes: a hung compile must not hold CI
KERNEL_MIXINGS = {"aft_local", "aft_simple"}  # the mixing layers with Pallas GPU kernels
MIXINGS = ("aft_full", "aft_local", "aft_simple", "aft_conv1d", "softmax")


def _run_workers(folder) -> dict:
  procs, out = {}, {}
  try:
    for kind in ("cuda", "tpu"):
      try:
        env = deviceless.environment(kind)
      except RuntimeError as e:  # a missing plugin
        out[kind] = {"error": f"{e}\n(all of them at once: python -m aft_jax.deviceless install)"}
        continue
      if kind == "cuda":  # ptxas at -O0 (a fifth of the CPU); -O3: test_kernel_resources.py
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_gpu_disable_gpuasm_optimizations"
      cmd = [sys.executable, "-m", "tests.support.deviceless_worker", kind]
      with open(folder / f"{kind}.stderr", "w") as err:
        procs[kind] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err)
    for kind, proc in procs.items():
      try:
        stdout = proc.communicate(timeout=TIMEOUT_S)[0].decode().strip().splitlines()
        out[kind] = json.loads(stdout[-1])
      except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError):
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
  return tuple(map(int, re.search(r"sm_(\d+)(\d)\b", deviceless.get(name).description).groups()))


def _takes_kernels(name: str) -> bool:
  return _capability(name) >= common.TRITON_MIN_CAPABILITY


def _expected_grid(kernel: str, batch: int, t: int, d: int) -> list[int]:
  """A kernel's grid under ``config_for`` (AFT-local's bias gradient: ``dw_config``'s)."""
  if kernel == "_dw_kernel":
    cfg = triton_local.dw_config(d)
    return [math.ceil(t / cfg.block_t), d // cfg.block_d, 1]
  return [batch, d // triton.config_for(d, batch).block_d, 1]


def _kernels_per_layer(kernels: dict, op: str) -> int:
  cases = zip(kernels["cases"], kernels["expected"])
  (count,) = {len(e) for c, e in cases if (c["op"], c["mode"]) == (op, "grad")}  # any shape's
  return count


def test_kernel_cases_cover_every_configuration(results):
  kernels = _item(results, "cuda", "gpu_kernels")
  cases, expected = kernels["cases"], kernels["expected"]
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
  """``representatives`` in one program, with exactly their kernels where "auto" takes them."""
  kernels = _item(results, "cuda", "gpu_kernels")
  cases, res = kernels["cases"], kernels["compiled"][name]
  assert res["ok"], res["error"]
  assert res["compiled"] == (name not in LOWER_ONLY), name
  chosen = representatives(cases)
  assert res["cases"] == len(chosen) == len({(c["op"], c["mode"], c["dtype"]) for c in cases})
  mine = [cases[i] for i in chosen]
  assert {triton.config_for(c["d"], c["batch"]) for c in mine} == set(triton.CONFIGS)
  want = [tuple(call) for i in chosen for call in kernels["expected"][i]]
  want = collections.Counter(want if _takes_kernels(name) else [])
  assert collections.Counter(tuple(c) for c in res["calls"]) == want, name


def _check_step(res: dict, name: str, model: dict, batch: int, seq_len: int, kernels: dict):
  """impl 'auto' kept, nothing said, a kernel set per layer where "auto" takes them, else none."""
  mixing, what = model["mixing"], f"{model['mixing']} for {name}"
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
  from configs import quickstart

  config = quickstart.get_config()
  steps = _item(results, "cuda", "train_steps")[name]
  kernels = _item(results, "cuda", "gpu_kernels")
  # Every layer compiles for a T4 somewhere: AFT-local's step is the notebook's.
  notebook = _item(results, "cuda", "notebook")["model"]["mixing"]
  assert set(TRAIN_STEP_MIXINGS["t4"]) | {notebook} == set(MIXINGS)
  for mixing in TRAIN_STEP_MIXINGS[name]:
    model = {**config.model.to_dict(), "mixing": mixing}
    _check_step(steps[mixing], name, model, config.batch_size, config.seq_len, kernels)


def test_notebook_gpu_model_compiles_for_a_t4(results):
  nb = _item(results, "cuda", "notebook")
  model = nb["model"]
  assert model["dtype"] == "bfloat16" and model["mixing"] in KERNEL_MIXINGS, model
  kernels = _item(results, "cuda", "gpu_kernels")
  _check_step(nb["t4"], "t4", model, nb["batch_size"], nb["seq_len"], kernels)


def test_auto_is_decided_for_the_device_before_compiling(results):
  decided = _item(results, "cuda", "decided")
  steps = _item(results, "cuda", "train_steps")
  for name in GPUS:
    assert decided[name]["kernel"] == ("gpu" if _takes_kernels(name) else None), decided[name]
    assert "compute capability {}.{}".format(*_capability(name)) in decided[name]["device"]
    step = _compiled(steps[name]["aft_simple"], f"aft_simple for {name}")
    assert bool(step["calls"]) == (decided[name]["kernel"] is not None), (name, step["calls"])


@pytest.mark.parametrize("name", ["v5e", "v6e"])
def test_tpu_kernel_compiles_and_needs_less_memory_than_xla(results, name):
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
