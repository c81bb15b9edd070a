"""Compiling for GPUs and TPUs that are not here (``aft_jax.deviceless``), and ``impl="auto"``
choosing right for each: every kernel configuration, the quickstart train steps and the
notebook's GPU model for a T4 and an H100, ``resolve``'s choice before compiling, the TPU kernel
for a v5e and a v6e. Each platform's compiles run once per session in a subprocess
(tests/support/deviceless_worker.py, in ``deviceless.environment(kind)``), both side by side;
the tests assert on their JSON. A missing plugin fails them with its install command."""

import collections
import fcntl
import json
import math
import re
import subprocess
import sys
import time

import pytest

from aft_jax import deviceless
from aft_jax.ops import common
from aft_jax.ops.pallas import mosaic_simple, triton, triton_local
from tests.support.deviceless_worker import (
  LOWER_ONLY,
  NOTEBOOK_GPUS,
  TRAIN_STEP_MIXINGS,
  representatives,
)
from tests.support import shared
from tests.support.helpers import ROOT

pytestmark = pytest.mark.slow

# The CUDA worker needs ~3 CPU-minutes (threads: ~1.5 min on 2 free cores), the TPU one
# ~25 CPU-seconds; a hung compile must not hold CI for its whole job.
TIMEOUT_S = 900
GPUS = ("t4", "h100")  # sm_80: tests/ops/test_kernel_resources.py compiles every kernel for it
KERNEL_MIXINGS = {"aft_local", "aft_simple"}  # the mixing layers with Pallas GPU kernels
MIXINGS = ("aft_full", "aft_local", "aft_simple", "aft_conv1d", "softmax")
_FIXTURE = {"cuda": "cuda_results", "tpu": "tpu_results"}  # the fixture of each worker's JSON


def _start(kind: str, folder) -> dict:
  """The worker for ``kind`` started, or {"error": ...} where its plugin is missing."""
  try:
    env = deviceless.environment(kind)
  except RuntimeError as e:
    return {"error": f"{e}\n(all of them at once: python -m aft_jax.deviceless install)"}
  if kind == "cuda":
    # XLA's ptxas at -O0 (a fifth of the worker's CPU at -O3): what is asserted (Triton calls,
    # grids, temp memory, XLA's refusals) is decided before ptxas; the kernels' registers and
    # spills at -O3 are tests/ops/test_kernel_resources.py's.
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_gpu_disable_gpuasm_optimizations=true".strip()
  out, err = open(folder / f"{kind}.stdout", "w+"), open(folder / f"{kind}.stderr", "w+")
  cmd = [sys.executable, "-m", "tests.support.deviceless_worker", kind]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
  return {"proc": proc, "stdout": out, "stderr": err, "start": time.monotonic()}


def _wait(run: dict) -> dict:
  if "error" in run:
    return run
  proc = run["proc"]
  try:
    proc.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - run["start"])))
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
  run["stdout"].seek(0)
  run["stderr"].seek(0)
  lines = run["stdout"].read().strip().splitlines()
  stderr = run["stderr"].read()
  run["stdout"].close()
  run["stderr"].close()
  try:
    if proc.returncode == 0 and lines:
      return json.loads(lines[-1])
  except json.JSONDecodeError:
    pass
  tail = "\n".join(stderr.strip().splitlines()[-30:])
  return {"error": f"{proc.args} exited with {proc.returncode} (timeout {TIMEOUT_S} s):\n{tail}"}


class _Worker:
  """One platform's worker, run once per session: the first process to need it runs it under
  an exclusive lock and leaves its JSON in the shared folder; the others wait and read that."""

  def __init__(self, kind: str, folder):
    self.kind, self.folder = kind, folder
    self.path = folder / f"deviceless_{kind}.json"
    self.lock = open(folder / f"deviceless_{kind}.lock", "w")
    self.run = None
    try:
      fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      return  # another process runs it; results() waits for that
    if not self.path.exists():
      self.run = _start(kind, folder)

  def results(self) -> dict:
    if self.run is None:
      fcntl.flock(self.lock, fcntl.LOCK_EX)  # (re-entrant where this process holds it)
      if not self.path.exists():  # its runner died without a word: run it here
        self.run = _start(self.kind, self.folder)
    if self.run is not None:
      tmp = self.path.with_suffix(".tmp")
      tmp.write_text(json.dumps(_wait(self.run)))
      tmp.rename(self.path)  # whole, or not there: a waiter never reads half a file
      self.run = None
    fcntl.flock(self.lock, fcntl.LOCK_UN)
    return json.loads(self.path.read_text())

  def close(self, stopping: bool):
    """At the module's end: a worker whose results no test here asked for is waited for (other
    xdist processes may need them), or killed if the session is stopping."""
    if self.run is not None and "proc" in self.run:
      if stopping:
        self.run["proc"].kill()
        self.run["proc"].wait()
      else:
        self.results()
    self.lock.close()


