"""Training metrics to stdout, TensorBoard event files and ``workdir/metrics.jsonl``."""

from __future__ import annotations

import json
import math
import os

from tensorboardX import SummaryWriter


class MetricWriter:
  """Writes one JSON object per logged step (with at least ``step``) and TensorBoard scalars.

  After a resume, steps between the last checkpoint and the interruption are logged again:
  readers should keep the last record of each step.
  """

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    if enabled:
      self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    self._jsonl.write(json.dumps(record, sort_keys=True) + "\n")
    self._jsonl.flush()
    step = record["step"]
    for key, value in record.items():
      if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
        self._tb.add_scalar(key, value, step)
    self._tb.flush()

  def write_text(self, tag: str, text: str, step: int) -> None:
    """A text (the config, a sample) on TensorBoard's text tab; shown as written (code block)."""
    if self.enabled:
      self._tb.add_text(tag, "\n".join("    " + line for line in text.splitlines()), step)
      self._tb.flush()

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """metrics.jsonl, keeping the last record of each (step, kind of record)."""
  by_key = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      by_key[(rec["step"], tuple(sorted(rec)))] = rec
  return sorted(by_key.values(), key=lambda r: r["step"])
