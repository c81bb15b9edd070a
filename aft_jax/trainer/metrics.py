"""Training metrics to TensorBoard event files and the workdir's ``metrics.jsonl``
(``aft_jax.workdir``, which also reads them back)."""

from __future__ import annotations

import json
import math

from tensorboardX import SummaryWriter
from tensorboardX.summary import hparams as hparams_summaries

from aft_jax.trainer import wandb_log
from aft_jax.workdir import Workdir


class MetricWriter:
  """Writes one JSON object per logged step (with at least ``step``) and TensorBoard scalars.

  After a resume, steps between the last checkpoint and the interruption are logged again:
  readers should keep the last record of each step.
  """

  def __init__(self, workdir: str | Workdir, enabled: bool = True, wandb_run=None):
    """``wandb_run``: a W&B run (``wandb_log.start``) that gets the same records, or None."""
    self.enabled, self.wandb_run = enabled, wandb_run if enabled else None
    if enabled:
      wd = Workdir.of(workdir)
      self._jsonl = open(wd.metrics_file, "a")
      self._tb = SummaryWriter(wd.tensorboard_dir)

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
    if self.wandb_run is not None:
      wandb_log.log(self.wandb_run, record)

  def write_text(self, tag: str, text: str, step: int) -> None:
    """A text (the config, a sample) on TensorBoard's text tab; shown as written (code block)."""
    if self.enabled:
      self._tb.add_text(tag, "\n".join("    " + line for line in text.splitlines()), step)
      self._tb.flush()
    if self.wandb_run is not None and tag != "config":  # W&B has the config as its own
      wandb_log.log_text(self.wandb_run, tag, text, step)

  def write_hparams(self, settings: dict, metric_tags) -> None:
    """The run's settings (a flat dict: "model.mixing" etc.) on TensorBoard's HPARAMS tab,
    beside its scalars ``metric_tags``. Written into this run's own event file (not a sub-run,
    as ``SummaryWriter.add_hparams`` does), so that the tab shows each workdir as one row with
    its own curves."""
    if not self.enabled:
      return
    flat = {k: _hparam_value(v) for k, v in settings.items() if v is not None}
    experiment, session_start, _ = hparams_summaries(flat, dict.fromkeys(metric_tags))
    self._tb.file_writer.add_summary(experiment)
    self._tb.file_writer.add_summary(session_start)
    self._tb.flush()

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()
    if self.wandb_run is not None:
      self.wandb_run.finish()


def _hparam_value(value):
  """A number, string or bool as it is; anything else (a tuple of cutoffs) as its text."""
  return value if isinstance(value, (bool, int, float, str)) else str(value)
