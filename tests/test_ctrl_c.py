"""Ctrl-C in every command (aft_jax/ctrl_c.py): one line on stderr, exit status 130, nothing
half-written left, never a crash, a traceback or a lost Ctrl-C. Each command is stopped at a
known point: a stand-in for one function prints ``blocked`` and waits, and the test sends SIGINT
once it has read that line."""

import os
import shutil
import signal
import subprocess
import sys
import tomllib

import pytest

from tests.support import prefork
from tests.support.helpers import ROOT, config_flags, listing, trained_run_config

# python -c COMMAND MODE TARGET SCRIPT ENTRY ARGS...: the console script SCRIPT (entry point
# ENTRY) with ARGS and Ctrl-C at Python's default, stopped by MODE at TARGET ("module.name"):
# "read" blocks once the coroutine TARGET (Orbax's read of one array) is done, other reads in
# flight; "call" blocks before the first call of TARGET; "gc" calls TARGET, then has a
# garbage-collector callback send the process SIGINT.
COMMAND = r"""
import gc, importlib, signal, sys, time
import orbax.checkpoint  # before one of its modules on its own (an import cycle otherwise)
signal.signal(signal.SIGINT, signal.default_int_handler)
mode, target, script, entry, *args = sys.argv[1:]
owner, _, name = target.rpartition(".")
owner = importlib.import_module(owner)
real = getattr(owner, name)

blocked = []

def block():
  if not blocked:  # once: the calls that run meanwhile (other arrays' reads) go on
    blocked.append(True)
    print("blocked", flush=True)
    while True:  # (not signal.pause(): another thread may be the one the kernel signals)
      time.sleep(0.01)

async def read(*a, **k):
  out = await real(*a, **k)
  block()
  return out

def call(*a, **k):
  block()
  return real(*a, **k)

def gc_(*a, **k):
  out, sent = real(*a, **k), []
  def callback(phase, info):
    if not sent:
      sent.append(True)
      signal.raise_signal(signal.SIGINT)
  gc.callbacks.append(callback)
  gc.collect()
  return out

setattr(owner, name, {"read": read, "call": call, "gc": gc_}[mode])
module, _, function = entry.partition(":")
sys.argv = [script, *args]
getattr(importlib.import_module(module), function)()
"""

# python -c IMPORTS K MODE SCRIPT ENTRY ARGS...: the console script with one SIGINT at the K-th
# Python call a C extension's initialisation makes (numpy's, jaxlib's), sent there ("signal")
# or from a garbage-collector callback run there ("gc"); a process that never sends it says so.
IMPORTS = r"""
import _imp, atexit, gc, importlib, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
k, mode, script, entry, *args = sys.argv[1:]
loading, depth, calls = (_imp.create_dynamic, _imp.exec_dynamic), 0, 0

def send():
  signal.raise_signal(signal.SIGINT)

def from_gc_callback():
  def callback(phase, info):
    gc.callbacks.remove(callback)
    send()
  gc.callbacks.append(callback)
  gc.collect()

def profile(frame, event, arg):
  global depth, calls
  if event in ("c_call", "c_return", "c_exception") and arg in loading:
    depth += 1 if event == "c_call" else -1
  elif event == "call" and depth:
    calls += 1
    if calls == int(k):
      sys.setprofile(None)
      {"signal": send, "gc": from_gc_callback}[mode]()

def unsent():
  sys.setprofile(None)
  if calls < int(k):
    print(f"no SIGINT sent: only {calls} calls", file=sys.stderr)

atexit.register(unsent)  # (a command stopped by Ctrl-C ends without atexit)
sys.setprofile(profile)
module, _, function = entry.partition(":")
sys.argv = [script, *args]
getattr(importlib.import_module(module), function)()
"""

SCRIPTS = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["scripts"]
READ = "orbax.checkpoint._src.serialization.serialization._read_shard"
NOTHING_WRITTEN = "interrupted (Ctrl-C): stopped; nothing was written"


