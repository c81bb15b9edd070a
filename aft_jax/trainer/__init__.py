"""The trainer: ``train_and_evaluate(config, workdir)`` (``train_lib``), the command line
(``train``), the run's config and what a run is made of. Docs: docs/training.md.
"""
