"""The tests' Python commands (``python SCRIPT | -m MODULE | -c CODE ...``) forked from a server
that imported jax and the trainer once (~2.5 CPU-s per command saved).

``run`` and ``popen`` stand in for ``subprocess.run`` and ``subprocess.Popen``. The server
starts no jax backend and no thread, so the forked child is a fresh process that skipped its
imports: argv, cwd, environment, stdio, signal dispositions (SIGINT ignored where this process
ignores it), a new session if asked, exit status (-N for signal N) as a subprocess's. A child
ends with its atexit handlers and ``os._exit``: what goes wrong only in the interpreter's
shutdown shows with ``AFT_TESTS_NO_PREFORK=1`` (every command a subprocess). A command the
server cannot give (another program or option, another environment but ``FORKABLE_ENV``, an
unknown keyword) runs as a subprocess. tests/test_suite.py compares the two.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types

# Variables a child may have other than the server's: read after the imports, or (``_JAX_CONFIG``)
# set again in the child.
FORKABLE_ENV = ("XLA_FLAGS", "HOME", "AFT_JAX_DATA", "JAX_PLATFORMS", "PYTEST_CURRENT_TEST")
_JAX_CONFIG = {"JAX_PLATFORMS": "jax_platforms"}
# Imported once by the server: no module that defines absl flags or that a command runs.
PRELOAD = (
  "aft_jax.trainer.train_lib",
  "aft_jax.trainer.dry_run",
  "aft_jax.tools.trained",
  "aft_jax.decode",
  "absl.app",
  "ml_collections.config_flags",
  "orbax.checkpoint",
  "grain",
  "tensorboardX",
)

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_lock = threading.Lock()
_server = None  # (Popen, socket path, the environment it started with)
_started = []  # every ``_server`` this process started and has not stopped
_reaped_cpu = 0.0  # CPU seconds of the commands forked for this process (for cpu_probe.py)


def server_pid() -> int | None:
  return None if _server is None else _server[0].pid


def reaped_cpu() -> float:
  return _reaped_cpu


def _forkable(cmd, env) -> bool:
  if cmd[0] != sys.executable or len(cmd) < 2:
    return False
  if cmd[1].startswith("-") and (cmd[1] not in ("-m", "-c") or len(cmd) < 3):
    return False
  return _same_env(env, os.environ)


def _same_env(a, b) -> bool:
  """Whether environments ``a`` and ``b`` agree on everything but ``FORKABLE_ENV``."""
  return all(a.get(k) == b.get(k) for k in (set(a) | set(b)) - set(FORKABLE_ENV))


def _start_server():
  global _server
  folder = tempfile.mkdtemp(prefix="aft-prefork-")
  path = os.path.join(folder, "socket")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ)
  # stdin a pipe that only this process holds: the server exits when it closes.
  proc = subprocess.Popen(
    [sys.executable, "-m", "tests.support.prefork", path],
    cwd=root,
    env=env,
    stdin=subprocess.PIPE,
    stdout=subprocess.DEVNULL,
  )
  _server = (proc, path, env)
  _started.append(_server)


def stop_all() -> None:
  """Every server this process started stopped, reaped (its commands' CPU counts as this
  process's children's) and its folder removed: at exit and from tests/conftest.py."""
  global _server
  with _lock:
    _server = None
    while _started:
      proc, path, _ = _started.pop()
      proc.stdin.close()
      try:
        proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
      shutil.rmtree(os.path.dirname(path), ignore_errors=True)


atexit.register(stop_all)


def _connect() -> socket.socket:
  """A connection to the server, started if it is not running."""
  import time

  global _server
  if _server is not None and not _same_env(_server[2], os.environ):
    # The environment changed since the server started: a new server, whose imports see it
    # (the old one serves its commands until ``stop_all``).
    _server = None
  if _server is None or _server[0].poll() is not None:
    _start_server()
  proc, path, _ = _server
  deadline = time.monotonic() + 120
  while True:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      sock.connect(path)
      return sock
    except (FileNotFoundError, ConnectionRefusedError):
      sock.close()
      if proc.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f"the fork server {path} did not start (exit {proc.poll()})") from None
      time.sleep(0.05)


def _recv_line(sock, buf: bytearray, timeout):
  sock.settimeout(timeout)
  while b"\n" not in buf:
    chunk = sock.recv(4096)
    if not chunk:
      raise RuntimeError("the fork server closed the connection")
    buf += chunk
  line, _, rest = bytes(buf).partition(b"\n")
  buf[:] = rest
  return json.loads(line)


def _start(cmd, cwd, env, fds, new_session=False):
  """(connection, buffer, pid): ``cmd`` forked with stdin, stdout and stderr ``fds``."""
  sock = _connect()
  request = {"argv": cmd, "cwd": os.path.abspath(cwd or os.getcwd()), "env": env}
  request["new_session"] = new_session
  # ignored as a subprocess would inherit them
  request["ignored"] = [int(s) for s in _SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
  socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], fds)
  buf = bytearray()
  return sock, buf, _recv_line(sock, buf, 60)["pid"]


class Forked:
  """A forked command as a ``subprocess.Popen`` (the parts the tests use); the server reaps it
  and sends its status."""

  def __init__(self, args, sock, buf, pid, stdout, stderr):
    self.args, self.pid, self.stdout, self.stderr = args, pid, stdout, stderr
    self._sock, self._buf, self.returncode = sock, buf, None

  def _status(self, timeout) -> None:
    global _reaped_cpu
    done = _recv_line(self._sock, self._buf, timeout)
    self._sock.close()
    _reaped_cpu += done["cpu"]
    self.returncode = done["returncode"]

  def poll(self):
    if self.returncode is None:
      try:
        self._status(0)
      except (TimeoutError, BlockingIOError):
        pass
    return self.returncode

  def wait(self, timeout=None):
    if self.returncode is None:
      try:
        self._status(timeout)
      except (TimeoutError, BlockingIOError):
        raise subprocess.TimeoutExpired(self.args, timeout) from None
    return self.returncode

  def communicate(self, timeout=None):
    out = {}
    readers = [
      threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f.read()), daemon=True)
      for k, f in (("stdout", self.stdout), ("stderr", self.stderr))
      if f is not None
    ]
    for t in readers:
      t.start()
    for t in readers:
      t.join(timeout)
      if t.is_alive():
        raise subprocess.TimeoutExpired(self.args, timeout)
    self.wait(timeout)
    return out.get("stdout"), out.get("stderr")

  def send_signal(self, sig) -> None:
    if self.poll() is None:  # not reaped yet: the pid is still the command's
      os.kill(self.pid, sig)

  def terminate(self) -> None:
    self.send_signal(signal.SIGTERM)

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)


def popen(cmd, *, cwd=None, env=None, stdout=None, stderr=None, text=False, **kw):
  """``subprocess.Popen``, forked (a ``Forked``) where it can be; stdout and stderr None,
  ``subprocess.PIPE``, a file or (stderr) ``subprocess.STDOUT``."""
  env = dict(os.environ if env is None else env)
  new_session = kw.pop("start_new_session", False)
  cmd = list(map(str, cmd))
  with _lock:
    direct = kw or os.environ.get("AFT_TESTS_NO_PREFORK") or not _forkable(cmd, env)
    if not direct:
      pipes, fds = {}, [os.open(os.devnull, os.O_RDONLY)]
      for name, target in (("stdout", stdout), ("stderr", stderr)):
        if target is None:
          fds.append(os.dup(1 if name == "stdout" else 2))
        elif target == subprocess.PIPE:
          r, w = os.pipe()
          pipes[name] = open(r, "r" if text else "rb")  # text: universal newlines, as Popen's
          fds.append(w)
        elif target == subprocess.STDOUT:
          fds.append(os.dup(fds[1]))
        else:
          fds.append(os.dup(target.fileno()))
      try:
        sock, buf, pid = _start(cmd, cwd, env, fds, new_session)
      finally:
        for fd in fds:
          os.close(fd)
      return Forked(cmd, sock, buf, pid, pipes.get("stdout"), pipes.get("stderr"))
  return subprocess.Popen(
    cmd,
    cwd=cwd,
    env=env,
    stdout=stdout,
    stderr=stderr,
    text=text,
    start_new_session=new_session,
    **kw,
  )


def run(cmd, *, cwd=None, env=None, timeout=None, capture_output=True, text=True, **kw):
  """``subprocess.run`` (capturing its output), forked where it can be."""
  env = dict(os.environ if env is None else env)
  cmd = list(map(str, cmd))
  with _lock:
    direct = kw or not capture_output or os.environ.get("AFT_TESTS_NO_PREFORK")
    if direct or not _forkable(cmd, env):
      return subprocess.run(
        cmd, cwd=cwd, env=env, timeout=timeout, capture_output=capture_output, text=text, **kw
      )
  proc = popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text)
  try:
    out, err = proc.communicate(timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    raise
  return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _become(request, fds, inherited):
  """In the forked child: the server's ``inherited`` descriptors closed, the command run, its
  status the exit's (never returns)."""
  code = 1
  try:
    for f in inherited:
      os.close(f) if isinstance(f, int) else f.close()
    if request["new_session"]:
      os.setsid()
    for target, fd in enumerate(fds):
      os.dup2(fd, target)
      os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import jax

    for key, name in _JAX_CONFIG.items():
      jax.config.update(name, os.environ.get(key))
    for sig in _SIGNALS:  # as a new Python process has them
      default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
      signal.signal(sig, signal.SIG_IGN if sig in request["ignored"] else default)
    argv = request["argv"][1:]
    try:
      if argv[0] == "-m":  # what python -m runs, in a new __main__ module
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in sys.argv[0]
        sys.path[0] = request["cwd"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        runpy._run_module_as_main(argv[1])
      elif argv[0] == "-c":  # what python -c runs
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
      else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
      code = 0
    except SystemExit as e:
      if e.code is None:
        code = 0
      elif isinstance(e.code, int):
        code = e.code
      else:
        print(e.code, file=sys.stderr)
        code = 1
    except BaseException as e:  # reported as Python reports it, from the command's own frames
      tb, mine = e.__traceback__, (__file__, "<frozen runpy>")
      while tb is not None and tb.tb_frame.f_code.co_filename in mine:
        if argv[0] == "-m" and tb.tb_frame.f_code.co_name == "_run_module_as_main":
          break  # python -m shows runpy's frames from there
        tb = tb.tb_next
      traceback.print_exception(type(e), e, tb)
      code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    atexit._run_exitfuncs()
  except BaseException:  # the fork server's own failure to start the command: said, exit 1
    traceback.print_exc()
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:
        pass
    if code < 0:  # died of the signal, as Python does for an uncaught KeyboardInterrupt
      signal.signal(-code, signal.SIG_DFL)
      os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def serve(path: str) -> None:
  for name in PRELOAD:
    __import__(name)
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path + ".tmp")
  os.rename(path + ".tmp", path)  # clients connect only once it listens
  listener.listen(16)
  children = {}  # pidfd -> (pid, connection)
  while True:
    ready, _, _ = select.select([listener, sys.stdin, *children], [], [])
    if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
      for pid, _ in children.values():
        os.kill(pid, signal.SIGKILL)
      # The client is gone (maybe without its atexit handlers): its folder goes too.
      shutil.rmtree(os.path.dirname(path), ignore_errors=True)
      return
    if listener in ready:
      conn, _ = listener.accept()
      msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
      while not msg.endswith(b"\n"):
        msg += conn.recv(1 << 20)
      request = json.loads(msg)
      pid = os.fork()
      if pid == 0:
        open_ = [listener, conn, *children, *(c for _, c in children.values())]
        _become(request, fds, open_)
      for fd in fds:
        os.close(fd)
      conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
      children[os.pidfd_open(pid)] = (pid, conn)
    for pidfd in [r for r in ready if isinstance(r, int)]:
      pid, conn = children.pop(pidfd)
      os.close(pidfd)
      _, status, usage = os.wait4(pid, 0)
      done = {
        "returncode": os.waitstatus_to_exitcode(status),
        "cpu": usage.ru_utime + usage.ru_stime,
      }
      try:
        conn.sendall(json.dumps(done).encode() + b"\n")
      except OSError:
        pass
      conn.close()


if __name__ == "__main__":
  serve(sys.argv[1])
