"""What the training loop shows and records while it runs: ``StepLog`` (per-step metrics,
the non-finite-update watch, one record per log step), ``Profiler`` (a ``jax.profiler`` trace
of chosen steps) and validation lines. ``aft_jax.train_lib.train_loop`` drives them.
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

from aft_jax.metrics import MetricWriter

if TYPE_CHECKING:  # only for annotations: train_lib imports this module
  from aft_jax.train_lib import Run, TrainState


class StepLog:
  """Collects per-step metrics on the device, reads each step's finite flag two steps behind,
  and writes one record per logged step.

  Reading the flag of the step before last waits for that step only while the two after it
  are already queued: the device never idles, and the host stays at most two steps ahead of
  it, so a signal is acted on within two steps and a run of skipped (non-finite) updates is
  seen as it happens. (One step behind measured slower on CPU, where the host's work and the
  step share the cores.)
  """

  def __init__(self, run: Run, writer: MetricWriter, bar, mngr, step: int):
    self.run, self.writer, self.bar, self.mngr = run, writer, bar, mngr
    self.pending, self.t_last = [], time.perf_counter()
    self.step = step  # the step of the last metrics added
    self.checked = 0  # how many of ``pending`` have had their finite flag read
    self.skipped_since = None  # first step of the current run of skipped updates, if any

  def add(self, metrics) -> None:
    """Adds the next step's metrics and reads the finite flag of the step before last."""
    self.pending.append(metrics)
    self.step += 1
    self._check(len(self.pending) - 2)

  def settle(self) -> None:
    """Reads the finite flags of every step added so far (waits for the last one)."""
    self._check(len(self.pending))

  def _check(self, upto: int) -> None:
    """Tracks skipped updates; raises on one with nonfinite='stop', or on too many in a row."""
    config = self.run.config
    first = self.step - len(self.pending) + 1  # the step of pending[0]
    for i in range(self.checked, upto):
      step = first + i
      if bool(self.pending[i]["finite"]):
        self.skipped_since = None
        continue
      if config.nonfinite == "stop":
        raise FloatingPointError(
          f"non-finite loss or gradient at step {step}; {self.last_good()} (set "
          "nonfinite='skip' to skip such updates)"
        )
      self.skipped_since = self.skipped_since or step
      skips = step - self.skipped_since + 1
      if config.max_consecutive_skips and skips >= config.max_consecutive_skips:
        raise FloatingPointError(
          f"training diverged: the {skips} updates of steps {self.skipped_since}-{step} were "
          f"all non-finite and skipped (max_consecutive_skips = "
          f"{config.max_consecutive_skips}); {self.last_good()}: lower learning_rate (or fix "
          "the data) and resume from it with --allow_config_change"
        )
    self.checked = max(self.checked, upto)

  def last_good(self) -> str:
    # Checkpoints are never written inside a run of skipped updates (see _checkpoint).
    latest = self.mngr.latest_step()
    if latest is None:
      return "there is no checkpoint yet"
    return f"the last good checkpoint is step {latest}"

  def flush(self, state: TrainState, check: bool = True) -> None:
    """Writes the mean metrics since the last flush; raises on a non-finite step if asked to
    (``check``: False when writing what is left after such an error)."""
    if check:
      self.settle()
    config, step = self.run.config, self.step
    stacked = jax.device_get(self.pending)  # all ready: settle waited for the last step
    elapsed = time.perf_counter() - self.t_last
    n = len(stacked)
    losses = [float(m["loss"]) for m in stacked if bool(m["finite"])]
    record = {
      "step": step,
      "loss": float(np.mean(losses)) if losses else float("nan"),
      "learning_rate": float(stacked[-1]["learning_rate"]),
      "grad_norm": float(np.mean([float(m["grad_norm"]) for m in stacked])),
      "tokens_per_sec": config.batch_size * config.seq_len * n / elapsed,
      "step_time": elapsed / n,
      "skipped_steps": int(state.skipped),
    }
    record["perplexity"] = math.exp(min(record["loss"], 50.0))
    self.writer.write(record)
    self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
    if self.run.is_main:
      self.bar.write(
        f"step {step}: loss {record['loss']:.4f}  ppl {record['perplexity']:.2f}  "
        f"lr {record['learning_rate']:.2e}  grad_norm {record['grad_norm']:.3f}  "
        f"{record['tokens_per_sec']:.0f} tokens/s  {record['step_time'] * 1e3:.1f} ms/step"
      )
    self.pending, self.checked, self.t_last = [], 0, time.perf_counter()


class Profiler:
  """A ``jax.profiler`` trace of steps ``start + 1 .. stop`` (``config.profile_steps``) in the
  run's TensorBoard folder, written by process 0."""

  def __init__(self, run: Run):
    self.steps = tuple(run.config.get("profile_steps") or ()) if run.is_main else ()
    self.logdir = os.path.join(run.workdir, "tensorboard")
    self.active = False

  def __enter__(self):
    return self

  def at(self, step: int, state) -> None:
    """Called with the number of steps done, before the next one."""
    if not self.steps:
      return
    if step == self.steps[0] and not self.active:
      jax.profiler.start_trace(self.logdir)
      self.active = True
    elif step >= self.steps[1] and self.active:
      jax.block_until_ready(state)  # the traced steps' device work belongs in the trace
      self._stop()

  def _stop(self):
    jax.profiler.stop_trace()
    self.active = False
    print(f"Wrote a profile of steps {self.steps} to {self.logdir}", flush=True)

  def __exit__(self, *exc):
    if self.active:  # the run ended (or stopped) inside the traced steps
      self._stop()


# The scalars that TensorBoard's HPARAMS tab shows beside each run's settings.
HPARAMS_METRICS = ("loss", "valid_loss", "valid_ppl", "test_loss", "test_ppl")


def log_validation(run: Run, writer: MetricWriter, bar, step: int, ev: dict) -> None:
  """A validation result in the metrics and on the console."""
  writer.write({"step": step, "valid_loss": ev["nll"], "valid_ppl": ev["ppl"]})
  if run.is_main:
    bpb = f"  bpb {ev['nll'] / math.log(2):.3f}" if run.corpus.unit == "byte" else ""
    bar.write(f"step {step}: validation loss {ev['nll']:.4f}  ppl {ev['ppl']:.2f}{bpb}")
