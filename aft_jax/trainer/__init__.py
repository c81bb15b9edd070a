"""The trainer: ``train_and_evaluate(config, workdir)`` (``train_lib``), the command line
(``train``), the run's config (``default_config``, ``run_config``, ``recipes``) and what a run is
made of (checkpoints, logging, signals, the dry run). Nothing below the trainer imports it; the
tools do. Docs: docs/training.md.
"""
