"""SIGTERM / Ctrl-C as a flag the training loop checks after each step: the step in flight
finishes, a checkpoint is saved, the run exits; a second Ctrl-C stops at once. Several processes
stop at one step: JAX's preemption sync manager owns SIGTERM there (one step named through the
coordination service, no device collective), and SIGINT flags are compared at log steps.
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

  def should_stop(self, step: int, every: int) -> bool:
    """Whether to save and stop after ``step`` (asked after every step, on every process): at
    once with one process; with several, at the preemption sync point (SIGTERM) or at the next
    multiple of ``every`` after a SIGINT to any of them."""
    if jax.process_count() == 1:
      return self.signal is not None
    if self._synced and multihost_utils.reached_preemption_sync_point(step):
      self.signal = "SIGTERM, preemption notice to one or more processes"
      return True
    return self._any_process(step, every)

  def _any_process(self, i: int, every: int) -> bool:
    """At every ``every``-th ``i``: whether any process got a signal (one all-gather)."""
    if i % every:
      return False
    flags = multihost_utils.process_allgather(np.int32(self.signal is not None))
    if np.any(flags) and self.signal is None:
      self.signal = "from another process"
    return bool(np.any(flags))

  def requested(self, i: int, every: int) -> bool:
    """Whether a signal asks to stop another loop (the final evaluation) before its item ``i``;
    several processes compare flags every ``every`` items."""
    if jax.process_count() == 1:
      return self.signal is not None
    return self._any_process(i, every)

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