@pytest.fixture(scope="module")
def workers(request, tmp_path_factory):
  """{kind: _Worker} of every platform a selected test needs, all started at once."""
  selected = [item for item in request.session.items if item.module is request.module]
  folder = shared.session_dir(tmp_path_factory)
  needed = [k for k, f in _FIXTURE.items() if any(f in item.fixturenames for item in selected)]
  started = {kind: _Worker(kind, folder) for kind in needed}
  yield started
  for worker in started.values():
    worker.close(stopping=bool(request.session.shouldstop or request.session.shouldfail))


@pytest.fixture(scope="module")
def cuda_results(workers):
  return workers["cuda"].results()


@pytest.fixture(scope="module")
def tpu_results(workers):
  return workers["tpu"].results()


def _item(results: dict, name: str):
  """The worker's result for ``name``; the test fails with the worker's error where it has one."""
  if "error" in results:
    pytest.fail(results["error"], pytrace=False)
  item = results[name]
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


def _counter(calls) -> collections.Counter:
  return collections.Counter(tuple(c) for c in calls)


def _kernels_per_layer(kernels: dict, op: str) -> int:
  counts = {
    len(e)
    for c, e in zip(kernels["cases"], kernels["expected"])
    if c["op"] == op and c["mode"] == "grad"
  }
  assert len(counts) == 1, f"{op}: the forward+backward kernel count varies with shape: {counts}"
  return counts.pop()


def test_kernel_cases_cover_every_configuration(cuda_results):
  """Per op, mode and dtype the cases take every configuration, with its grids; a
  forward+backward holds more kernels than the forward."""
  kernels = _item(cuda_results, "kernels")
  cases, expected = kernels["cases"], kernels["expected"]
  for op in ("aft_simple", "aft_local"):
    for mode in ("fwd", "grad"):
      for dtype in ("float32", "bfloat16"):
        mine = [c for c in cases if (c["op"], c["mode"], c["dtype"]) == (op, mode, dtype)]
        chosen = {triton.config_for(c["d"], c["batch"]) for c in mine}
        assert chosen == set(triton.CONFIGS), (op, mode, dtype, chosen)
  windows = {c["window"] for c in cases if c["op"] == "aft_local"}
  assert len(windows) >= 2 and max(windows) <= triton_local.MAX_WINDOW, windows
  forward = {}
  for case, kern in zip(cases, expected):
    for name, *grid in kern:
      assert grid == _expected_grid(name, case["batch"], case["t"], case["d"]), (case, name)
    key = tuple(case[k] for k in ("op", "d", "batch", "window", "dtype"))
    if case["mode"] == "fwd":
      assert len(kern) >= 1, f"{case}: no kernel in the jaxpr of impl='pallas_interpret'"
      forward[key] = len(kern)
  for case, kern in zip(cases, expected):
    if case["mode"] == "grad":
      key = tuple(case[k] for k in ("op", "d", "batch", "window", "dtype"))
      assert len(kern) > forward[key], f"{case}: the backward added no kernel"


@pytest.mark.parametrize("name", GPUS)
def test_every_kernel_configuration_compiles(cuda_results, name):
  """One program of one case per op, mode and dtype (``representatives``: every configuration)
  compiles for ``name`` with exactly the cases' kernels where impl="auto" takes them; for a T4
  it is lowered (``LOWER_ONLY``) and holds no Triton call."""
  targets = _item(cuda_results, "targets")
  cc = targets[name]["compute_capability"]
  assert cc == "{}.{}".format(*_capability(name)), f"{name}: the topology's device is {cc}"
  kernels = _item(cuda_results, "kernels")
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
  if _takes_kernels(name):
    want = _counter(call for i in chosen for call in kernels["expected"][i])
    assert sum(want.values()) >= len(chosen)
  else:
    want = collections.Counter()
  assert _counter(res["calls"]) == want, name


