"""Compiles aft-jax for GPUs and TPUs that are not here (``aft_jax.deviceless``) and prints one
JSON object of what XLA made of each program; tests/test_deviceless.py asserts on it.

    python -m tests.support.deviceless_worker cuda|tpu   # in deviceless.environment(KIND)

It records facts and asserts nothing, so one broken item leaves the others reported: per
program its Pallas calls (Triton: name and grid; TPU: Mosaic calls), temp memory and errors, and
the Pallas calls each op's jaxpr holds (traced with the interpreted kernels). cuda: the kernel
matrix (``kernels``), ``impl="pallas"`` on a T4, the quickstart train steps, the notebook's GPU
model and what ``resolve`` decides per GPU; tpu: the AFT-simple kernel against the XLA path and
a train step with it.
"""

import concurrent.futures
import functools
import json
import os
import re
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from aft_jax import data as data_lib
from aft_jax import deviceless, ops
from aft_jax.trainer import train_lib
from aft_jax.trainer.default_config import get_config as default_config
from aft_jax.trainer.run_config import RunConfig
from aft_jax.ops import common, simple
from aft_jax.ops.pallas import triton
from configs import quickstart
from tests.support.helpers import ROOT, TRITON, equations

MOSAIC = 'custom_call_target="tpu_custom_call"'  # a Pallas TPU kernel in compiled HLO
# A Triton call's line in compiled HLO: its grid, then (after the kernel's IR) its name.
_TRITON_CALL = re.compile(
  r"custom_call_target=\"" + re.escape(TRITON) + r"\".*grid_x = (\d+) : i32, grid_y = (\d+) : "
  r"i32, grid_z = (\d+) : i32.*name = \"(\w+)\", num_stages"
)
# sm_75 (XLA refuses Triton) and sm_90; sm_80 compiles every case in
# tests/ops/test_kernel_resources.py. Here each GPU takes one case per op, mode and dtype
# (``representatives``), the configurations spread over them.
GPUS = ("t4", "h100")
# A T4's cases are lowered only (the XLA path: no Triton call is the check); its train steps
# below compile that path.
LOWER_ONLY = ("t4",)
T_GPU = 32  # two 16-row chunks: the kernels' carries between chunks are compiled too
WINDOWS = (5, 24)  # AFT-local: slabs of one and of two key blocks before a chunk's own
DTYPES = ("float32", "bfloat16")
TPU_SHAPE = (1, 16384, 512)  # B, T, D: a long sequence, where the TPU kernel's memory tells
TPU_TARGETS = ("v5e", "v6e")
# XLA compiles with the GIL released: jobs side by side use the cores.
THREADS = max(2, min(8, os.cpu_count() or 2))
# Tracing and lowering one job at a time: MLIR's Python bindings failed with two threads at once
# ("'nanobind.nb_static_property' object has no attribute 'context'").
_TRACING = threading.RLock()


def _error(e: BaseException) -> str:
  """An exception's type and first lines (XLA's messages run to pages)."""
  lines = str(e).strip().splitlines() or [""]
  return f"{type(e).__name__}: " + "\n".join(lines[:6])[:2000]


def _attempt(fn) -> dict:
  """``{"ok": True, **fn()}``, or ``{"ok": False, "error": ...}`` if it raised."""
  try:
    return {"ok": True, **fn()}
  except Exception as e:  # noqa: BLE001 (XLA's errors share no type; each is reported)
    return {"ok": False, "error": _error(e)}


def _raises(fn) -> dict:
  """What ``fn()`` raised ({"raised": type name, "message": ...}); raised None if nothing."""
  try:
    fn()
  except Exception as e:  # noqa: BLE001
    return {"raised": type(e).__name__, "message": str(e)}
  return {"raised": None, "message": ""}


def triton_calls(text: str) -> list:
  """[name, grid_x, grid_y, grid_z] of every Triton call in compiled HLO text, sorted (["?", 0,
  0, 0] where the pattern misses)."""
  calls = []
  for line in text.splitlines():
    if TRITON in line:
      m = _TRITON_CALL.search(line)
      calls.append([m.group(4), *map(int, m.group(1, 2, 3))] if m else ["?", 0, 0, 0])
  return sorted(calls)


