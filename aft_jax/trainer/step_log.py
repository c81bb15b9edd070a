"""What the training loop records: ``MetricWriter`` (metrics.jsonl, TensorBoard, W&B),
``StepLog`` (per-step metrics, the non-finite watch) and ``Profiler`` (a trace of chosen steps).
Docs: docs/training.md, "Weights & Biases".
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import secrets
import time

import jax
import numpy as np
from tensorboardX import SummaryWriter
from tensorboardX.summary import hparams as hparams_summaries

from aft_jax import files
from aft_jax.typed_config import TypedConfig, positive
from aft_jax.workdir import Workdir


class MetricWriter:
  """Writes one JSON object per logged step (with at least ``step``) and TensorBoard scalars."""

  def __init__(self, workdir: str | Workdir, wandb_run=None):
    wd = Workdir.of(workdir)
    self.wandb_run = wandb_run
    self._jsonl = open(wd.metrics_file, "a")
    self._tb = SummaryWriter(wd.tensorboard_dir)

  def write(self, record: dict) -> None:
    self._jsonl.write(json.dumps(record, sort_keys=True) + "\n")
    self._jsonl.flush()
    step = record["step"]
    for key, value in record.items():
      if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
        self._tb.add_scalar(key, value, step)
    self._tb.flush()
    if self.wandb_run is not None:
      scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
      self.wandb_run.log(scalars, step=int(step))

  def write_text(self, tag: str, text: str, step: int) -> None:
    """A text (the config, a sample) on TensorBoard's text tab, as a code block."""
    self._tb.add_text(tag, "\n".join("    " + line for line in text.splitlines()), step)
    self._tb.flush()
    if self.wandb_run is not None and tag != "config":  # W&B has the config as its own
      import wandb  # pylint: disable=g-import-not-at-top  (only with a W&B run)

      self.wandb_run.log({tag: wandb.Table(columns=[tag], data=[[text]])}, step=step)

  def write_hparams(self, settings: dict) -> None:
    """The run's settings on TensorBoard's HPARAMS tab, in this run's own event file."""
    # A number, string or bool as it is; anything else (a tuple of cutoffs) as its text.
    flat = {
      k: v if isinstance(v, (bool, int, float, str)) else str(v)
      for k, v in settings.items()
      if v is not None
    }
    metrics = dict.fromkeys(("loss", "valid_loss", "valid_ppl", "test_loss", "test_ppl"))
    experiment, session_start, _ = hparams_summaries(flat, metrics)
    self._tb.file_writer.add_summary(experiment)
    self._tb.file_writer.add_summary(session_start)
    self._tb.flush()

  def close(self) -> None:
    self._jsonl.close()
    self._tb.close()
    if self.wandb_run is not None:
      self.wandb_run.finish()


class NoMetrics:
  """The metric writer of processes other than 0: process 0 alone writes metrics."""

  def write(self, *args) -> None:
    pass

  write_text = write_hparams = close = write


@dataclasses.dataclass(frozen=True)
class StepLogConfig(TypedConfig):
  """Keys at the top of the config tree (``config.log_every_steps``, ...)."""

  # Before these keys, skipped updates never stopped a run and no step was traced
  # (TypedConfig.as_written).
  ADDED = {"max_consecutive_skips": ("d656de0", 0), "profile_steps": ("7899ccd", ())}

  log_every_steps: int = 50  # metrics to the console, metrics.jsonl and TensorBoard
  nonfinite: str = "skip"  # non-finite loss/gradient: 'skip' the update or 'stop'
  # 'skip': stop the run when this many updates in a row were skipped (diverged); 0: never
  max_consecutive_skips: int = 10
  # (start, stop): a jax.profiler trace of steps start+1 .. stop in <workdir>/tensorboard
  # (TensorBoard's profile tab); () or None: no trace
  profile_steps: tuple = ()

  def _value_problems(self) -> list[str]:
    errors = positive(self, "log_every_steps")
    if self.nonfinite not in ("skip", "stop"):
      errors.append(f"config.nonfinite = {self.nonfinite!r} is not 'skip' or 'stop'")
    if self.max_consecutive_skips < 0:
      errors.append(f"config.max_consecutive_skips = {self.max_consecutive_skips} must be >= 0")
    steps = self.profile_steps or ()
    if steps and (
      len(steps) != 2 or not all(isinstance(x, int) for x in steps) or not 0 <= steps[0] < steps[1]
    ):
      errors.append(
        f"config.profile_steps = {tuple(steps)} must be (start, stop) with 0 <= start < stop, "
        "or () for no trace"
      )
    return errors


