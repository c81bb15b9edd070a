"""The suite's own machinery (tests/support/: shared.py, cpu_probe.py, prefork.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import cpu_probe, prefork, shared
from tests.support.helpers import ROOT


def test_trim_cache_keeps_the_newest_half_only_past_the_limit(tmp_path):
  for i in range(10):  # 100 bytes each, written one second apart: file 9 the newest
    path = tmp_path / f"entry{i}"
    path.write_bytes(bytes(100))
    os.utime(path, (1000 + i, 1000 + i))
  shared.trim_cache(str(tmp_path), keep=1000)  # 1000 bytes: within the limit, all kept
  assert len(os.listdir(tmp_path)) == 10
  shared.trim_cache(str(tmp_path), keep=999)  # past it: down to 499 bytes, the newest four
  assert sorted(os.listdir(tmp_path)) == [f"entry{i}" for i in (6, 7, 8, 9)]
  shared.trim_cache(str(tmp_path / "missing"), keep=1)  # no folder yet: nothing to do


def test_cpu_probe_adds_up_each_folders_tests_and_what_the_host_stole(tmp_path, capsys):
  """docs/development.md's table: per folder, the most CPU first, totals, the host's shares."""
  (tmp_path / "gw0.json").write_text(
    '[["tests/ops/test_a.py::t1", 2.0, 1.5, 0.0], ["tests/test_b.py::t2", 4.0, 0.5, 3.0]]'
  )
  (tmp_path / "gw1.json").write_text('[["tests/ops/test_c.py::t3[x]", 1.0, 1.0, 0.25]]')
  # user, nice, system, idle, iowait, irq, softirq, steal: 100 ticks, 70 busy, 10 idle, 20 stolen
  start, end = [10, 0, 5, 40, 1, 0, 0, 3], [70, 0, 14, 48, 3, 1, 0, 23]
  (tmp_path / cpu_probe.HOST_FILE).write_text(json.dumps([start, end]))
  assert cpu_probe.main(["--dir", str(tmp_path)]) == 0
  assert capsys.readouterr().out.splitlines()[2:] == [
    "| `(top level)` | 1 | 4 s | 0 s | 3 s |",
    "| `ops` | 2 | 3 s | 2 s | 0 s |",
    "| all | 3 | 7 s | 3 s | 3 s |",
    "host over the session: busy 70.0%, idle 10.0%, stolen 20.0% of the cores' time",
  ]
  now = cpu_probe.host_times()  # this machine's (Linux): eight counters that only grow
  assert now is None or (len(now) == 8 and all(x >= 0 for x in now))


SCRIPT = """
import json, os, signal, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "home": os.environ.get("HOME"),
                  "sigint": str(signal.getsignal(signal.SIGINT)), "name": __name__,
                  "path0": sys.path[0]}))
print(os.getppid())
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how in ("raise", "interrupt"):
  raise ValueError("boom") if how == "raise" else KeyboardInterrupt
sys.exit("a one-line error" if how == "message" else int(how))
"""


@pytest.mark.parametrize("how", ["0", "3", "message", "raise", "interrupt"])
def test_a_forked_command_is_what_a_subprocess_would_be(tmp_path, how):
  """A script, a module (-m) or code (-c) as a subprocess runs it; its parent the server."""
  (tmp_path / "script.py").write_text(SCRIPT)
  (tmp_path / "pkg").mkdir()
  (tmp_path / "pkg" / "__init__.py").write_text("")
  (tmp_path / "pkg" / "mod.py").write_text(SCRIPT)
  env = dict(os.environ, HOME=str(tmp_path / "home"))
  for cmd, cwd in (
    ([sys.executable, str(tmp_path / "script.py"), how], ROOT),
    ([sys.executable, "-m", "pkg.mod", how], tmp_path),
    ([sys.executable, "-c", SCRIPT, how], tmp_path),
  ):
    want = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    got = prefork.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert got.returncode == want.returncode
    assert got.stdout.splitlines()[0] == want.stdout.splitlines()[0]  # all but the parent
    assert got.stderr.splitlines()[0] == "to stderr" and got.stderr == want.stderr
    assert int(got.stdout.splitlines()[1]) == prefork.server_pid() != os.getpid()  # forked


WAITER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("terminated"), sys.exit(0)))
print("on stderr", file=sys.stderr, flush=True)
print("ready", os.getpgid(0) == os.getpid(), flush=True)
while True:
  time.sleep(0.01)
"""


def test_a_forked_process_is_signalled_piped_and_awaited_as_a_popen(tmp_path):
  """Pipes, a session, poll, signals, communicate, wait, a file as stdout, stderr=STDOUT."""
  (tmp_path / "waiter.py").write_text(WAITER)
  cmd = [sys.executable, str(tmp_path / "waiter.py")]
  pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
  proc = prefork.popen(cmd, cwd=tmp_path, **pipe)
  try:
    assert isinstance(proc, prefork.Forked)
    assert proc.stdout.readline() == "ready True\n" and proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (0, "terminated\n", "on stderr\n")
    with open(tmp_path / "log", "w") as log:
      proc = prefork.popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True)
      while not (tmp_path / "log").read_text().endswith("ready False\n"):  # the whole line
        assert proc.poll() is None
        time.sleep(0.01)
      proc.kill()
      assert proc.wait(timeout=60) == -signal.SIGKILL
    assert (tmp_path / "log").read_text() == "on stderr\nready False\n"
  finally:  # a failed assert leaves no waiter running
    if proc.poll() is None:
      proc.kill()
      proc.wait()


EXITING = """
import os, sys
from tests.support import prefork
prefork.run([sys.executable, "-c", "pass"])
print(prefork._server[1], flush=True)
if END == "exit":  # a variable set later: the next command forked by a new server that has it
  first, os.environ["AFT_TESTS_SET_LATER"] = prefork.server_pid(), "x"
  code = "import os; print(os.getppid(), os.environ['AFT_TESTS_SET_LATER'])"
  done = prefork.run([sys.executable, "-c", code])
  assert first != prefork.server_pid() and done.stdout.split() == [str(prefork.server_pid()), "x"]
  sys.exit(0)
os._exit(0)
"""


@pytest.mark.parametrize("end", ["exit", "os._exit"])
def test_a_process_that_exits_leaves_no_server_folder(tmp_path, end):
  """The servers' folders go at the exit, or (os._exit) once a server's client is gone."""
  env = dict(os.environ, TMPDIR=str(tmp_path))
  done = subprocess.run([sys.executable, "-c", f"END = {end!r}" + EXITING], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)  # fmt: skip
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split()[0].startswith(str(tmp_path))  # the server's folder was there
  deadline = time.monotonic() + (60 if end == "os._exit" else 0)  # exit: stop_all removed them
  while os.listdir(tmp_path) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert os.listdir(tmp_path) == []
