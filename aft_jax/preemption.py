"""Preemption: SIGTERM / Ctrl-C become a flag that the training loop checks after each step.

The step in flight finishes, the loop saves a checkpoint at that step and exits cleanly, so a
rerun resumes exactly; a second Ctrl-C stops at once.
"""

from __future__ import annotations

import signal

import jax
import numpy as np
from jax.experimental import multihost_utils


class Preemption:
  """A context manager that records SIGTERM / SIGINT instead of dying on them."""

  def __init__(self):
    self.signal = None
    self._old = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread
        pass
    return self

  def _handle(self, signum, frame):
    if self.signal is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C stops at once
    self.signal = signum

  def should_stop(self, step: int, every: int) -> bool:
    """Whether to save and stop after ``step``; all processes agree on the same step.

    One process stops at once. Several processes each see the signal at their own time, so
    they compare flags every ``every`` steps (where logging already syncs) and stop together.
    """
    if jax.process_count() == 1:
      return self.signal is not None
    if step % every:
      return False
    flags = multihost_utils.process_allgather(np.int32(self.signal is not None))
    if np.any(flags) and self.signal is None:
      self.signal = "from another process"
    return bool(np.any(flags))

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