class StepLog:
  """Collects per-step metrics on the device, reading each step's finite flag two steps behind."""

  def __init__(self, trainer, writer: MetricWriter, bar, mngr, step: int):
    cfg, train = trainer.config.step_log, trainer.config.train
    self.writer, self.bar, self.mngr, self.good_steps = writer, bar, mngr, trainer.good_steps
    self.nonfinite, self.max_consecutive_skips = cfg.nonfinite, cfg.max_consecutive_skips
    self.tokens_per_step, self.is_main = train.batch_size * train.seq_len, trainer.is_main
    self.pending, self.t_last = [], time.perf_counter()
    self.step = step  # the step of the last metrics added
    self.checked = 0  # how many of ``pending`` have had their finite flag read
    self.skipped_since = None  # first step of the current run of skipped updates, if any

  def add(self, metrics) -> None:
    self.pending.append(metrics)
    self.step += 1
    self._check(len(self.pending) - 2)

  def settle(self) -> None:
    """Reads the finite flags of every step added so far."""
    self._check(len(self.pending))

  def _check(self, upto: int) -> None:
    first = self.step - len(self.pending) + 1  # the step of pending[0]
    for i in range(self.checked, upto):
      step = first + i
      if bool(self.pending[i]["finite"]):
        self.skipped_since = None
        continue
      if self.nonfinite == "stop":
        raise FloatingPointError(
          f"non-finite loss or gradient at step {step}; {self.last_good()} (set "
          "nonfinite='skip' to skip such updates)"
        )
      self.skipped_since = self.skipped_since or step
      skips = step - self.skipped_since + 1
      if self.max_consecutive_skips and skips >= self.max_consecutive_skips:
        raise FloatingPointError(
          f"training diverged: the {skips} updates of steps {self.skipped_since}-{step} were "
          f"all non-finite and skipped (max_consecutive_skips = "
          f"{self.max_consecutive_skips}); {self.last_good()}: lower learning_rate (or fix "
          "the data) and resume from it with --allow_config_change"
        )
    self.checked = max(self.checked, upto)

  def last_good(self) -> str:
    # No checkpoint is written inside a run of skipped updates: the newest known good is it.
    steps = [s for s in self.mngr.all_steps() if s in self.good_steps]
    if not steps:
      return "there is no checkpoint yet"
    return f"the last good checkpoint is step {max(steps)}"

  def flush(self, state, check: bool = True) -> None:
    """Writes the mean metrics since the last flush (``check``: non-finite steps raise first)."""
    if check:
      self.settle()
    step = self.step
    stacked = jax.device_get(self.pending)  # all ready: settle waited for the last step
    elapsed = time.perf_counter() - self.t_last
    n = len(stacked)
    losses = [float(m["loss"]) for m in stacked if bool(m["finite"])]
    record = {
      "step": step,
      "loss": float(np.mean(losses)) if losses else float("nan"),
      "learning_rate": float(stacked[-1]["learning_rate"]),
      "grad_norm": float(np.mean([float(m["grad_norm"]) for m in stacked])),
      "tokens_per_sec": self.tokens_per_step * n / elapsed,
      "step_time": elapsed / n,
      "skipped_steps": int(state.skipped),
    }
    record["perplexity"] = math.exp(min(record["loss"], 50.0))
    self.writer.write(record)
    self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
    if self.is_main:
      self.bar.write(
        f"step {step}: loss {record['loss']:.4f}  ppl {record['perplexity']:.2f}  "
        f"lr {record['learning_rate']:.2e}  grad_norm {record['grad_norm']:.3f}  "
        f"{record['tokens_per_sec']:.0f} tokens/s  {record['step_time'] * 1e3:.1f} ms/step"
      )
    self.pending, self.checked, self.t_last = [], 0, time.perf_counter()

  def validation(self, ev: dict, *, byte_level: bool) -> None:
    """``Trainer.evaluate``'s result at this step, in the metrics and on the console."""
    self.writer.write({"step": self.step, "valid_loss": ev["nll"], "valid_ppl": ev["ppl"]})
    if self.is_main:
      bpb = f"  bpb {ev['nll'] / math.log(2):.3f}" if byte_level else ""
      self.bar.write(f"step {self.step}: validation loss {ev['nll']:.4f}  ppl {ev['ppl']:.2f}{bpb}")


