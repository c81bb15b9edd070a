"""Commands for a trained run's workdir: ``generate`` (sample), ``evaluate`` (perplexity on a
split or a text file) and ``export`` (one file, loadable without Orbax); ``python -m
aft_jax.tools.<name>`` or ``aft-<name>``."""

import json
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
      print(json.dumps(result, sort_keys=True), flush=True)
