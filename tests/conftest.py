"""Test session setup (a persistent compilation cache) and shared fixtures; helpers that tests
import are in tests/support/helpers.py."""

import os

import pytest

from tests.support import shared
from tests.support.helpers import STDLIB_JSON, trained_run_config

# Many tests (and the train.py subprocesses they start, which inherit the environment) compile
# the same tiny programs: a persistent compilation cache compiles each of them once per run.
# It lives outside the checkout (as pip's cache does), so a fresh clone on the same machine
# starts warm; jax keys each entry by the program, its options and jax's version, and drops the
# least recently used entries past the size below (a whole suite's programs take ~80 MB).
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/aft_jax/test-compilation-cache")
)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(1 << 30))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Test programs are tiny: XLA's backend optimisations cost more compile time than they save.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")


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
