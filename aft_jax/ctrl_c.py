"""Ctrl-C (SIGINT) in a command: one line on stderr and exit status 130, never a crash.

130 is 128 + SIGINT, the status a shell gives a command that SIGINT stopped. Every command
(aft-train and train.py, aft-generate, aft-evaluate, aft-export, aft-prepare) runs inside
``stops_on_ctrl_c(line)``:

- A Ctrl-C is Python's KeyboardInterrupt, so the ``finally`` and ``with`` blocks it leaves run
  on its way out (a temporary file removed, a lock released).
- When it reaches ``stops_on_ctrl_c``, stdout is flushed, ``line`` printed on stderr and the
  process ends with ``os._exit(130)``, without the interpreter's shutdown. A Ctrl-C leaves work
  running in other threads: TensorStore's reads of a checkpoint, whose callbacks go on into the
  event loop Orbax has closed, XLA's computations dispatched asynchronously, SentencePiece's
  training (``aft_jax.data.subword``), which cannot be stopped. The shutdown (the atexit
  handlers, jax's clearing its backends among them, then every module freed) would run against
  them: their calls into the interpreter print tracebacks after the line, or crash it (SIGSEGV)
  where they touch what it has freed. Skipping it loses nothing: the commands write their files
  atomically, in blocks that have cleaned up before the KeyboardInterrupt gets here, and stdout
  is flushed here.
- A Ctrl-C that arrives inside a garbage-collector callback (jax has one) or a ``__del__``,
  where Python would print its KeyboardInterrupt as "Exception ignored" and drop it, is raised
  at the first Python call outside that code.
- A second Ctrl-C ends the process as above at once, wherever it lands: one while the first is
  on its way out (stuck flushing to a pipe no one reads, say), or after a first that some
  library caught.

SIGINT that the process ignores (a command started in the background) stays ignored.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading

# The exit status of a command stopped by Ctrl-C: 128 + SIGINT, as a shell reports it.
EXIT_STATUS = 128 + signal.SIGINT


@contextlib.contextmanager
def stops_on_ctrl_c(line: str):
  """Runs the block as a command: a Ctrl-C in it ends the process with ``line`` on stderr and
  exit status 130 (the module docstring says how and why). Anything else the block raises,
  SystemExit included, passes through."""
  stop = _Stop(line)
  old = _install(stop.on_sigint)
  try:
    yield
  except KeyboardInterrupt:
    stop.now()
  finally:
    if old is not None:
      signal.signal(signal.SIGINT, old)


def _install(handler):
  """``handler`` for SIGINT where Python's own is in place (in the main thread: a handler can
  be set only there): the one it replaced, or None if it left SIGINT as it was (ignored, or
  someone else's handler)."""
  if threading.current_thread() is not threading.main_thread():
    return None
  if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
    return None
  return signal.signal(signal.SIGINT, handler)


class _Stop:
  """How a command stopped by Ctrl-C ends: ``on_sigint`` handles SIGINT, ``now`` exits."""

  def __init__(self, line: str):
    self.line = line
    self.raised = False  # a KeyboardInterrupt was raised for a first Ctrl-C
    self.waiting = False  # a Ctrl-C waits for the code that would drop it to return

  def on_sigint(self, signum, frame):
    if self.raised:
      self._exit()
    if _drops_exceptions(frame):
      # Raised at the next Python call outside that code (a trace function sees each call),
      # not here, where it would be dropped: sending SIGINT again from here would only run this
      # handler again at once, inside it.
      self.waiting = True
      sys.settrace(self._raise_outside)
      return
    self._raise()

  def _raise_outside(self, frame, event, arg):
    if event == "call" and not _drops_exceptions(frame):
      self._raise()  # in ``frame``, as if its function raised it as it began
    return None  # (no line events: this frame is not traced further)

  def _raise(self):
    if self.waiting:
      sys.settrace(None)
      self.waiting = False
    self.raised = True
    raise KeyboardInterrupt

  def now(self):
    self.raised = True  # a Ctrl-C while stdout is flushed exits without it
    with contextlib.suppress(OSError, ValueError):  # a closed pipe, a closed stream
      sys.stdout.flush()
    self._exit()

  def _exit(self):
    with contextlib.suppress(OSError, ValueError):
      print(self.line, file=sys.stderr, flush=True)
    os._exit(EXIT_STATUS)


def _drops_exceptions(frame) -> bool:
  """Whether ``frame`` runs inside code whose exceptions Python prints as "Exception ignored"
  and drops: a garbage-collector callback or a ``__del__`` (``frame`` or a frame it was called
  from)."""
  callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
  while frame is not None:
    if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
      return True
    frame = frame.f_back
  return False
