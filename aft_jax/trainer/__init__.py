"""The trainer: ``train_and_evaluate(config, workdir)`` and what a run is made of.

  train_lib       the steps, the ``Trainer`` (mesh, jitted steps, shardings) and the run's outline
  train           the command line (``aft-train``, ``python train.py``)
  default_config  every config key, with its meaning
  run_config      the run's config read once from the tree and checked: one typed slice each
  recipes         the recipes by name (``--config quickstart``)
  checkpointing   Orbax checkpoints that also hold the data position, config and corpus record
  checksum        the per-array checksums every checkpoint carries and every restore verifies
  workdir_lock    one trainer per workdir; ``preemption``: SIGTERM / Ctrl-C save and stop
  step_log        per-step metrics and the non-finite watch; ``metrics``: where records go
  wandb_log       optional Weights & Biases logging (``config.wandb.project``)
  dry_run         the steps compiled for a GPU or TPU that is not here (``--dry_run``)

Nothing here is imported by ``aft_jax.ops``, the layers, the model or the data; the tools
(``aft_jax.tools``) import from here.
"""
