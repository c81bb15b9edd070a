"""The workdir's durable state: Orbax checkpoints (model, optimizer and data position) and the
run's config, which a resume is checked against.

    <workdir>/config.json            the config of the run
    <workdir>/checkpoints/<step>/    state (params, opt_state, step) + the data-iterator position

Orbax writes each checkpoint into a temporary directory and renames it when complete, so a
crash mid-save leaves the previous checkpoint usable.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from aft_jax import files
from aft_jax.config_check import resume_conflicts


def checkpoint_manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
    os.path.abspath(os.path.join(workdir, "checkpoints")),
    options=ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, enable_async_checkpointing=False
    ),
  )


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [
    jnp.all(jnp.isfinite(x))
    for x in jax.tree_util.tree_leaves(tree)
    if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def save(mngr: ocp.CheckpointManager, step: int, state, data_iter) -> None:
  """Saves state + data position atomically.

  Never writes non-finite parameters or optimizer state, and turns a failed write (a full
  disk, say) into an error that says the previous checkpoint is intact.
  """
  if not bool(_all_finite((state.params, state.opt_state))):
    raise FloatingPointError(
      f"refusing to checkpoint non-finite parameters at step {step}; the last checkpoint "
      f"(step {mngr.latest_step()}) is intact"
    )
  try:
    mngr.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_iter.get_state())
      ),
      force=True,
    )
    mngr.wait_until_finished()
  except Exception as e:
    raise OSError(
      f"saving the checkpoint at step {step} failed ({type(e).__name__}: {e}); the previous "
      f"checkpoint (step {mngr.latest_step()}) is intact: free disk space and rerun the same "
      "command to resume from it"
    ) from e


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state, *, with_data: bool = True):
  """(state, data-iterator state or None) of the checkpoint at ``step``.

  ``abstract_state`` (ShapeDtypeStructs with shardings) says where each array goes, so a run
  saved on one mesh restores onto another.
  """
  args = {"state": ocp.args.StandardRestore(abstract_state)}
  if with_data:
    args["data"] = ocp.args.JsonRestore()
  restored = mngr.restore(step, args=ocp.args.Composite(**args))
  return restored["state"], restored["data"] if with_data else None


def config_path(workdir: str) -> str:
  return os.path.join(workdir, "config.json")


def check_workdir_config(config, workdir: str, allow_config_change: bool) -> None:
  """Saves the config, or refuses to resume a run whose config differs in what matters."""
  path = config_path(workdir)
  current = json.loads(config.to_json_best_effort())
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    conflicts = resume_conflicts(saved, current)
    if conflicts and not allow_config_change:
      raise ValueError(
        f"workdir {workdir} holds a run with a different config ({'; '.join(conflicts)}); "
        "use another --workdir, or pass --allow_config_change to resume it anyway"
      )
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    files.atomic_write_json(path, current)