def _interrupt(mode, target, entry, args, while_blocked=lambda: None):
  """(exit status, stdout lines, stderr lines) of the console script ``entry`` ("script=module:
  function") stopped as ``COMMAND`` says; ``while_blocked()`` runs just before the SIGINT."""
  script, _, entry = entry.partition("=")
  cmd = [sys.executable, "-c", COMMAND, mode, target, script, entry, *map(str, args)]
  proc = prefork.popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  before = []
  try:
    if mode != "gc":  # the command sends its own
      for line in proc.stdout:
        if line == "blocked\n":
          break
        before.append(line.rstrip("\n"))
      while_blocked()
      proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
  finally:
    proc.kill()
  return proc.returncode, before + out.splitlines(), err.splitlines()


@pytest.fixture
def run_copy(trained_run, tmp_path):
  """A copy of the session's trained run (a Ctrl-C must leave it as it was)."""
  workdir = str(tmp_path / "run")
  shutil.copytree(trained_run[0], workdir, symlinks=True)
  return workdir


@pytest.mark.parametrize("tool", ["generate", "evaluate", "export"])
def test_ctrl_c_while_a_tool_reads_the_checkpoint_is_one_line_and_exit_status_130(
  tool, run_copy, tmp_path
):
  """Inside Orbax's read (which wraps an interruption in its own Exception): not a damaged
  checkpoint, no reading thread's traceback. Three times: the reads in flight differ."""
  before = listing(run_copy)
  args = {
    "generate": ["--length", 2],
    "evaluate": ["--text_file", os.path.join(ROOT, "README.md")],
    "export": ["--out", tmp_path / "model.msgpack"],
  }[tool]
  for _ in range(3):
    got = _interrupt(
      "read", READ, f"aft-{tool}=aft_jax.tools.{tool}:main", ["--workdir", run_copy, *args]
    )
    assert got == (130, [], [f"{tool}: {NOTHING_WRITTEN}"]), got
  assert listing(run_copy) == before and os.listdir(tmp_path) == ["run"]


def test_ctrl_c_while_train_py_resumes_is_one_line_and_exit_status_130(run_copy):
  """Not a damaged checkpoint either (nothing moved aside), nor a run that cannot resume."""
  before = listing(run_copy)
  args = ["--config", "quickstart", "--workdir", run_copy, *config_flags(trained_run_config())]
  status, _, err = _interrupt("read", READ, "aft-train=aft_jax.trainer.train:run", args)
  assert status == 130 and err == [
    "aft-train: interrupted (Ctrl-C): stopped without saving; the workdir's last checkpoint, "
    "if any, is intact and the same command resumes from it"
  ], (status, err[-20:])
  assert listing(run_copy) == before


def test_ctrl_c_while_aft_prepare_writes_is_one_line_and_leaves_nothing(docs, tmp_path):
  """Inside the atomic write of a split: its temporary file removed, nothing marked prepared."""
  data = tmp_path / "data"
  args = ["--dataset", "text", "--tokenizer", "byte", "--train_files", docs / "*.py"]
  files = lambda: [f for _, _, names in os.walk(data) for f in names]  # noqa: E731
  written = []  # the files there at the SIGINT
  status, _, err = _interrupt(
    "call",
    "numpy.lib.format.write_array_header_1_0",
    f"aft-prepare={SCRIPTS['aft-prepare']}",
    [*args, "--data_dir", data, "--quiet"],
    lambda: written.extend(files()),
  )
  assert status == 130 and err == [
    "aft-prepare: interrupted (Ctrl-C): nothing was marked prepared; the same command prepares "
    "it again"
  ], (status, err[-20:])
  assert [f for f in written if ".tmp-" in f]  # it was stopped inside the write
  assert not [f for f in files() if ".tmp-" in f or f == "COMPLETE"], files()


