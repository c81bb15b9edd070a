"""Trains an AFT language model: aft-train --config quickstart --workdir runs/x (in a checkout,
python train.py ...); does it fit a GPU I do not have? aft-train --config enwik8 --dry_run
--target h100. --config takes a recipe name (NAME[:ARG]) or a config file; any value can be
overridden (--config.num_train_steps=10); rerunning resumes. JAX's flags and -v are accepted.
"""

import os
import platform
import re
import sys

from aft_jax.ctrl_c import stops_on_ctrl_c
from aft_jax.trainer import recipes

FLAGS = None  # absl's flags, once ``_define_flags`` has defined the command's
PROG = os.path.basename(sys.argv[0])  # what the command's messages start with


def _define_flags() -> None:
  # absl imported here: inside ``run``'s Ctrl-C guard.
  global FLAGS
  from absl import flags

  flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and results go.")
  flags.DEFINE_bool("allow_config_change", False, "Resume a workdir whose config differs.")
  flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process 0.")
  flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
  flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")
  flags.DEFINE_bool("distributed", False, "jax.distributed.initialize() (TPU pods, SLURM).")
  flags.DEFINE_bool("dry_run", False, "Does it fit --target? Exit 0 fits, 1 not, 2 refused.")
  flags.DEFINE_string("target", "cpu", "With --dry_run: t4, a100-40, h100, v5e, ... or cpu.")
  flags.DEFINE_integer("num_devices", 1, "With --dry_run: how many devices of --target.")
  FLAGS = flags.FLAGS


def _fail(e: Exception, status: int = 1):
  # The project's errors say in one line what to fix; a traceback (-v 1) would bury it.
  if FLAGS["verbosity"].present:
    raise e
  print(f"{PROG}: {type(e).__name__}: {e}", file=sys.stderr)
  sys.exit(status)


def main(_argv):
  import jax  # (run() imported it first: it says in one line why jax cannot be imported)
  from absl import logging

  from aft_jax.trainer import cpu_devices
  from aft_jax.trainer.run_config import RunConfig

  if not FLAGS["verbosity"].present:  # -v / --verbosity wins
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  try:
    cpu_devices.check_set_count()
  except ValueError as e:
    _fail(e, 2 if FLAGS.dry_run else 1)
  if FLAGS.dry_run:  # checks what it can, restarts where the target's compiler is, reports
    from aft_jax import deviceless
    from aft_jax.trainer import dry_run as dry_run_lib

    try:
      target = deviceless.get(FLAGS.target)
      cfg = RunConfig.from_tree(FLAGS.config)  # the ConfigDict, read once
      usable = dry_run_lib.check(cfg, target, FLAGS.num_devices)  # before the restart
      # The CPU target gets twice the devices asked for: the suggestions compile for more.
      deviceless.reexec(target.kind, 2 * FLAGS.num_devices if target.kind == "cpu" else None)
      report = dry_run_lib.run(cfg, target, FLAGS.num_devices, usable)
    except (ValueError, OSError, RuntimeError) as e:
      _fail(e, dry_run_lib.REFUSED)
    sys.exit(dry_run_lib.FITS if report["fits"] else dry_run_lib.DOES_NOT_FIT)
  if not FLAGS.workdir or not FLAGS.workdir.strip():  # ' ' would train into a folder named ' '
    given = "is required" if not FLAGS.workdir else f"= {FLAGS.workdir!r} is blank"
    sys.exit(f"{PROG}: error: --workdir {given} (except with --dry_run)")
  if not (FLAGS.coordinator_address or FLAGS.distributed):
    try:  # one CPU device per core (``cpu_devices``)
      cpu_devices.apply(RunConfig.from_tree(FLAGS.config))
    except (ValueError, OSError):
      pass  # a config the run will refuse: train_and_evaluate names what is wrong
  elif jax.config.jax_cpu_collectives_implementation in (None, "none"):
    # CPU processes need a collectives library: older jax defaults to none.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if FLAGS.coordinator_address:
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  elif FLAGS.distributed:
    jax.distributed.initialize()
  # Imported after the distributed init: nothing may touch devices before it.
  from aft_jax.trainer import train_lib

  try:
    train_lib.train_and_evaluate(
      FLAGS.config, FLAGS.workdir, allow_config_change=FLAGS.allow_config_change
    )
  except (ValueError, OSError, FloatingPointError, RuntimeError) as e:
    _fail(e)


