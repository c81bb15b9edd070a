"""SIGTERM / Ctrl-C as a flag the training loop checks after each step (a second Ctrl-C stops at
once). With several processes JAX's preemption sync manager owns SIGTERM, and SIGINT flags are
compared at log steps.
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
    self._synced = False

  def __enter__(self):
    # Whether JAX's preemption sync manager handles SIGTERM in this run (several processes).
    self._synced = jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)
    # JAX's notifier installed its own SIGTERM handler; a Python one would replace it.
    sigs = (signal.SIGINT,) if self._synced else (signal.SIGTERM, signal.SIGINT)
    for sig in sigs:
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread
        pass
    return self

  def _handle(self, signum, frame):
    if self.signal is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C stops at once
    self.signal = signum

  def should_stop(self, i: int, every: int, synced: bool = True) -> bool:
    """Whether to stop after step (or before item) ``i``: with several processes, at the
    preemption sync point (``synced``: the training loop's steps) or at the next multiple of
    ``every`` after a signal to any of them."""
    if jax.process_count() == 1:
      return self.signal is not None
    if synced and self._synced and multihost_utils.reached_preemption_sync_point(i):
      self.signal = "SIGTERM, preemption notice to one or more processes"
      return True
    if i % every:
      return False
    flags = multihost_utils.process_allgather(np.int32(self.signal is not None))
    if np.any(flags) and self.signal is None:
      self.signal = "from another process"
    return bool(np.any(flags))

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
