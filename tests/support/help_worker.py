"""Prints the help text of each program named on its command line, as one JSON object.

    python -m tests.support.help_worker script:train.py module:benchmarks.quality entry:aft-train

tests/e2e/test_docs.py asks every program the docs run for its flags. A process per program
would pay the imports every one of them shares (jax, flax, optax, orbax: seconds each) a dozen
times; here they are imported once, and each program then runs in a child forked from this
process, which has defined no flag and started no jax backend: the child imports the program's
own modules, defines its flags and prints its help as it would alone. Each program's answer:
its exit status and its output (stdout and stderr together), for ``--helpfull`` and, where that
is an unknown argument (status 2: argparse), for ``--help``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import tomllib

# What the programs share, loaded once before the forks. No program's module is imported here:
# absl flags are defined when a program's module is imported, and each child must define only
# its own program's.
import flax.linen  # noqa: F401
import jax  # noqa: F401
import numpy  # noqa: F401
import optax  # noqa: F401
import orbax.checkpoint  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["scripts"]


def _run_program(kind: str, name: str, flag: str) -> None:
  """In the child: runs the program with ``flag`` as ``python ...`` would run it."""
  if kind == "script":
    sys.argv = [name, flag]
    sys.path.insert(0, os.path.dirname(os.path.join(ROOT, name)))
    runpy.run_path(os.path.join(ROOT, name), run_name="__main__")
  elif kind == "module":
    sys.argv = [name, flag]
    runpy.run_module(name, run_name="__main__", alter_sys=True)
  else:
    module, fn = SCRIPTS[name].split(":")
    sys.argv = [name, flag]
    sys.exit(getattr(__import__(module, fromlist=[fn]), fn)())


def ask(kind: str, name: str, flag: str) -> tuple[int, str]:
  """(exit status, output) of the program run with ``flag`` in a forked child."""
  with tempfile.TemporaryFile("w+") as out:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: its output into the file, its status as the program's
      status = 1
      try:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        _run_program(kind, name, flag)
        status = 0
      except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
      except BaseException:  # noqa: BLE001 (the traceback is the answer)
        import traceback

        traceback.print_exc()
      finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    out.seek(0)
    return os.waitstatus_to_exitcode(wait_status), out.read()


def main(argv: list[str]) -> dict:
  answers = {}
  for spec in argv:
    kind, name = spec.split(":", 1)
    code, text = ask(kind, name, "--helpfull")
    if code == 2:  # argparse: an unknown argument
      code, text = ask(kind, name, "--help")
    answers[spec] = {"status": code, "text": text}
  return answers


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1:])))