# glibc's tunable (2.35 and later; earlier ones ignore it): huge pages for what malloc maps.
HUGE_PAGES = "glibc.malloc.hugetlb=1"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def with_huge_pages(env) -> dict | None:
  """``env`` with ``HUGE_PAGES`` added to its GLIBC_TUNABLES; None where it has it or where
  nothing would use it: a C library other than glibc, the kernel's huge pages off."""
  tunables = env.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb" in tunables or platform.libc_ver()[0] != "glibc":
    return None
  try:
    with open(THP_MODE, encoding="ascii") as f:
      if "[never]" in f.read():
        return None
  except OSError:
    return None
  return dict(env, GLIBC_TUNABLES=":".join(filter(None, (tunables, HUGE_PAGES))))


def restart_with_huge_pages() -> None:
  """Restarts this command (``sys.orig_argv``) in ``with_huge_pages(os.environ)``, if not None.

  XLA:CPU allocates a step's temporaries as one block of tens or hundreds of MiB, which glibc
  maps for the step and unmaps after it: each step, the kernel faults the block in again and
  zeroes it, 4 KiB a fault. With the tunable, glibc asks the kernel for transparent huge pages
  on such a mapping (madvise): 2 MiB a fault (the time it saves:
  benchmarks/results/peer_length/profile.md). glibc reads its tunables when a process starts,
  hence the restart.
  """
  env = with_huge_pages(os.environ)
  if env is not None:
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def run():
  """The ``aft-train`` console script (and the checkout's train.py)."""
  restart_with_huge_pages()  # first: nothing done yet is lost
  # Ctrl-C from here on (jax's import included): nothing half-written is left.
  with stops_on_ctrl_c(
    f"{PROG}: interrupted (Ctrl-C): stopped without saving; the "
    "workdir's last checkpoint, if any, is intact and the same command resumes from it"
  ):
    try:
      # Here, not at the top: jax reads its JAX_* environment variables when imported and
      # refuses a value it cannot read (JAX_NUM_CPU_DEVICES=abc) with a ValueError.
      import jax
    except ValueError as e:
      flag = re.search(r"JAX flag (\w+)", str(e))
      where = f"the environment variable {flag[1].upper()}" if flag else "a JAX_* variable"
      sys.exit(f"{PROG}: error: {e} (set by {where})")
    from absl import app

    _define_flags()
    jax.config.config_with_absl()  # JAX's own flags: --jax_debug_nans, --jax_platforms, ...
    app.run(main, flags_parser=_parse_flags)


def _refuse(why, status):
  print(f"{PROG}: error: {why}", file=sys.stderr)
  sys.exit(status)


def _parse_flags(argv):
  """absl's flag parsing, the last --config loaded by recipes.load; errors: one line, status 1."""
  from absl import flags
  from ml_collections import config_flags

  spec, rest = None, argv[:1]  # --config's value, and argv without it
  keys, dry_run = [], False  # its --config.KEY overrides' keys, and whether --dry_run
  args = iter(argv[1:])
  for arg in args:
    if arg == "--":  # absl: everything after it is a positional argument
      rest += [arg, *args]
      break
    name, eq, value = arg.lstrip("-").partition("=")
    if arg.startswith("-") and name == "config":
      spec = value if eq else next(args, None)
      continue
    rest.append(arg)
    if name in ("dry_run", "nodry_run"):
      dry_run = name == "dry_run" and value.lower() not in ("false", "0")
    if arg.startswith("-") and name.removeprefix("no").startswith("config."):
      keys.append(name.removeprefix("no")[len("config.") :])
  refused = 2 if dry_run else 1  # a refused dry run's status
  about = "A recipe name (quickstart, NAME:ARG) or a config file."
  if spec is None:  # absl refuses it (and --helpfull lists it)
    flags.DEFINE_string("config", None, about, required=True)
  else:
    try:
      path = recipes.resolve(spec)
    except ValueError as e:
      _refuse(e, refused)
    try:
      config = recipes.load(path)
    except (TypeError, ValueError, OSError) as e:  # get_config(ARG) refused ARG
      _refuse(f"--config: {type(e).__name__}: {e}", refused)
  try:
    if spec is not None:  # its overrides (--config.KEY) are absl flags from here on
      config_flags.DEFINE_config_dict("config", config, about, lock_config=True, sys_argv=rest)
    return FLAGS(rest)
  except flags.Error as e:  # absl's own: a flag it does not know, a value of the wrong type
    _refuse(f"{e} (see --helpshort)", refused)
  except (AttributeError, KeyError, TypeError, ValueError, OSError) as e:
    from aft_jax.trainer import run_config

    # A key no component defines, named whole (ml_collections names the last part only);
    # else ml_collections' message, a quoted repr: "\\n" between its lines.
    unknown = run_config.unknown_keys(keys)
    text = str(e).replace("\\n", "\n").replace("\\'", "'")
    lines = [p.strip().strip("'\"") for p in text.splitlines()]
    _refuse(f"a --config override: {'; '.join(unknown or [p for p in lines if p])}", refused)


if __name__ == "__main__":
  run()