class Profiler:
  """A ``jax.profiler`` trace of steps ``start + 1 .. stop`` (``profile_steps``) in ``logdir``."""

  def __init__(self, steps, logdir: str):
    self.steps, self.logdir, self.active = tuple(steps or ()), logdir, False

  def __enter__(self):
    return self

  def at(self, step: int, state) -> None:
    if self.steps and step == self.steps[0] and not self.active:
      jax.profiler.start_trace(self.logdir)
      self.active = True
    elif self.active and step >= self.steps[1]:
      jax.block_until_ready(state)  # the traced steps' device work belongs in the trace
      self._stop()

  def _stop(self):
    jax.profiler.stop_trace()
    self.active = False
    print(f"Wrote a profile of steps {self.steps} to {self.logdir}", flush=True)

  def __exit__(self, *exc):
    if self.active:  # the run ended (or stopped) inside the traced steps
      self._stop()


WANDB_INSTALL = 'pip install "aft-jax[wandb]"'
WANDB_ID_FILE = "wandb_run_id"  # in the workdir: the W&B run a resumed run continues


@dataclasses.dataclass(frozen=True)
class WandbConfig(TypedConfig):
  """``config.wandb.*``."""

  WHERE = "wandb"
  # Added with W&B itself: a config without them ran without W&B (TypedConfig.as_written).
  ADDED = {"project": ("e72b922", ""), "entity": ("e72b922", ""), "name": ("e72b922", "")}

  project: str = ""  # a W&B project to log to ('': no W&B); needs the 'wandb' extra
  entity: str = ""  # the W&B team or user ('': your default)
  name: str = ""  # the run's name on W&B ('': the workdir's folder name)

  def _value_problems(self) -> list[str]:
    if not self.project:
      return [
        f"{self.key(k)} = {getattr(self, k)!r} needs {self.key('project')}: without a "
        "project W&B is off (set the project, or leave it empty)"
        for k in ("entity", "name")
        if getattr(self, k)
      ]
    if not self.project.strip():
      return [f"{self.key('project')} = {self.project!r} is blank: name a W&B project"]
    if importlib.util.find_spec("wandb") is None:
      return [
        f"config.wandb.project = {self.project!r} needs Weights & Biases, which is not "
        f"installed: {WANDB_INSTALL}"
      ]
    import wandb  # pylint: disable=g-import-not-at-top  (optional, slow to import)

    try:
      wandb.Settings(project=self.project)  # W&B's own rule for the name
    except Exception as e:  # noqa: BLE001 (W&B's UsageError, or pydantic's ValidationError)
      return [f"{self.key('project')}: {str(e).strip().splitlines()[0]}"]
    return []


def wandb_run_id(workdir, resumed: bool) -> str:
  """The W&B run id kept in ``workdir`` if ``resumed`` (else its path's), or a new one, kept."""
  path = os.path.join(str(workdir), WANDB_ID_FILE)
  if resumed:
    try:
      with open(path) as f:
        return f.read().strip()
    except FileNotFoundError:
      return hashlib.sha256(str(workdir).encode()).hexdigest()[:16]
  new = secrets.token_hex(8)
  os.makedirs(str(workdir), exist_ok=True)
  files.atomic_write(path, new + "\n")
  return new


def start_wandb(cfg: WandbConfig, tree: dict, workdir, resumed: bool = False):
  """The W&B run of ``cfg`` (a resumed run continues its own), or None without a project."""
  if not cfg.project:
    return None
  import wandb  # pylint: disable=g-import-not-at-top  (optional, slow to import)

  path = str(workdir)
  return wandb.init(
    project=cfg.project,
    entity=cfg.entity or None,
    name=cfg.name or path.rstrip("/").rsplit("/", 1)[-1],
    id=wandb_run_id(workdir, resumed),
    resume="allow",
    dir=path,
    config=tree,
  )