def test_pallas_for_a_t4_is_a_value_error_naming_its_capability(cuda_results):
  """An explicit impl="pallas" for a T4 is a ValueError naming its compute capability."""
  assert not _takes_kernels("t4")
  cc = "{}.{}".format(*_capability("t4"))
  for op, res in _item(cuda_results, "pallas_on_t4").items():
    assert res["raised"] == "ValueError", (op, res)
    assert f"compute capability {cc}" in res["message"] and op in res["message"], res


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
def test_quickstart_train_step_of_every_mixing_compiles(cuda_results, name):
  """configs/quickstart.py with model.impl="auto", built as aft-train builds it, compiles for a
  T4 with every mixing but AFT-local (the notebook's) and for an H100 with AFT-simple's kernels
  (AFT-local's: tests/trainer/test_dry_run.py)."""
  from configs import quickstart

  config = quickstart.get_config()
  steps = _item(cuda_results, "train_steps")[name]
  kernels = _item(cuda_results, "kernels")
  assert sorted(steps) == sorted(TRAIN_STEP_MIXINGS[name])
  # Every layer compiles for a T4 somewhere: AFT-local's step is the notebook's.
  notebook = _item(cuda_results, "notebook")["model"]["mixing"]
  assert set(TRAIN_STEP_MIXINGS["t4"]) | {notebook} == set(MIXINGS)
  for mixing in TRAIN_STEP_MIXINGS[name]:
    model = {**config.model.to_dict(), "mixing": mixing}
    _check_step(steps[mixing], name, model, config.batch_size, config.seq_len, kernels)


@pytest.mark.parametrize("name", NOTEBOOK_GPUS)
def test_notebook_gpu_model_compiles(cuda_results, name):
  """notebooks/quickstart.ipynb's GPU model compiles for a T4 without a Triton call."""
  nb = _item(cuda_results, "notebook")
  model = nb["model"]
  # The notebook's accelerator branch: bfloat16 compute, a model with AFT-local kernels.
  assert model["dtype"] == "bfloat16" and model["mixing"] in KERNEL_MIXINGS, model
  kernels = _item(cuda_results, "kernels")
  _check_step(nb[name], name, model, nb["batch_size"], nb["seq_len"], kernels)


def test_auto_is_decided_for_the_device_before_compiling(cuda_results):
  """The ops' ``resolve``, asked before anything is traced, takes the Triton kernels exactly
  where XLA's rule allows them (an H100, not a T4), as the compiled train steps hold them."""
  decided = _item(cuda_results, "decided")
  steps = _item(cuda_results, "train_steps")
  assert sorted(decided) == sorted(GPUS), decided
  for name in GPUS:
    assert decided[name]["kernel"] == ("gpu" if _takes_kernels(name) else None), decided[name]
    assert "compute capability {}.{}".format(*_capability(name)) in decided[name]["device"]
    step = _compiled(steps[name]["aft_simple"], f"aft_simple for {name}")
    assert bool(step["calls"]) == (decided[name]["kernel"] is not None), (name, step["calls"])


@pytest.mark.parametrize("name", ["v5e", "v6e"])
def test_tpu_kernel_compiles_and_needs_less_memory_than_xla(tpu_results, name):
  """The Mosaic AFT-simple kernel at a long T compiles for ``name`` (forward, and backward) with
  its jaxpr's calls and grids, and less temp memory than the XLA path."""
  item = _item(tpu_results, "tpu_kernel")
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


def test_tpu_lm_train_step_compiles_for_v5e(tpu_results):
  """The quickstart LM with AFT-simple, impl="pallas": one kernel set per layer, for a v5e."""
  res = _item(tpu_results, "train_step")
  model = res["model"]
  assert model["mixing"] == "aft_simple" and model["impl"] == "pallas", model
  assert model["d_model"] % mosaic_simple.LANES == 0, model
  step = _compiled(res["step"], "the AFT-simple LM train step for v5e")
  per_layer = len(_item(tpu_results, "tpu_kernel")["v5e"]["pallas_grad"]["jaxpr_kernels"])
  assert step["impl"] == "pallas" and step["mosaic"] == model["num_layers"] * per_layer, step
