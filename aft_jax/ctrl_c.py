"""Ctrl-C (SIGINT) in a command: one line on stderr and exit status 130, never a crash
(docs/training.md, "Reliability"). Every command runs inside ``stops_on_ctrl_c(line)``, entered
before its heavy imports. The KeyboardInterrupt unwinds the ``finally`` blocks (temporary files,
locks), then the process ends with ``os._exit(130)``: the interpreter's shutdown would run
against threads a Ctrl-C leaves working (TensorStore's reads, XLA's dispatched computations,
SentencePiece's training) and print tracebacks or crash. A Ctrl-C is held where raising it would
crash or be lost: during an import (in a C extension's initialisation it becomes a C++
exception that aborts) and in a garbage-collector callback or ``__del__`` (printed and dropped);
it is raised as the outermost import returns, or at the first Python call after the callback.
A second Ctrl-C exits at once. SIGINT that the process ignores (a background command) stays
ignored."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import signal
import sys
import threading

# The exit status of a command stopped by Ctrl-C: 128 + SIGINT, as a shell reports it.
EXIT_STATUS = 128 + signal.SIGINT


@contextlib.contextmanager
def stops_on_ctrl_c(line: str):
  """Runs the block as a command: a Ctrl-C ends the process with ``line`` on stderr and exit
  status 130 (the innermost block's ``line``); anything else raised passes through."""
  running = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
  stop = running if isinstance(running, _Stop) else _Stop(line)
  old = None if stop is running else _install(stop.on_sigint)
  outer_line, stop.line = stop.line, line
  try:
    yield
  except KeyboardInterrupt:
    stop.now()
  finally:
    stop.line = outer_line
    if old is not None:
      signal.signal(signal.SIGINT, old)


def _install(handler):
  """``handler`` for SIGINT where Python's own is in place (main thread only): the one it
  replaced, or None if it left SIGINT as it was (ignored, or someone else's)."""
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
    self.held = False  # a first Ctrl-C waits for the code where it landed to return

  def on_sigint(self, signum, frame):
    if self.raised or self.held:
      self._exit()
    outer = _outermost_holding(frame)
    if outer is None:
      self._raise()
    # Raised by a trace function once ``outer`` is done (sending SIGINT again from here would
    # only run this handler again at once, inside it).
    self.held = True
    if outer.f_code.co_filename == _IMPORT_SYSTEM:  # as the import returns, into its caller
      outer.f_trace, outer.f_trace_lines = self._raise_on_return, False
      sys.settrace(lambda *_: None)  # (a frame's own trace function runs only while one is set)
    else:  # a callback returns into C code: at the next Python call outside it
      sys.settrace(self._raise_outside)

  def _raise_on_return(self, frame, event, arg):
    if event == "return":
      self._raise()
    return self._raise_on_return

  def _raise_outside(self, frame, event, arg):
    if event == "call" and _outermost_holding(frame) is None:
      self._raise()  # in ``frame``, as if its function raised it as it began
    return None  # (no line events: this frame is not traced further)

  def _raise(self):
    if self.held:
      sys.settrace(None)
      self.held = False
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


def _outermost_holding(frame):
  """The outermost frame from ``frame`` down of code that holds a Ctrl-C (an import, a gc
  callback or a ``__del__``); None if there is none."""
  callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
  outer = None
  while frame is not None:
    code = frame.f_code
    if code in callbacks or code.co_name == "__del__" or code.co_filename == _IMPORT_SYSTEM:
      outer = frame
    frame = frame.f_back
  return outer


# The file of the import system's functions (importlib._bootstrap), one of which is the first
# on the stack of every import, an extension's loading included.
_IMPORT_SYSTEM = importlib._bootstrap._find_and_load.__code__.co_filename
