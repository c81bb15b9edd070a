"""Ctrl-C in every command (aft_jax/ctrl_c.py): one line on stderr, exit status 130, nothing
half-written, never a crash or a lost Ctrl-C; each sent at a known point, never after a delay."""

import os
import shutil
import signal
import subprocess
import sys
import tomllib

import pytest

from tests.support import prefork
from tests.support.helpers import ROOT, config_flags, listing, trained_run_config

# python -c COMMAND MODE WHERE SCRIPT ENTRY ARGS...: the console script SCRIPT (entry point
# ENTRY), SIGINT at Python's default. "read": prints "blocked" and waits once the coroutine WHERE
# (Orbax's read of one array) is done; "call": the same before WHERE's first call; "gc": after
# WHERE, a gc callback sends SIGINT. "import-signal" / "import-gc": one SIGINT (or a gc callback
# sending it) at the WHERE-th Python call of a C extension's initialisation.
COMMAND = r"""
import _imp, gc, importlib, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
mode, where, script, entry, *args = sys.argv[1:]
blocked, sent, depth, calls = [], [], 0, 0
loading = (_imp.create_dynamic, _imp.exec_dynamic)
def send():
  if not sent:
    sent.append(True)
    signal.raise_signal(signal.SIGINT)
def from_gc_callback():
  gc.callbacks.append(lambda phase, info: send())
  gc.collect()
def block():
  if not blocked:  # once: the calls that run meanwhile (other arrays' reads) go on
    blocked.append(True)
    print("blocked", flush=True)
    while True:  # (not signal.pause(): another thread may be the one the kernel signals)
      time.sleep(0.01)
def profile(frame, event, arg):
  global depth, calls
  if event in ("c_call", "c_return", "c_exception") and arg in loading:
    depth += 1 if event == "c_call" else -1
  elif event == "call" and depth:
    calls += 1
    if calls == int(where):
      sys.setprofile(None)
      {"import-signal": send, "import-gc": from_gc_callback}[mode]()
if mode.startswith("import"):
  sys.setprofile(profile)
else:
  import orbax.checkpoint  # before one of its modules on its own (an import cycle otherwise)
  owner, _, name = where.rpartition(".")
  owner = importlib.import_module(owner)
  real = getattr(owner, name)
  async def read(*a, **k):
    out = await real(*a, **k)
    block()
    return out
  def call(*a, **k):
    block()
    return real(*a, **k)
  def gc_(*a, **k):
    out = real(*a, **k)
    from_gc_callback()
    return out
  setattr(owner, name, {"read": read, "call": call, "gc": gc_}[mode])
module, _, function = entry.partition(":")
sys.argv = [script, *args]
getattr(importlib.import_module(module), function)()
"""

SCRIPTS = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["scripts"]
READ = "orbax.checkpoint._src.serialization.serialization._read_shard"
NOTHING_WRITTEN = "interrupted (Ctrl-C): stopped; nothing was written"
RESUMES = (
  "aft-train: interrupted (Ctrl-C): stopped without saving; the workdir's last checkpoint, if "
  "any, is intact and the same command resumes from it"
)


def _command(mode, where, script, args) -> list[str]:
  return [sys.executable, "-c", COMMAND, mode, str(where), script, SCRIPTS[script], *map(str, args)]


def _interrupt(mode, where, script, args, while_blocked=lambda: None):
  """(exit status, stdout lines, stderr lines), SIGINT sent once blocked ("gc": its own)."""
  cmd = _command(mode, where, script, args)
  proc = prefork.popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  before = []
  try:
    if mode != "gc":
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
  workdir = str(tmp_path / "run")
  shutil.copytree(trained_run[0], workdir, symlinks=True)
  return workdir


