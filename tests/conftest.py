"""Test session setup (a persistent compilation cache) and shared fixtures; helpers that tests
import are in tests/support/helpers.py."""

import gc
import os
import sys

import pytest

from tests.support import shared
from tests.support.helpers import FAST_COMPILE, STDLIB_JSON, trained_run_config

# Many tests (and the train.py subprocesses they start, which inherit the environment) compile
# the same tiny programs: a persistent compilation cache compiles each of them once per run.
# It lives outside the checkout (as pip's cache does), so a fresh clone on the same machine
# starts warm; jax keys each entry by the program, its options and jax's version.
CACHE_DIR = os.path.expanduser("~/.cache/aft_jax/test-compilation-cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", CACHE_DIR)
# No size limit for jax to keep: with one, every write lists the whole folder and reads each
# entry's access time, under one lock that all the suite's processes share (a run writes
# ~1,500 entries: quadratic, and the workers wait on each other; at 7,400 entries a write took
# seconds). The folder is trimmed once per session instead (``shared.trim_cache``).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
CACHE_KEEP_BYTES = 1 << 30  # past this, the least recently written entries go, down to half
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("XLA_FLAGS", FAST_COMPILE)
# This machine's environment sets PYTHONDONTWRITEBYTECODE, so every Python process the tests
# start (train.py, the tools, the workers; ~0.2 s each) would compile aft_jax's and the tests'
# sources again: the suite and its subprocesses write and reuse bytecode (__pycache__/, which
# git ignores), as Python does by default.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_configure(config):
  """Once per session, in the process that runs it (pytest-xdist's controller, not each worker):
  the compilation cache trimmed."""
  if not hasattr(config, "workerinput"):
    shared.trim_cache(os.environ["JAX_COMPILATION_CACHE_DIR"], CACHE_KEEP_BYTES)


def pytest_unconfigure(config):
  """In every pytest process (each xdist worker too): the fork servers it started
  (tests/support/prefork.py) stopped and reaped while the process still ends normally, so that
  their commands' CPU reaches the session's accounting and no socket folder is left.

  Then the garbage collected once and what is alive frozen: pytest's unraisable-exception
  check collects five times more, and each full collection walks the session's jax caches
  (about a second each in a worker); pytest-xdist's execnet sends a worker still busy 5 s
  after the session's end a SIGINT, which lands in a gc callback as a KeyboardInterrupt."""
  from tests.support import prefork

  prefork.stop_all()
  gc.collect()
  gc.freeze()


def pytest_collection_modifyitems(config, items):
  """The slow tests first (stable otherwise): pytest-xdist hands out the first items at the
  start, so with -n 2 the two workers share the long tests instead of one of them finishing
  the run alone on a long test collected last (test_wheel.py, test_train.py)."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _build_trained_run(folder):
  """The trained run of ``trained_run``, its config followed through the calls that pass it on
  (tests/support/config_flow.py: the modules it visits, the calls that climb back up)."""
  import contextlib
  import io

  from aft_jax.trainer import train_lib
  from tests.support import config_flow

  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    results, rooms, climbs = config_flow.follow(
      train_lib.train_and_evaluate, trained_run_config(), str(folder / "run")
    )
  flow = {"rooms": sorted(rooms), "climbs": sorted(climbs)}
  return {"results": results, "stdout": out.getvalue(), "config_flow": flow}


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
  """(workdir, results, stdout) of one tiny byte-level run, trained once per pytest session
  (whichever xdist worker asks first: ``shared.once``) and shared by the tests of the commands
  that read a workdir (generate, evaluate, export): 4 steps, a validation at step 2, a profile
  of steps 2-3 and an end-of-run sample."""
  folder, made = shared.once(tmp_path_factory, "trained_run", _build_trained_run)
  return str(folder / "run"), made["results"], made["stdout"]


def _build_stream_run(folder):
  """A tiny stream (AFT-conv1d, no position embedding), trained 2 steps: its max_len 16 is half
  its seq_len, which a stream allows (max_len is only its prefill's chunk)."""
  import contextlib
  import io

  from aft_jax.trainer import train_lib
  from tests.support.helpers import tiny_config

  overrides = {"model.mixing": "aft_conv1d", "model.position_embedding": "none"}
  config = tiny_config(num_train_steps=2, **overrides, **{"model.max_len": 16})
  with contextlib.redirect_stdout(io.StringIO()):
    return train_lib.train_and_evaluate(config, str(folder / "run"))


@pytest.fixture(scope="session")
def stream_run(tmp_path_factory):
  """(workdir, results) of one tiny stream (``_build_stream_run``), trained once per pytest
  session and shared by the tests of generate, evaluate and export on streams."""
  folder, results = shared.once(tmp_path_factory, "stream_run", _build_stream_run)
  return str(folder / "run"), results


@pytest.fixture(scope="session")
def trained_run_config_flow(tmp_path_factory):
  """{"rooms": [module], "climbs": [[caller, callee]]}: where ``trained_run``'s config went."""
  return shared.once(tmp_path_factory, "trained_run", _build_trained_run)[1]["config_flow"]


@pytest.fixture
def docs(tmp_path):
  """A folder of real text: a copy of the standard library's json package (5 files)."""
  import shutil

  folder = tmp_path / "docs"
  folder.mkdir()
  for path in STDLIB_JSON:
    shutil.copy(path, folder)
  return folder
