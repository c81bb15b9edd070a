"""python -m tests.support.deviceless_worker cuda|tpu, in ``deviceless.environment(KIND)``: one
JSON object of what XLA made of each program (tests/test_deviceless.py asserts on it)."""

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
from aft_jax.ops import common, simple
from aft_jax.ops.pallas import triton
from aft_jax.trainer import train_lib
from aft_jax.trainer.default_config import get_config as default_config
from aft_jax.trainer.run_config import RunConfig
from configs import quickstart
from tests.support.helpers import ROOT, TRITON, equations

MOSAIC = 'custom_call_target="tpu_custom_call"'  # a Pallas TPU kernel in compiled HLO
# A Triton call's line in compiled HLO: its grid, then (after the kernel's IR) its name.
_TRITON_CALL = re.compile(
  r"custom_call_target=\"" + re.escape(TRITON) + r"\".*grid_x = (\d+) : i32, grid_y = (\d+) : "
  r"i32, grid_z = (\d+) : i32.*name = \"(\w+)\", num_stages"
)
# sm_75 (XLA refuses Triton: lowered only) and sm_90; sm_80: tests/ops/test_kernel_resources.py.
GPUS = ("t4", "h100")
LOWER_ONLY = ("t4",)
T_GPU = 32  # two 16-row chunks: the kernels' carries between chunks are compiled too
WINDOWS = (5, 24)  # AFT-local: slabs of one and of two key blocks before a chunk's own
TPU_SHAPE = (1, 16384, 512)  # B, T, D: a long sequence, where the TPU kernel's memory tells
TPU_TARGETS = ("v5e", "v6e")
# AFT-local's T4 step is the notebook's, its H100 step tests/trainer/test_dry_run.py's.
TRAIN_STEP_MIXINGS = {
  "t4": ("aft_full", "aft_simple", "aft_conv1d", "softmax"),
  "h100": ("aft_simple",),
}
# XLA compiles with the GIL released; tracing and lowering one at a time (MLIR's bindings failed
# with two threads at once).
_POOL = concurrent.futures.ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2)))
_TRACING = threading.RLock()


def _attempt(fn) -> dict:
  try:
    return {"ok": True, **fn()}
  except Exception as e:  # noqa: BLE001 (XLA's errors share no type; each is reported)
    lines = str(e).strip().splitlines() or [""]
    return {"ok": False, "error": f"{type(e).__name__}: " + "\n".join(lines[:6])[:2000]}


def _submit(fn) -> concurrent.futures.Future:
  return _POOL.submit(_attempt, fn)


@functools.cache
def _devices(name: str) -> list:
  return deviceless.devices(name, 1)


def _mesh(devices) -> Mesh:
  return Mesh(np.array(devices), ("x",))


def _specs(mesh, shapes, dtype):
  return [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, P())) for s in shapes]


def triton_calls(text: str) -> list:
  """[name, grid_x, grid_y, grid_z] of every Triton call in compiled HLO, sorted."""
  calls = []
  for line in text.splitlines():
    if TRITON in line:
      m = _TRITON_CALL.search(line)
      calls.append([m.group(4), *map(int, m.group(1, 2, 3))] if m else ["?", 0, 0, 0])
  return sorted(calls)


def jaxpr_kernels(fn, *args) -> list:
  """[kernel name, grid padded to 3] of every pallas_call in ``fn``'s jaxpr, sorted."""
  out = []
  for eqn in equations(jax.make_jaxpr(fn)(*args).jaxpr, "pallas_call"):
    grid = tuple(eqn.params["grid_mapping"].grid)
    name = eqn.params["jaxpr"].debug_info.func_src_info.split()[0]
    out.append([name, *(grid + (1,) * (3 - len(grid)))])
  return sorted(out)


def shape_for(cfg) -> tuple[int, int]:
  pairs = [(d, b) for d in range(16, 257, 16) for b in (2**i for i in range(9))]
  for d, b in sorted(pairs, key=lambda p: (p[0] * p[1], p[0])):
    if triton.unsupported_channels(d) is None and triton.config_for(d, b) == cfg:
      return d, b
  raise ValueError(f"no (D, batch) up to (256, 256) makes config_for choose {cfg}")


def kernel_cases() -> list[dict]:
  cases = []
  for mode in ("fwd", "grad"):
    for dtype in ("float32", "bfloat16"):
      for i, cfg in enumerate(triton.CONFIGS):
        d, b = shape_for(cfg)
        shape = {"d": d, "batch": b, "t": T_GPU, "dtype": dtype, "mode": mode}
        cases.append({"op": "aft_simple", "window": None, **shape})
        cases.append({"op": "aft_local", "window": WINDOWS[i % len(WINDOWS)], **shape})
        cases.append({"op": "aft_decay", "window": None, **shape})
  return cases


def representatives(cases) -> list[int]:
  """The k-th (op, mode, dtype) at configuration k mod len(CONFIGS): every kernel and config."""
  by_kind = {}
  for i, case in enumerate(cases):
    by_kind.setdefault((case["op"], case["mode"], case["dtype"]), []).append(i)
  return [idx[k % len(idx)] for k, idx in enumerate(by_kind.values())]