@pytest.mark.parametrize("tool", ["generate", "evaluate", "export", "train"])
def test_ctrl_c_while_a_command_reads_the_checkpoint_is_one_line_and_exit_status_130(
  tool, run_copy, tmp_path
):
  """Inside Orbax's read: no damaged checkpoint, no thread's traceback; a tool 3 times (the reads
  in flight differ)."""
  before = listing(run_copy)
  args = {
    "generate": ["--length", 2],
    "evaluate": ["--text_file", os.path.join(ROOT, "README.md")],
    "export": ["--out", tmp_path / "model.msgpack"],
    "train": ["--config", "quickstart", *config_flags(trained_run_config())],
  }[tool]
  for _ in range(1 if tool == "train" else 3):
    status, out, err = _interrupt("read", READ, f"aft-{tool}", ["--workdir", run_copy, *args])
    line = RESUMES if tool == "train" else f"{tool}: {NOTHING_WRITTEN}"
    assert (status, err) == (130, [line]) and (tool == "train" or out == []), (status, err[-20:])
  assert listing(run_copy) == before and os.listdir(tmp_path) == ["run"]


def test_ctrl_c_while_aft_prepare_writes_is_one_line_and_leaves_nothing(docs, tmp_path):
  data, written = tmp_path / "data", []
  args = ["--dataset", "text", "--tokenizer", "byte", "--train_files", docs / "*.py", "--quiet"]
  files = lambda: [f for _, _, names in os.walk(data) for f in names]  # noqa: E731
  write, at_sigint = "numpy.lib.format.write_array_header_1_0", lambda: written.extend(files())
  status, _, err = _interrupt("call", write, "aft-prepare", [*args, "--data_dir", data], at_sigint)
  said = "nothing was marked prepared; the same command prepares it again"
  assert (status, err) == (130, [f"aft-prepare: interrupted (Ctrl-C): {said}"]), err[-20:]
  assert [f for f in written if ".tmp-" in f]  # stopped inside the write
  assert not [f for f in files() if ".tmp-" in f or f == "COMPLETE"], files()


def test_a_ctrl_c_inside_a_garbage_collector_callback_is_not_lost(run_copy):
  args = ["--workdir", run_copy, "--length", 2]
  got = _interrupt("gc", "aft_jax.tools.trained.load_run", "aft-generate", args)
  assert got == (130, [], [f"generate: {NOTHING_WRITTEN}"]), got


@pytest.mark.slow
def test_ctrl_c_while_a_command_imports_is_one_line_and_exit_status_130(tmp_path):
  """A Ctrl-C at points over numpy's and jaxlib's loading, or in a gc callback there: held until
  the imports are done, then the command's line. Plain processes (not forked), side by side."""
  gone = tmp_path / "gone"  # never created
  to = ["--out", gone / "m.msgpack"]
  train = ["--config", "quickstart", "--config.num_train_steps=1"]
  cases = [  # (command, args, K, mode)
    ("generate", [], 20000, "signal"),
    ("evaluate", ["--split", "test"], 300, "signal"),
    ("export", to, 1, "signal"),
    ("export", to, 3000, "signal"),
    ("export", to, 20000, "gc"),
    ("train", train, 300, "signal"),
    ("train", train, 20000, "gc"),
    ("prepare", ["--dataset", "pydoc", "--quiet"], 1, "signal"),
  ]
  procs = []
  for name, args, k, mode in cases:
    args = [*args, "--data_dir" if name == "prepare" else "--workdir", gone]
    cmd = _command(f"import-{mode}", k, f"aft-{name}", args)
    procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
  got = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=300)
      got.append((p.returncode, out.decode().splitlines(), err.decode().splitlines()[-3:]))
  finally:
    for p in procs:
      p.kill()
  starting = "aft-prepare: interrupted (Ctrl-C) while starting; nothing was written"
  lines = {"train": RESUMES, "prepare": starting}
  want = [(130, [], [lines.get(c[0], f"{c[0]}: {NOTHING_WRITTEN}")]) for c in cases]
  assert got == want and not gone.exists(), [g for g, w in zip(got, want) if g != w]


# python -c HELD DIR: a module imported inside two nested blocks sends SIGINT $SIGINTS times.
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
  """The import goes on, the command stops as it returns (a second Ctrl-C: at once); the line is
  the innermost block's."""
  (tmp_path / "sends_sigint.py").write_text(SENDS_SIGINT)
  env = {**os.environ, "SIGINTS": str(sigints)}
  cmd = [sys.executable, "-c", HELD, str(tmp_path)]
  got = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
  want = (130, ["the import went on"], ["inner"])
  assert (got.returncode, got.stdout.splitlines(), got.stderr.splitlines()) == want, got
