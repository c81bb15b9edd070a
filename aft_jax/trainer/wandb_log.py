"""Weights & Biases, optional (``config.wandb.project``; ``pip install "aft-jax[wandb]"``): the
metrics, config and sample of a run; a resumed run continues its W&B run (the id in
``<workdir>/wandb_run_id``). Docs: docs/training.md, "Weights & Biases".
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import secrets

from aft_jax import files
from aft_jax.typed_config import TypedConfig

INSTALL = 'pip install "aft-jax[wandb]"'
ID_FILE = "wandb_run_id"  # in the workdir: the W&B run a resumed run continues


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
        f"installed: {INSTALL}"
      ]
    import wandb  # pylint: disable=g-import-not-at-top  (optional, slow to import)

    try:
      wandb.Settings(project=self.project)  # W&B's own rule for the name
    except Exception as e:  # noqa: BLE001 (W&B's UsageError, or pydantic's ValidationError)
      return [f"{self.key('project')}: {str(e).strip().splitlines()[0]}"]
    return []


def run_id(workdir, resumed: bool) -> str:
  """The W&B run id kept in ``workdir`` where the run ``resumed`` (from before ids were kept:
  its path's), else a new one, kept."""
  path = os.path.join(str(workdir), ID_FILE)
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


def start(cfg: WandbConfig, tree: dict, workdir, resumed: bool = False):
  """The W&B run of ``cfg`` recording the config ``tree`` (a resumed run continues its own), or
  None without a project."""
  if not cfg.project:
    return None
  import wandb  # pylint: disable=g-import-not-at-top  (optional, slow to import)

  path = str(workdir)
  return wandb.init(
    project=cfg.project,
    entity=cfg.entity or None,
    name=cfg.name or path.rstrip("/").rsplit("/", 1)[-1],
    id=run_id(workdir, resumed),
    resume="allow",
    dir=path,
    config=tree,
  )
