"""Shared test helpers: a tiny training config that compiles and runs in seconds on CPU."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Many tests (and the train.py subprocesses they start, which inherit the environment) compile
# the same tiny programs: a persistent compilation cache compiles each of them once per run.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".pytest_cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Test programs are tiny: XLA's backend optimisations cost more compile time than they save.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**overrides):
  """The quickstart recipe shrunk to one small layer; ``overrides`` use dotted keys."""
  from aft_jax.default_config import get_config, override

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


def config_flags(config):
  """Command-line overrides that turn configs/quickstart.py into ``config``."""
  out = []
  for key, value in _flatten(config.to_dict()).items():
    if isinstance(value, (list, tuple)) or value is None:
      continue
    out.append(f"--config.{key}={value}")
  return out


def _flatten(d, prefix=""):
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


@pytest.fixture
def tiny():
  return tiny_config


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
  """(workdir, results, stdout) of one tiny byte-level run, trained once per test process and
  shared by the tests of the commands that read a workdir (generate, evaluate, export): 4 steps,
  a validation at step 2, a profile of steps 2-3 and an end-of-run sample."""
  import contextlib
  import io

  from aft_jax import train_lib

  path = str(tmp_path_factory.mktemp("trained") / "run")
  config = tiny_config(
    num_train_steps=4,
    eval_every_steps=2,
    profile_steps=(1, 3),
    **{"sample.length": 10, "sample.prompt": "The "},
  )
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    results = train_lib.train_and_evaluate(config, path)
  return path, results, out.getvalue()
