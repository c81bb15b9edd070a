"""The commands for a trained run's workdir (docs/training.md, "After training") and aft-prepare's
entry point; standard library only until a command runs (a Ctrl-C in the imports is one line)."""

import argparse
import sys

from aft_jax.ctrl_c import stops_on_ctrl_c


def parser(name: str, doc: str) -> argparse.ArgumentParser:
  """A command's parser, with the --workdir and --step they all take."""
  p = argparse.ArgumentParser(
    prog=f"python -m aft_jax.tools.{name}", description=doc.split("\n")[0]
  )
  p.add_argument("--workdir", required=True, help="A workdir written by train.py.")
  p.add_argument("--step", type=int, help="Checkpoint step (default: the latest).")
  return p


def run_command(name: str, command, args, *, print_json: bool = False) -> None:
  """``command(args)``: a ValueError is one line (exit status 1), a Ctrl-C one line (130)."""
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
  with stops_on_ctrl_c("aft-prepare: interrupted (Ctrl-C) while starting; nothing was written"):
    from aft_jax.data import prepare as prepare_lib  # pylint: disable=g-import-not-at-top

    prepare_lib.cli()