def test_a_ctrl_c_inside_a_garbage_collector_callback_is_not_lost(run_copy):
  """Raised at the first call after the callback, where Python alone would drop it."""
  got = _interrupt(
    "gc",
    "aft_jax.tools.trained.load_run",
    "aft-generate=aft_jax.tools.generate:main",
    ["--workdir", run_copy, "--length", 2],
  )
  assert got == (130, [], [f"generate: {NOTHING_WRITTEN}"]), got


@pytest.mark.slow
def test_ctrl_c_while_a_command_imports_is_one_line_and_exit_status_130(tmp_path):
  """Every command, a Ctrl-C at points spread over numpy's and jaxlib's loading, or in a gc
  callback run there: held until the imports are done, then the command's one line, nothing
  written. Plain processes (not forked from a server that imported jax), side by side."""
  gone = tmp_path / "gone"  # never created
  stopped = "interrupted (Ctrl-C): stopped"
  tool = lambda name, *args: (name, ["--workdir", gone, *args], f"{name}: {NOTHING_WRITTEN}")  # noqa: E731
  train = (
    "train",
    ["--config", "quickstart", "--config.num_train_steps=1", "--workdir", gone],
    f"aft-train: {stopped} without saving; the workdir's last checkpoint, if any, is intact "
    "and the same command resumes from it",
  )
  prepare = (
    "prepare",
    ["--dataset", "pydoc", "--data_dir", gone, "--quiet"],
    "aft-prepare: interrupted (Ctrl-C) while starting; nothing was written",
  )
  cases = [  # (command, args, its line), K, mode
    (tool("generate"), 20000, "signal"),
    (tool("evaluate", "--split", "test"), 300, "signal"),
    (tool("export", "--out", gone / "m.msgpack"), 1, "signal"),
    (tool("export", "--out", gone / "m.msgpack"), 3000, "signal"),
    (tool("export", "--out", gone / "m.msgpack"), 20000, "gc"),
    (train, 300, "signal"),
    (train, 20000, "gc"),
    (prepare, 1, "signal"),
  ]
  procs = []
  for (name, args, _), k, mode in cases:
    script = f"aft-{name}"
    cmd = [sys.executable, "-c", IMPORTS, str(k), mode, script, SCRIPTS[script], *map(str, args)]
    procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
  got = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=300)
      got.append((p.returncode, out.decode().splitlines(), err.decode().splitlines()[-3:]))
  finally:
    for p in procs:
      p.kill()
  want = [(130, [], [line]) for (_, _, line), _, _ in cases]
  assert got == want and not gone.exists(), [g for g, w in zip(got, want) if g != w]


# python -c HELD DIR: a module imported inside two nested command blocks sends itself SIGINT
# $SIGINTS times, printing a line after each.
HELD = r"""
import signal, sys
from aft_jax.ctrl_c import stops_on_ctrl_c
signal.signal(signal.SIGINT, signal.default_int_handler)
with stops_on_ctrl_c("outer"):
  with stops_on_ctrl_c("inner"):
    sys.path.insert(0, sys.argv[1])
    import sends_sigint
    print("after the import")
"""
SENDS_SIGINT = """
import os, signal
for _ in range(int(os.environ["SIGINTS"])):
  signal.raise_signal(signal.SIGINT)
  print("the import went on", flush=True)
"""


@pytest.mark.parametrize("sigints", [1, 2])
def test_a_ctrl_c_during_an_import_is_held_until_it_returns_and_a_second_stops_at_once(
  sigints, tmp_path
):
  """The import goes on to its end, the command stops as it returns; a second Ctrl-C meanwhile
  ends the process at once. The line is the innermost block's."""
  (tmp_path / "sends_sigint.py").write_text(SENDS_SIGINT)
  env = {**os.environ, "SIGINTS": str(sigints)}
  cmd = [sys.executable, "-c", HELD, str(tmp_path)]
  got = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
  want = (130, ["the import went on"], ["inner"])
  assert (got.returncode, got.stdout.splitlines(), got.stderr.splitlines()) == want, got
