"""Commands for a trained run's workdir: ``generate`` (sample), ``evaluate`` (perplexity on a
split or a text file) and ``export`` (one file, loadable without Orbax); ``python -m
aft_jax.tools.<name>`` or ``aft-<name>``. Also the entry point of ``aft-prepare``.

These modules import only the standard library until a command runs, so that a Ctrl-C while
jax and the others are imported is already the command's (``aft_jax.ctrl_c``)."""

import sys

from aft_jax.ctrl_c import stops_on_ctrl_c


def run_command(name: str, command, args, *, print_json: bool = False) -> None:
  """Runs ``command(args)`` for ``python -m aft_jax.tools.<name>``: Orbax's INFO logs silenced,
  and a ValueError (a bad flag, workdir or file) printed as one line on stderr, exit status 1;
  Ctrl-C is one line too, exit status 130 (``aft_jax.ctrl_c``; these commands write nothing
  but their ``--out``, atomically); so is a CPU device count that is no number
  (``JAX_NUM_CPU_DEVICES``, which jax reads when imported, and ``cpu_devices.check_set_count``).
  ``print_json``: the command's result (a dict) is printed as the last stdout line, as JSON."""
  with stops_on_ctrl_c(f"{name}: interrupted (Ctrl-C): stopped; nothing was written"):
    try:
      from absl import logging  # pylint: disable=g-import-not-at-top

      from aft_jax.trainer import cpu_devices  # pylint: disable=g-import-not-at-top

      logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
      cpu_devices.check_set_count()
      result = command(args)
    except ValueError as e:
      sys.exit(f"{name}: {e}")  # no traceback: the message says what to fix
    if print_json:
      import json  # pylint: disable=g-import-not-at-top

      print(json.dumps(result, sort_keys=True), flush=True)


def prepare() -> None:
  """The ``aft-prepare`` console script: ``aft_jax.data.prepare.cli``, whose package imports
  numpy, imported once a Ctrl-C is one line (its own, once ``cli`` runs)."""
  with stops_on_ctrl_c("aft-prepare: interrupted (Ctrl-C) while starting; nothing was written"):
    from aft_jax.data import prepare as prepare_lib  # pylint: disable=g-import-not-at-top

    prepare_lib.cli()
