"""Ctrl-C in a command: one line on stderr and exit status 130, never a crash (docs/training.md,
"Reliability"). ``os._exit`` after the ``finally`` blocks: the interpreter's shutdown would run
against the threads a Ctrl-C leaves working. A Ctrl-C in an import (a C extension's init would
abort) or a gc callback (Python drops it) is held until it returns; a second exits at once."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import signal
import sys
import threading

EXIT_STATUS = 128 + signal.SIGINT  # a command stopped by Ctrl-C, as a shell reports it


@contextlib.contextmanager
def stops_on_ctrl_c(line: str):
  """A Ctrl-C in the block ends the process: the innermost block's ``line``, exit status 130."""
  running = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
  stop = running if isinstance(running, _Stop) else _Stop(line)
  old = None
  # Only over Python's own handler: an ignored SIGINT (a background command) stays ignored.
  main = threading.current_thread() is threading.main_thread()
  if stop is not running and main and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    old = signal.signal(signal.SIGINT, stop.on_sigint)
  outer_line, stop.line = stop.line, line
  try:
    yield
  except KeyboardInterrupt:
    stop.now()
  finally:
    stop.line = outer_line
    if old is not None:
      signal.signal(signal.SIGINT, old)


class _Stop:
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
  """The outermost frame of an import, gc callback or ``__del__`` from ``frame`` down, or None."""
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