def jaxpr_kernels(fn, *args) -> list:
  """[kernel name, grid (padded to 3 with 1s)] of every pallas_call in ``fn``'s jaxpr, sorted."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  out = []
  for eqn in equations(jaxpr, "pallas_call"):
    name = eqn.params["jaxpr"].debug_info.func_src_info.split()[0]
    grid = tuple(eqn.params["grid_mapping"].grid)
    out.append([name, *(grid + (1,) * (3 - len(grid)))])
  return sorted(out)


def _mesh(devices) -> Mesh:
  """A one-axis mesh: under ``jax.set_mesh`` the ops see its device kind."""
  return Mesh(np.array(devices), ("x",))


def _specs(mesh, shapes, dtype):
  """Replicated ShapeDtypeStructs on ``mesh``."""
  sharding_ = NamedSharding(mesh, P())
  return [jax.ShapeDtypeStruct(s, dtype, sharding=sharding_) for s in shapes]


def shape_for(cfg) -> tuple[int, int]:
  """The smallest (D, batch) for which ``config_for`` chooses ``cfg`` (a ValueError if none
  up to D 256, batch 256 does)."""
  pairs = sorted(
    ((d, b) for d in range(16, 257, 16) for b in (2**i for i in range(9))),
    key=lambda p: (p[0] * p[1], p[0]),
  )
  for d, b in pairs:
    if triton.unsupported_channels(d) is None and triton.config_for(d, b) == cfg:
      return d, b
  raise ValueError(f"no (D, batch) up to (256, 256) makes config_for choose {cfg}")


def kernel_cases() -> list[dict]:
  """Per mode and dtype, AFT-simple and AFT-local at the shapes that make ``config_for`` choose
  each of ``triton.CONFIGS``; AFT-local's window cycles through ``WINDOWS``."""
  cases = []
  for mode in ("fwd", "grad"):
    for dtype in DTYPES:
      for i, cfg in enumerate(triton.CONFIGS):
        d, b = shape_for(cfg)
        shape = {"d": d, "batch": b, "t": T_GPU, "dtype": dtype, "mode": mode}
        cases.append({"op": "aft_simple", "window": None, **shape})
        cases.append({"op": "aft_local", "window": WINDOWS[i % len(WINDOWS)], **shape})
  return cases


def _kind(case) -> tuple:
  return case["op"], case["mode"], case["dtype"]


def representatives(cases) -> list[int]:
  """The indices of the cases each GPU builds: the k-th (op, mode, dtype) at configuration
  k mod len(CONFIGS), so every kernel and every configuration is in them."""
  by_kind = {}
  for i, case in enumerate(cases):
    by_kind.setdefault(_kind(case), []).append(i)
  return [idx[k % len(idx)] for k, idx in enumerate(by_kind.values())]


def _case_fn(case, impl: str):
  """The case's op (causal), or for mode "grad" the gradient of its sum in every input."""
  if case["op"] == "aft_simple":
    op = lambda q, k, v: ops.aft_simple(q, k, v, causal=True, impl=impl)
  else:
    op = lambda q, k, v, w: ops.aft_local(q, k, v, w, window=case["window"], causal=True, impl=impl)
  if case["mode"] == "fwd":
    return op
  n = 3 if case["op"] == "aft_simple" else 4
  return jax.grad(lambda *a: jnp.sum(op(*a).astype(jnp.float32)), argnums=tuple(range(n)))


def _case_args(case, mesh):
  """The case's q, k, v ``[batch, t, d]`` in its dtype (and AFT-local's float32 w [t, t])."""
  qkv = _specs(mesh, [(case["batch"], case["t"], case["d"])] * 3, case["dtype"])
  if case["op"] == "aft_simple":
    return qkv
  return qkv + _specs(mesh, [(case["t"], case["t"])], jnp.float32)


def interpreted_kernels(case) -> list:
  """``jaxpr_kernels`` of ``case`` with the kernels interpreted on this host (they take the
  same configurations)."""
  host = _mesh(jax.devices("cpu")[:1])
  return jaxpr_kernels(_case_fn(case, "pallas_interpret"), *_case_args(case, host))


def _compile_cases(cases, mesh, impl="auto", compile_: bool = True):
  """One program holding every case (each compiles as it would alone), lowered and compiled
  (or with ``compile_=False`` only lowered)."""
  fns = [_case_fn(c, impl) for c in cases]
  args = [_case_args(c, mesh) for c in cases]
  with _TRACING, jax.set_mesh(mesh):
    lowered = jax.jit(lambda a: [f(*x) for f, x in zip(fns, a)]).lower(args)
  return lowered.compile() if compile_ else lowered


