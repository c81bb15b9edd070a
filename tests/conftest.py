"""The session's compilation cache and shared fixtures (helpers: tests/support/helpers.py)."""

import contextlib
import gc
import io
import os
import shutil
import sys

import pytest

from aft_jax.trainer import train
from tests.support import shared
from tests.support.helpers import FAST_COMPILE, STDLIB_JSON, tiny_config, trained_run_config

# Outside the checkout: a fresh clone on the same machine starts warm.
CACHE_DIR = os.path.expanduser("~/.cache/aft_jax/test-compilation-cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", CACHE_DIR)
# No size limit for jax (each write would scan the folder under a lock): trimmed per session.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
CACHE_KEEP_BYTES = 1 << 30  # past this, the least recently written entries go, down to half
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("XLA_FLAGS", FAST_COMPILE)
# Commands started here run as aft-train restarts itself (train.restart_with_huge_pages).
os.environ.update(train.with_huge_pages(os.environ) or {})
# Bytecode written and reused, whatever the environment says.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_configure(config):
  if not hasattr(config, "workerinput"):
    shared.trim_cache(os.environ["JAX_COMPILATION_CACHE_DIR"], CACHE_KEEP_BYTES)


def pytest_unconfigure(config):
  """Fork servers reaped; the heap collected once and frozen (pytest's exit would walk jax's
  caches five times, and execnet interrupts a worker still busy 5 s after the end)."""
  from tests.support import prefork

  prefork.stop_all()
  gc.collect()
  gc.freeze()


def pytest_collection_modifyitems(config, items):
  """The slow tests first, so that xdist's workers share them."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _build_trained_run(folder):
  """A tiny byte-level run (helpers.trained_run_config), its config followed (config_flow)."""
  from aft_jax.trainer import train_lib
  from tests.support import config_flow

  with contextlib.redirect_stdout(io.StringIO()) as out:
    results, rooms, climbs = config_flow.follow(
      train_lib.train_and_evaluate, trained_run_config(), str(folder / "run")
    )
  flow = {"rooms": sorted(rooms), "climbs": sorted(climbs)}
  return {"results": results, "stdout": out.getvalue(), "config_flow": flow}


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
  """(workdir, results, stdout) of ``_build_trained_run``, once per session."""
  folder, made = shared.once(tmp_path_factory, "trained_run", _build_trained_run)
  return str(folder / "run"), made["results"], made["stdout"]


@pytest.fixture(scope="session")
def trained_run_config_flow(tmp_path_factory):
  """{"rooms": [module], "climbs": [[caller, callee]]}: where ``trained_run``'s config went."""
  return shared.once(tmp_path_factory, "trained_run", _build_trained_run)[1]["config_flow"]


def _build_stream_run(folder):
  """A tiny stream (configs/stream.py's mixing), 2 steps, max_len half its seq_len."""
  from aft_jax.trainer import train_lib

  overrides = {"model.mixing": "aft_decay", "model.position_embedding": "none"}
  config = tiny_config(num_train_steps=2, **overrides, **{"model.max_len": 16})
  with contextlib.redirect_stdout(io.StringIO()):
    return train_lib.train_and_evaluate(config, str(folder / "run"))


@pytest.fixture(scope="session")
def stream_run(tmp_path_factory):
  """(workdir, results) of ``_build_stream_run``, once per session."""
  folder, results = shared.once(tmp_path_factory, "stream_run", _build_stream_run)
  return str(folder / "run"), results


@pytest.fixture
def docs(tmp_path):
  """A copy of the standard library's json package (5 files)."""
  (tmp_path / "docs").mkdir()
  for path in STDLIB_JSON:
    shutil.copy(path, tmp_path / "docs")
  return tmp_path / "docs"
