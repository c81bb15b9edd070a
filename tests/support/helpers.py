"""Helpers shared by the tests: the repository root, XLA's flags, a tiny training config and its
command line, abstract targets and jaxpr searches for the ops."""

import functools
import glob
import os

# jax is imported inside the helpers: conftest imports this module before it sets the
# environment (the compilation cache) that jax reads when it is first imported.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# XLA's flags for the tests' tiny programs (tests/conftest.py sets them for the session and the
# processes it starts): backend optimisations, the CPU fusion emitters (the older ones compile
# the same fusions) and a program split over threads cost more compile time than they save.
FAST_COMPILE = (
  "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
  "--xla_cpu_parallel_codegen_split_count=1"
)


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process with ``devices`` simulated CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


# Real text no one here wrote: the standard library's json package (5 files, ~48 KB).
STDLIB_JSON = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "json", "*.py")))


def tiny_config(**overrides):
  """The quickstart recipe shrunk to one small layer; ``overrides`` use dotted keys."""
  from aft_jax.trainer.default_config import get_config, override

  config = get_config()
  config.data.dataset = "pydoc"
  config.data.tokenizer = "byte"
  m = config.model
  m.mixing, m.num_layers, m.d_model, m.num_heads, m.mlp_dim = "aft_local", 1, 16, 2, 32
  m.max_len, m.window, m.kernel_size, m.dropout_rate = 32, 4, 3, 0.1
  config.seq_len, config.batch_size, config.eval_batch_size = 32, 4, 512
  config.num_train_steps, config.warmup_steps, config.learning_rate = 6, 2, 3e-3
  config.log_every_steps, config.eval_every_steps, config.checkpoint_every_steps = 1, 1000, 1000
  config.sample.length = 0
  return override(config, overrides)


def trained_run_config():
  """The config of the session fixture ``trained_run`` (tests/conftest.py)."""
  return tiny_config(
    num_train_steps=4,
    eval_every_steps=2,
    profile_steps=(1, 3),
    **{"sample.length": 10, "sample.prompt": "The "},
  )


def train_py(workdir, *flags, config="configs/quickstart.py") -> list[str]:
  """``python train.py --config CONFIG --workdir WORKDIR FLAGS...`` (run from the root)."""
  import sys

  return [sys.executable, "train.py", "--config", config, "--workdir", str(workdir), *flags]


# Starts the command in its arguments with SIGINT at its default action: a suite started in the
# background has SIGINT ignored, and an ignored signal stays ignored across exec.
_DEFAULT_SIGINT = (
  "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
  "os.execv(sys.argv[1], sys.argv[1:])"
)


def with_default_sigint(cmd: list[str]) -> list[str]:
  """``cmd`` started with Ctrl-C at its default, whatever SIGINT this process inherited (no
  ``preexec_fn``: unsafe in a process with threads, as jax's)."""
  import shutil
  import sys

  program = cmd[0] if os.sep in cmd[0] else shutil.which(cmd[0])
  return [sys.executable, "-c", _DEFAULT_SIGINT, program, *cmd[1:]]


def config_flags(config):
  """Command-line overrides that turn configs/quickstart.py into ``config``."""
  from aft_jax.typed_config import flatten

  out = []
  for key, value in flatten(config.to_dict()).items():
    if isinstance(value, (list, tuple)) or value is None:
      continue
    out.append(f"--config.{key}={value}")
  return out


def abstract_init(module, shape, dtype="float32", **kw):
  """The boxed ShapeDtypeStructs of ``module.init``'s variables for an input ``[*shape]`` of
  ``dtype``, traced, not compiled."""
  import jax

  return jax.eval_shape(
    functools.partial(module.init, **kw), jax.random.key(0), jax.ShapeDtypeStruct(shape, dtype)
  )


def random_params(module, shape, dtype="float32", seed=0, scale=0.5):
  """Random params of ``module``'s structure (``abstract_init``, not compiled), every bias
  non-zero: normal draws times ``scale``; AFT's position bias and kernel gains times 1,
  LayerNorm scales 1 + 0.1 x."""
  import flax.linen as nn
  import jax
  import numpy as np

  rng = np.random.default_rng(seed)

  def draw(path, s):
    name, x = path[-1].key, rng.normal(size=s.shape)
    x = (
      1.0 + 0.1 * x
      if name == "scale"
      else x
      if name in ("pos_bias", "gamma", "beta")
      else scale * x
    )
    return jax.numpy.asarray(x, s.dtype)

  return jax.tree_util.tree_map_with_path(
    draw, nn.unbox(abstract_init(module, shape, dtype))["params"]
  )


def param_count(tree) -> int:
  """Number of scalars in a (possibly boxed) tree of arrays or ShapeDtypeStructs."""
  import flax.linen as nn
  import jax

  return sum(int(x.size) for x in jax.tree_util.tree_leaves(nn.unbox(tree)))


def __getattr__(name: str):
  """``TRITON``: ``ops.KERNEL_CALLS["gpu"]``, read when asked for (importing this module imports
  no jax)."""
  if name == "TRITON":
    from aft_jax import ops

    return ops.KERNEL_CALLS["gpu"]
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def on_target(device_kind: str, platform: str = "gpu", num_cores: int = 1):
  """A context in which ops see an abstract device of ``device_kind`` ("NVIDIA H200", "Tesla
  T4", "TPU v5 lite"): what ``impl="auto"`` and the Triton lowering decide from."""
  import jax

  device = jax.sharding.AbstractDevice(
    device_kind=device_kind, num_cores=num_cores, platform=platform
  )
  return jax.sharding.use_abstract_mesh(
    jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  )


def export_for(fn, *args, platform="cuda", calls=None, donate_argnums=(), device=None):
  """``jax.export`` of ``jax.jit(fn)`` for ``platform`` ("cuda" or "tpu"), allowing the custom
  ``calls`` (default: Triton's), under an abstract ``device`` (default: an H200 for Triton
  calls, a v5e for TPU, none otherwise: cuDNN attention refuses an abstract device)."""
  import contextlib

  import jax

  from aft_jax.ops import KERNEL_CALLS

  TRITON_CALL = KERNEL_CALLS["gpu"]
  calls = (TRITON_CALL,) if calls is None else calls
  if device is None and platform == "cuda" and TRITON_CALL in calls:
    device = "NVIDIA H200"
  elif device is None and platform == "tpu":
    device = "TPU v5 lite"
  kind = {"cuda": "gpu"}.get(platform, platform)
  target = contextlib.nullcontext() if device is None else on_target(device, kind)
  with target:
    return jax.export.export(
      jax.jit(fn, donate_argnums=donate_argnums),
      platforms=[platform],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(c) for c in calls],
    )(*args)


def equations(jaxpr, name: str):
  """Every ``name`` equation of a jaxpr (e.g. "dot_general", "pallas_call"), sub-jaxprs (scan,
  cond, remat, custom VJPs, ...) included; a pallas_call's own kernel is not searched."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      yield eqn
    if eqn.primitive.name == "pallas_call":
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from equations(sub, name)


def listing(path) -> dict[str, str]:
  """{path relative to ``path``: the SHA-256 of its bytes, or "folder"} of everything under it."""
  import hashlib

  out = {}
  for root, dirs, files in os.walk(path):
    for d in dirs:
      out[os.path.relpath(os.path.join(root, d), path)] = "folder"
    for f in files:
      full = os.path.join(root, f)
      with open(full, "rb") as fh:
        out[os.path.relpath(full, path)] = hashlib.sha256(fh.read()).hexdigest()
  return out