def _case_fn(case, impl: str):
  if case["op"] == "aft_simple":
    op = lambda q, k, v: ops.aft_simple(q, k, v, causal=True, impl=impl)
  elif case["op"] == "aft_decay":
    op = lambda q, k, v, decay: ops.aft_decay(q, k, v, decay, decay, impl=impl)
  else:
    op = lambda q, k, v, w: ops.aft_local(q, k, v, w, window=case["window"], causal=True, impl=impl)
  if case["mode"] == "fwd":
    return op
  n = 3 if case["op"] == "aft_simple" else 4
  return jax.grad(lambda *a: jnp.sum(op(*a).astype(jnp.float32)), argnums=tuple(range(n)))


def _case_args(case, mesh):
  qkv = _specs(mesh, [(case["batch"], case["t"], case["d"])] * 3, case["dtype"])
  w = {"aft_simple": [], "aft_local": [(case["t"],) * 2], "aft_decay": [(case["d"],)]}[case["op"]]
  return qkv + _specs(mesh, w, jnp.float32)


def _lower(fn, args, mesh):
  with _TRACING, jax.set_mesh(mesh):
    return jax.jit(fn).lower(*args)


def interpreted_kernels(case) -> list:
  host = _mesh(jax.devices("cpu")[:1])
  return jaxpr_kernels(_case_fn(case, "pallas_interpret"), *_case_args(case, host))


def gpu_kernels() -> dict:
  """Per GPU, the ``representatives`` in one program; per case its interpreted kernels."""
  cases = kernel_cases()
  mine = [cases[i] for i in representatives(cases)]

  def build(cs, mesh, compile_):
    fns, args = [_case_fn(c, "auto") for c in cs], [_case_args(c, mesh) for c in cs]
    lowered = _lower(lambda a: [f(*x) for f, x in zip(fns, a)], [args], mesh)
    return lowered.compile() if compile_ else lowered

  def compile_all(name):
    mesh, compile_ = _mesh(_devices(name)), name not in LOWER_ONLY
    res = _attempt(lambda: {"calls": triton_calls(build(mine, mesh, compile_).as_text())})
    return {**res, "cases": len(mine), "compiled": compile_}

  compiled = {name: _submit(functools.partial(compile_all, name)) for name in GPUS}
  with _TRACING:
    expected = [interpreted_kernels(c) for c in cases]
  return {"cases": cases, "expected": expected, "compiled": compiled}


def _facts(compiled) -> dict:
  text = compiled.as_text()
  temp = compiled.memory_analysis().temp_size_in_bytes
  return {"calls": triton_calls(text), "mosaic": text.count(MOSAIC), "temp_bytes": temp}


def build_and_compile(config, devices) -> dict:
  """The train step for ``devices``, built as aft-train builds it."""
  said = []
  with _TRACING:
    cfg = RunConfig.from_tree(config)
    trainer = train_lib.make_trainer(cfg, data_lib.vocab_size(cfg.data)[0], devices, said.append)
    lowered = trainer.lower_train_step()
  return {"impl": trainer.model.cfg.impl, "said": said, **_facts(lowered.compile())}


def quickstart_config(mixing: str):
  config = quickstart.get_config()
  config.model.mixing = mixing
  return config


def notebook_gpu_config():
  """notebooks/quickstart.ipynb's training cell on a GPU, from ``config = get_config()`` on."""
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
  config = notebook_gpu_config()
  out = {"model": config.model.to_dict(), "seq_len": config.seq_len}
  out["batch_size"] = config.batch_size
  out["t4"] = _submit(lambda: build_and_compile(config, _devices("t4")))  # Colab's free GPU
  return out


def decided() -> dict:
  """Per GPU, the kernel platform (None: XLA) ``resolve`` picks for the quickstart's AFT-simple."""
  channels, out = quickstart.get_config().model.d_model, {}
  for name in GPUS:
    device = ops.device_facts(_devices(name)[0])
    kernel = common.resolve(
      "aft_simple", "auto", simple.KERNELS, causal=True, channels=channels, device=device
    )
    out[name] = {"device": str(device), "kernel": kernel and kernel.platform}
  return out


def tpu_kernel() -> dict:
  """Causal AFT-simple at ``TPU_SHAPE``, impl "pallas" and "xla", forward and backward."""
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
          return {"jaxpr_kernels": kernels, **_facts(_lower(fn, args, mesh).compile())}

        out[name][f"{impl}_{mode}"] = _submit(facts)
  return out


def train_steps() -> dict:
  return {
    name: {
      m: _submit(functools.partial(build_and_compile, quickstart_config(m), _devices(name)))
      for m in mixings
    }  # fmt: skip
    for name, mixings in TRAIN_STEP_MIXINGS.items()
  }


def _resolve(tree):
  if isinstance(tree, concurrent.futures.Future):
    return tree.result()
  return {k: _resolve(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


ITEMS = {  # the longest first
  "cuda": (decided, notebook, gpu_kernels, train_steps),
  "tpu": (tpu_kernel,),
}


def main(kind: str) -> dict:
  """Every item's result, by its function's name: all jobs submitted, then collected."""
  out = {"kind": kind}
  for fn in ITEMS[kind]:
    out[fn.__name__] = _attempt(lambda: {"result": fn()})
  return _resolve(out)


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1]), default=str), flush=True)
  _POOL.shutdown()