def gpu_kernels() -> dict:
  """The kernel matrix: per target, a job compiling the ``representatives`` in one program
  (where that fails, each alone, to name the failing ones); per case its jaxpr's kernels."""
  cases = kernel_cases()
  mine = [cases[i] for i in representatives(cases)]

  def compile_all(mesh, compile_):
    build = lambda cs: _compile_cases(cs, mesh, compile_=compile_)
    res = _attempt(lambda: {"calls": triton_calls(build(mine).as_text()), "compiled": compile_})
    res["cases"] = len(mine)
    if not res["ok"]:
      alone = [_attempt(lambda: (build([c]), {})[1]) for c in mine]
      res["failing_cases"] = [{**c, **r} for c, r in zip(mine, alone) if not r["ok"]]
    return res

  compiled = {
    name: _submit(functools.partial(compile_all, _mesh(_devices(name)), name not in LOWER_ONLY))
    for name in GPUS
  }
  with _TRACING:
    expected = [interpreted_kernels(c) for c in cases]
  return {"cases": cases, "expected": expected, "compiled": compiled}


def pallas_on_t4() -> dict:
  """What lowering each kernel op with impl "pallas" for a T4 raises."""
  mesh = _mesh(_devices("t4"))
  out = {}
  for op in ("aft_simple", "aft_local"):
    case = {"op": op, "d": 64, "batch": 1, "t": T_GPU, "window": WINDOWS[0]}
    case.update(dtype="float32", mode="fwd")
    fn, args = _case_fn(case, "pallas"), _case_args(case, mesh)

    def lower(fn=fn, args=args):
      with _TRACING, jax.set_mesh(mesh):
        jax.jit(fn).lower(*args)

    out[op] = _raises(lower)
  return out


def _step_facts(compiled) -> dict:
  """A compiled program's Triton calls, Mosaic call count and temp bytes."""
  text = compiled.as_text()
  return {
    "calls": triton_calls(text),
    "mosaic": text.count(MOSAIC),
    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
  }


def _made_trainer(config, devices):
  """(trainer, the lines it said) of ``train_lib.make_trainer`` for ``devices`` (as
  ``aft-train`` builds it); under ``_TRACING``."""
  said = []
  cfg = RunConfig.from_tree(config)
  vocab, _ = data_lib.vocab_size(cfg.data)
  return train_lib.make_trainer(cfg, vocab, devices, said.append), said


def build_and_compile(config, devices) -> dict:
  """The train step compiled for ``devices``: its impl, the lines said, the compiled facts."""
  with _TRACING:
    trainer, said = _made_trainer(config, devices)
    lowered = trainer.lower_train_step()
  return {"impl": trainer.model.cfg.impl, "said": said, **_step_facts(lowered.compile())}


def quickstart_config(mixing: str):
  """configs/quickstart.py with ``mixing`` and model.impl "auto"."""
  config = quickstart.get_config()
  config.model.mixing = mixing
  config.model.impl = "auto"
  return config


# The quickstart train steps compiled per GPU. AFT-local's T4 step is the notebook's below, its
# H100 step the one ``train.py --dry_run --target h100`` compiles in tests/trainer/test_dry_run.py.
TRAIN_STEP_MIXINGS = {
  "t4": ("aft_full", "aft_simple", "aft_conv1d", "softmax"),
  "h100": ("aft_simple",),
}
NOTEBOOK_GPUS = ("t4",)  # Colab's free GPU; the H100's kernels are the train steps' above


def train_steps() -> dict:
  return {
    name: {
      mixing: _submit(
        functools.partial(build_and_compile, quickstart_config(mixing), _devices(name))
      )
      for mixing in mixings
    }
    for name, mixings in TRAIN_STEP_MIXINGS.items()
  }


def notebook_gpu_config():
  """The config of notebooks/quickstart.ipynb's training cell on a GPU runtime: its lines from
  ``config = get_config()`` to the run config, run here (the cell builds its trainer with
  ``train_lib.make_trainer``, as ``build_and_compile`` does)."""
  with open(os.path.join(ROOT, "notebooks", "quickstart.ipynb")) as f:
    cells = json.load(f)["cells"]
  for cell in cells:
    src = "".join(cell["source"])
    if cell["cell_type"] == "code" and "config = get_config()" in src and "cfg = " in src:
      if "train_lib.make_trainer(" not in src:
        raise LookupError("notebooks/quickstart.ipynb: its trainer is not make_trainer's")
      start = src.index("config = get_config()")
      namespace = {"get_config": default_config, "ACCELERATOR": True, "QUICK": False}
      exec(src[start : src.index("cfg = ", start)], namespace)
      return namespace["config"]
  raise LookupError("notebooks/quickstart.ipynb: no cell sets config = get_config() and a cfg")


