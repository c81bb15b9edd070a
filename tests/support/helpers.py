"""Helpers shared by the tests: the repository root, a tiny training config, and the
traced (uncompiled) structure and size of a module's parameters."""

import functools
import glob
import os

# jax is imported inside the helpers: conftest imports this module before it sets the
# environment (the compilation cache) that jax reads when it is first imported.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# XLA's flags for the tests' programs, which are tiny: XLA's backend optimisations and the CPU
# backend's MLIR fusion emitters cost more compile time than they save (the older emitters
# compile the same fusions; measured: the tiny AFT-local, softmax and AFT-conv1d train steps
# took 10.6 CPU-s to compile with them, 4.0 without), and so does splitting each program's LLVM
# module into parts that compile on several threads (six small op gradients: 2.0-2.2 CPU-s
# split, 1.4-1.5 in one part). tests/conftest.py sets them for the session, so the processes it
# starts inherit them.
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


def train_losses(trainer, train_tokens, steps: int) -> list[float]:
  """The losses of ``trainer``'s first ``steps`` train steps from its state of seed 0, on the
  stream batches (seed 0) of ``train_tokens``, dropout key 1."""
  import jax

  from aft_jax import data as data_lib

  train = trainer.config.train
  state = trainer.init_state(0)
  it = data_lib.train_iterator(
    train_tokens, seq_len=train.seq_len, global_batch_size=train.batch_size, seed=0
  )
  rng, losses = jax.random.key(1), []
  for _ in range(steps):
    state, metrics = trainer.train_step(state, next(it), rng)
    losses.append(float(metrics["loss"]))
  return losses


def trained_run_config():
  """The config of the session fixture ``trained_run`` (tests/conftest.py): a rerun with it
  resumes that run (or is refused for what changed)."""
  return tiny_config(
    num_train_steps=4,
    eval_every_steps=2,
    profile_steps=(1, 3),
    **{"sample.length": 10, "sample.prompt": "The "},
  )


def train_py(workdir, *flags, config="configs/quickstart.py") -> list[str]:
  """The command line of ``python train.py --config CONFIG --workdir WORKDIR FLAGS...``, run
  from the repository root (the README's form)."""
  import sys

  return [sys.executable, "train.py", "--config", config, "--workdir", str(workdir), *flags]


# Starts the command in its arguments with SIGINT at its default action, then Python's
# KeyboardInterrupt: a suite started in the background (``nohup pytest ... &``) has SIGINT
# ignored, an ignored signal stays ignored across exec, and Python keeps it so.
_DEFAULT_SIGINT = (
  "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
  "os.execv(sys.argv[1], sys.argv[1:])"
)


def with_default_sigint(cmd: list[str]) -> list[str]:
  """``cmd`` (a program and its arguments) started with Ctrl-C at its default, whatever SIGINT
  this process inherited: for a test that sends SIGINT to a child (no ``preexec_fn``, which is
  unsafe in a process with threads, as jax's)."""
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
  """``module.init`` traced, not compiled (compiling init costs as much as the model): the boxed
  ShapeDtypeStructs of its variables for an input ``[*shape]`` of ``dtype``."""
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
  """``TRITON``: the custom call of a Pallas Triton kernel (``ops.KERNEL_CALLS["gpu"]``), read
  when first asked for, so that importing this module imports no jax."""
  if name == "TRITON":
    from aft_jax import ops

    return ops.KERNEL_CALLS["gpu"]
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def on_target(device_kind: str, platform: str = "gpu", num_cores: int = 1):
  """A context in which ops see an abstract device of ``device_kind`` ("NVIDIA H200", "Tesla
  T4", "TPU v5 lite"): what ``impl="auto"`` decides from (``ops.device_facts``), and from jax
  0.11 what the Pallas Triton lowering asks for the compute capability."""
  import jax

  device = jax.sharding.AbstractDevice(
    device_kind=device_kind, num_cores=num_cores, platform=platform
  )
  return jax.sharding.use_abstract_mesh(
    jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  )


def export_for(fn, *args, platform="cuda", calls=None, donate_argnums=(), device=None):
  """``jax.export`` of ``jax.jit(fn)`` for ``platform`` ("cuda" or "tpu") on this CPU machine,
  allowing the custom ``calls`` (default: Triton's), under an abstract ``device``
  (``on_target``; by default for Triton kernels an H200, whose kernels ``impl="auto"`` takes,
  and for TPU a v5e; cuDNN attention refuses an abstract device, so without Triton calls it
  lowers without one)."""
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
  """{path relative to ``path``: the SHA-256 of its bytes, or "folder"} of everything under
  ``path``: equal before and after a run that was refused, if it changed nothing."""
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
