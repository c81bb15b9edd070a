"""Weights & Biases, optional: with ``config.wandb.project`` set, the run's metrics (every record
of metrics.jsonl), its config and its end-of-run sample also go to W&B.

W&B is an optional extra (``pip install "aft-jax[wandb]"``): the package is large and most runs
do without it. Setting the key without it installed is a one-line config error saying how to
install it. ``WANDB_MODE=offline`` (W&B's own variable) keeps everything in
``<workdir>/wandb/`` and sends nothing; ``wandb sync`` uploads it later. The W&B run's id is
derived from the workdir, so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util

from aft_jax.typed_config import TypedConfig

INSTALL = 'pip install "aft-jax[wandb]"'


@dataclasses.dataclass(frozen=True)
class WandbConfig(TypedConfig):
  """``config.wandb.*``."""

  WHERE = "wandb"

  project: str = ""  # a W&B project to log to ('': no W&B); needs the 'wandb' extra
  entity: str = ""  # the W&B team or user ('': your default)
  name: str = ""  # the run's name on W&B ('': the workdir's folder name)

  def _value_problems(self) -> list[str]:
    if self.project and importlib.util.find_spec("wandb") is None:
      return [
        f"config.wandb.project = {self.project!r} needs Weights & Biases, which is not "
        f"installed: {INSTALL}"
      ]
    return []


def start(config, workdir):
  """The W&B run of ``config`` in ``workdir`` (a ``wandb`` Run), or None without a project."""
  cfg = WandbConfig.from_config(config) if "wandb" in config else WandbConfig()
  if not cfg.project:
    return None
  import wandb  # pylint: disable=g-import-not-at-top  (optional, slow to import)

  path = str(workdir)
  return wandb.init(
    project=cfg.project,
    entity=cfg.entity or None,
    name=cfg.name or path.rstrip("/").rsplit("/", 1)[-1],
    id=hashlib.sha256(path.encode()).hexdigest()[:16],  # the same run when resumed
    resume="allow",
    dir=path,
    config=config.to_dict() if hasattr(config, "to_dict") else dict(config),
  )


def log(run, record: dict) -> None:
  """One metrics record (with its ``step``) as W&B scalars."""
  values = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
  run.log(values, step=int(record["step"]))


def log_text(run, tag: str, text: str, step: int) -> None:
  """A text (the sample) as a one-cell W&B table."""
  import wandb  # pylint: disable=g-import-not-at-top

  run.log({tag: wandb.Table(columns=[tag], data=[[text]])}, step=step)
