"""``run`` and ``popen`` as in subprocess, ``python SCRIPT | -m MODULE | -c CODE`` forked from a
server that imported jax and the trainer once (off with ``AFT_TESTS_NO_PREFORK=1``)."""

from __future__ import annotations

import atexit
import contextlib
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
import time
import traceback
import types

# Variables a child may have other than the server's: read after the imports, or set again.
FORKABLE_ENV = ("XLA_FLAGS", "HOME", "AFT_JAX_DATA", "JAX_PLATFORMS", "PYTEST_CURRENT_TEST")
# Imported once by the server: no module that defines absl flags or that a command runs.
PRELOAD = ("aft_jax.trainer.train_lib", "aft_jax.trainer.dry_run", "aft_jax.tools.trained",
           "aft_jax.decode", "absl.app", "ml_collections.config_flags", "orbax.checkpoint",
           "grain", "tensorboardX")  # fmt: skip

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_lock = threading.Lock()
_server = None  # (Popen, socket path, the environment it started with)
_started = []  # every ``_server`` this process started and has not stopped
reaped_cpu = 0.0  # CPU seconds of the commands forked for this process (for cpu_probe.py)


def server_pid() -> int | None:
  return None if _server is None else _server[0].pid


def _same_env(a, b) -> bool:
  return all(a.get(k) == b.get(k) for k in (set(a) | set(b)) - set(FORKABLE_ENV))


def _forkable(cmd, env) -> bool:
  if cmd[0] != sys.executable or len(cmd) < 2 or os.environ.get("AFT_TESTS_NO_PREFORK"):
    return False
  if cmd[1].startswith("-") and (cmd[1] not in ("-m", "-c") or len(cmd) < 3):
    return False
  return _same_env(env, os.environ)


def stop_all() -> None:
  """Every server this process started stopped, reaped and its folder removed."""
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
  """A connection to the server, a new one if the environment changed since it started."""
  global _server
  if _server is None or _server[0].poll() is not None or not _same_env(_server[2], os.environ):
    path = os.path.join(tempfile.mkdtemp(prefix="aft-prefork-"), "socket")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # stdin a pipe that only this process holds: the server exits when it closes.
    cmd = [sys.executable, "-m", "tests.support.prefork", path]
    proc = subprocess.Popen(cmd, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    _server = (proc, path, dict(os.environ))
    _started.append(_server)
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


class Forked:
  """A forked command as a ``subprocess.Popen`` (the parts the tests use)."""

  def __init__(self, args, sock, stdout, stderr):
    self.args, self.stdout, self.stderr, self.returncode = args, stdout, stderr, None
    self._sock, self._buf = sock, bytearray()
    self.pid = _recv_line(sock, self._buf, 60)["pid"]

  def wait(self, timeout=None):
    global reaped_cpu
    if self.returncode is None:
      try:
        done = _recv_line(self._sock, self._buf, timeout)
      except (TimeoutError, BlockingIOError):
        raise subprocess.TimeoutExpired(self.args, timeout) from None
      self._sock.close()
      reaped_cpu += done["cpu"]
      self.returncode = done["returncode"]
    return self.returncode

  def poll(self):
    try:
      return self.wait(0)
    except subprocess.TimeoutExpired:
      return None

  def communicate(self, timeout=None):
    out = {}
    readers = [threading.Thread(target=lambda f=f: out.update({f: f.read()}), daemon=True)
               for f in (self.stdout, self.stderr) if f]  # fmt: skip
    for t in readers:
      t.start()
    for t in readers:
      t.join(timeout)
      if t.is_alive():
        raise subprocess.TimeoutExpired(self.args, timeout)
    self.wait(timeout)
    return out.get(self.stdout), out.get(self.stderr)

  def send_signal(self, sig) -> None:
    if self.poll() is None:  # not reaped yet: the pid is still the command's
      os.kill(self.pid, sig)

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)


def popen(cmd, *, env=None, stdout=None, stderr=None, text=False, **kw):
  """``subprocess.Popen``, forked (a ``Forked``) where it can be."""
  env, cmd = dict(os.environ if env is None else env), [str(c) for c in cmd]
  if set(kw) - {"cwd", "start_new_session"} or not _forkable(cmd, env):
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, text=text, **kw)
  pipes, fds = [None, None], [os.open(os.devnull, os.O_RDONLY)]  # the child's 0, 1, 2
  for i, target in enumerate((stdout, stderr)):
    if target is None:
      fds.append(os.dup(i + 1))
    elif target == subprocess.PIPE:
      r, w = os.pipe()
      pipes[i] = open(r, "r" if text else "rb")  # text: universal newlines, as Popen's
      fds.append(w)
    else:
      fds.append(os.dup(fds[1] if target == subprocess.STDOUT else target.fileno()))
  request = dict(argv=cmd, cwd=os.path.abspath(kw.get("cwd") or os.getcwd()), env=env)
  request["new_session"] = kw.get("start_new_session", False)
  request["ignored"] = [int(s) for s in _SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
  try:
    with _lock:
      sock = _connect()
      socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], fds)
      return Forked(cmd, sock, *pipes)
  finally:
    for fd in fds:
      os.close(fd)


def run(cmd, *, timeout=None, capture_output=True, text=True, **kw):
  """``subprocess.run`` (capturing its output), forked where it can be."""
  if not capture_output or set(kw) - {"cwd", "env"}:
    return subprocess.run(cmd, timeout=timeout, capture_output=capture_output, text=text, **kw)
  proc = popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text, **kw)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    raise
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _become(request, fds, inherited):
  """In the forked child: the server's descriptors closed, the command run (never returns)."""
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

    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS"))  # read at import
    for sig in _SIGNALS:  # as a new Python process has them
      default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
      signal.signal(sig, signal.SIG_IGN if sig in request["ignored"] else default)
    argv = request["argv"][1:]
    try:
      if argv[0] == "-m":  # what ``python ARGV`` runs, in a new ``__main__``
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in sys.argv[0]
        sys.path[0] = request["cwd"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        runpy._run_module_as_main(argv[1])
      elif argv[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
      else:
        sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
      code = 0
    except SystemExit as e:
      code = 0 if e.code is None else e.code
      if not isinstance(code, int):
        print(code, file=sys.stderr)
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
      with contextlib.suppress(Exception):
        stream.flush()
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
      pid = os.fork()
      if pid == 0:
        open_ = [listener, conn, *children, *(c for _, c in children.values())]
        _become(json.loads(msg), fds, open_)
      for fd in fds:
        os.close(fd)
      conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
      children[os.pidfd_open(pid)] = (pid, conn)
    for pidfd in [r for r in ready if isinstance(r, int)]:
      pid, conn = children.pop(pidfd)
      os.close(pidfd)
      _, status, usage = os.wait4(pid, 0)
      cpu = usage.ru_utime + usage.ru_stime
      done = {"returncode": os.waitstatus_to_exitcode(status), "cpu": cpu}
      with contextlib.suppress(OSError):
        conn.sendall(json.dumps(done).encode() + b"\n")
      conn.close()


if __name__ == "__main__":
  serve(sys.argv[1])