def notebook() -> dict:
  """The notebook's GPU model compiled for ``NOTEBOOK_GPUS``."""
  config = notebook_gpu_config()
  out = {"model": config.model.to_dict(), "seq_len": config.seq_len}
  out["batch_size"] = config.batch_size
  for name in NOTEBOOK_GPUS:
    out[name] = _submit(functools.partial(build_and_compile, config, _devices(name)))
  return out


def decided() -> dict:
  """Per GPU target, the kernel platform (None: XLA) that ``resolve`` picks with impl "auto"
  for the quickstart's causal AFT-simple, before anything is traced."""
  channels = quickstart.get_config().model.d_model
  out = {}
  for name in GPUS:
    device = ops.device_facts(_devices(name)[0])
    kernel = common.resolve(
      "aft_simple", "auto", simple.KERNELS, causal=True, channels=channels, device=device
    )
    out[name] = {"device": str(device), "kernel": kernel and kernel.platform}
  return out


def tpu_kernel() -> dict:
  """Causal AFT-simple at ``TPU_SHAPE`` bfloat16, impl "pallas" and "xla", forward and
  backward, per TPU target: the jaxpr's kernels, Mosaic calls and temp memory."""
  out = {"shape": TPU_SHAPE, "dtype": "bfloat16"}
  for name in TPU_TARGETS:
    mesh = _mesh(_devices(name))
    args = _specs(mesh, [TPU_SHAPE] * 3, out["dtype"])
    out[name] = {}
    for impl in ("pallas", "xla"):
      for mode in ("fwd", "grad"):
        fn = _case_fn({"op": "aft_simple", "mode": mode}, impl)

        def facts(fn=fn, mesh=mesh, args=args):
          with _TRACING, jax.set_mesh(mesh):
            kernels = jaxpr_kernels(fn, *args)
            lowered = jax.jit(fn).lower(*args)
          compiled = lowered.compile()
          return {"jaxpr_kernels": kernels, **_step_facts(compiled)}

        out[name][f"{impl}_{mode}"] = _submit(facts)
  return out


def tpu_train_step() -> dict:
  """The quickstart recipe with AFT-simple and impl "pallas", its train step for a v5e."""
  config = quickstart_config("aft_simple")
  config.model.impl = "pallas"
  return {
    "model": config.model.to_dict(),
    "step": _submit(lambda: build_and_compile(config, _devices("v5e"))),
  }


@functools.cache
def _devices(name: str) -> list:
  """One device of target ``name`` (made once, on the main thread)."""
  return deviceless.devices(name, 1)


_POOL = concurrent.futures.ThreadPoolExecutor(THREADS)


def _submit(fn) -> concurrent.futures.Future:
  return _POOL.submit(_attempt, fn)


def _resolve(tree):
  """``tree`` with every Future replaced by its result."""
  if isinstance(tree, concurrent.futures.Future):
    return tree.result()
  if isinstance(tree, dict):
    return {k: _resolve(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_resolve(v) for v in tree]
  return tree


def _targets(names) -> dict:
  """Each target's first device: its kind and (GPUs) compute capability."""
  out = {}
  for name in names:
    d = _devices(name)[0]
    cc = getattr(d, "compute_capability", None)
    out[name] = {"device_kind": d.device_kind, "compute_capability": str(cc) if cc else None}
  return out


def main(kind: str) -> dict:
  """Every item's result: all jobs submitted (the longest first), then collected."""
  if kind == "cuda":
    items = {
      "decided": decided,
      "notebook": notebook,
      "kernels": gpu_kernels,
      "train_steps": train_steps,
      "pallas_on_t4": pallas_on_t4,
    }
    names = GPUS
  elif kind == "tpu":
    items = {"train_step": tpu_train_step, "tpu_kernel": tpu_kernel}
    names = TPU_TARGETS
  else:
    raise SystemExit(f"usage: python -m tests.support.deviceless_worker cuda|tpu (got {kind!r})")
  out = {"kind": kind, "targets": _attempt(lambda: {"result": _targets(names)})}
  for name, fn in items.items():
    out[name] = _attempt(lambda: {"result": fn()})
  return _resolve(out)


if __name__ == "__main__":
  result = main(sys.argv[1] if len(sys.argv) > 1 else "")
  print(json.dumps(result, default=str), flush=True)
  _POOL.shutdown()
