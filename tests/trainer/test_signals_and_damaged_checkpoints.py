"""Interruption, faults and bad input never lose work or produce silent garbage."""

import contextlib
import errno
import glob
import io
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import jax.numpy as jnp
import numpy as np
import pytest

from tests.support import prefork, shared
from tests.trainer import change_batches, wrap_train_step
from tests.support.helpers import ROOT, config_flags, listing, tiny_config, train_py
from tests.support.helpers import trained_run_config
from aft_jax.tools import evaluate, export, generate
from aft_jax.trainer import checkpointing, guards, train_lib
from aft_jax.trainer.default_config import override
from aft_jax.trainer.run_config import SLICES, RunConfig
from aft_jax.typed_config import TypedConfig
from aft_jax.workdir import Workdir


def _steps(workdir):
  return Workdir(workdir).checkpoint_steps()


def _records(workdir):
  return [r for r in Workdir(workdir).read_metrics() if "loss" in r]


def _copy(workdir, tmp_path):
  return shutil.copytree(workdir, str(tmp_path / "run"), symlinks=True)


def _truncate_largest_file(folder, size=None):
  paths = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
  largest = max(paths, key=os.path.getsize)
  os.truncate(largest, os.path.getsize(largest) // 2 if size is None else size)


def _damage(workdir, step) -> str:
  """Flips a bit of one parameter chunk of checkpoint ``step`` (the largest first) such that it
  still reads, changed: only the checksums see it. The parameter's name."""
  import tensorstore as ts

  state = os.path.join(workdir, "checkpoints", str(step), "state")
  kvstore = {"driver": "ocdbt", "base": f"file://{state}"}
  store = ts.KvStore.open(kvstore).result()

  def read(name):  # the array as TensorStore reads it, or None where it fails
    try:
      spec = {"driver": "zarr", "kvstore": {**kvstore, "path": f"{name}/"}}
      return ts.open(spec).result().read().result()
    except Exception:  # noqa: BLE001  (what a damaged store raises varies)
      return None

  keys = [k.decode() for k in store.list().result() if k.startswith(b"params.")]
  chunks = [(store.read(k).result().value, k) for k in keys if not k.endswith("/.zarray")]
  files = glob.glob(os.path.join(state, "ocdbt.process_*", "d", "*"))
  for value, key in sorted(chunks, key=lambda c: -len(c[0])):
    name, before = key.rsplit("/", 1)[0], read(key.rsplit("/", 1)[0])
    for path in files:
      data = bytearray(open(path, "rb").read())
      at = data.find(value)
      if at >= 0:
        damaged = bytearray(data)
        damaged[at + len(value) // 2] ^= 0x10
        open(path, "wb").write(damaged)
        after = read(name)
        if after is not None and not np.array_equal(after, before, equal_nan=True):
          return name
        open(path, "wb").write(data)  # a read error or no change: undone, the next tried
  raise AssertionError(f"no parameter chunk of {state} could be damaged and still read")


def _held_lock(workdir):
  """A live process (``sleep``) holding the workdir's lock."""
  holder = subprocess.Popen(["sleep", "120"])
  with open(Workdir(workdir).lock_file, "w") as f:
    json.dump({"pid": holder.pid, "host": socket.gethostname()}, f)
  return holder


@pytest.fixture
def quiet_after_failure(monkeypatch):
  """Undoes the silence a run that stopped on unreadable checkpoints leaves in its process."""
  for name in ("stderr", "unraisablehook"):
    monkeypatch.setattr(sys, name, getattr(sys, name))
  monkeypatch.setattr(threading, "excepthook", threading.excepthook)
  for name in ("absl", "asyncio", "concurrent.futures"):
    monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)


TWO_CHECKPOINTS = dict(num_train_steps=4, checkpoint_every_steps=2, keep_checkpoints=3)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
  """A tiny run with checkpoints at steps 2 and 4, trained once (tests damage copies)."""

  def build(folder):
    with contextlib.redirect_stdout(io.StringIO()):
      train_lib.train_and_evaluate(tiny_config(**TWO_CHECKPOINTS), str(folder / "run"))

  return str(shared.once(tmp_path_factory, "two_checkpoints", build)[0] / "run")  # steps 2, 4


def _wait_for(predicate, proc, timeout=240):
  start = time.time()
  while not predicate():
    assert proc.poll() is None, f"training exited early: {proc.stderr.read()[-3000:]}"
    if time.time() - start > timeout:
      proc.kill()
      raise AssertionError("timed out")
    time.sleep(0.05)


@pytest.mark.slow
def test_sigkill_in_a_save_leaves_a_usable_checkpoint(tmp_path, capsys):
  # (SIGTERM's save and exit status 0: test_train_lib.py, test_multihost.py)
  workdir = str(tmp_path / "run")
  every_step = dict(checkpoint_every_steps=1, log_every_steps=1000)
  cmd = train_py(workdir, *config_flags(tiny_config(num_train_steps=100_000, **every_step)))
  proc = prefork.popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  saving = os.path.join(workdir, "checkpoints", "*tmp*")
  _wait_for(lambda: glob.glob(saving) and _steps(workdir), proc)  # one saved, one being saved
  proc.kill()
  proc.communicate(timeout=120)
  complete = _steps(workdir)[-1]
  config = tiny_config(num_train_steps=complete + 1, **every_step)
  capsys.readouterr()
  train_lib.train_and_evaluate(config, workdir, allow_config_change=True)
  assert f"Resuming from the checkpoint at step {complete}" in capsys.readouterr().out
  assert complete + 1 in _steps(workdir)


POISON = 255  # a byte that never occurs in UTF-8 text


def _poison(monkeypatch, at_step, until=None):
  """Batches ``at_step`` to ``until`` get a poison token whose loss (and gradient) is NaN."""
  orig_nll = train_lib.weighted_nll

  def nll(model, params, batch, **kw):
    total, count = orig_nll(model, params, batch, **kw)
    return jnp.where(jnp.any(batch["inputs"] == POISON), jnp.nan, total), count

  def poisoned(n, batch):
    if at_step <= n <= (until or at_step):
      batch = dict(batch, inputs=np.array(batch["inputs"]))
      batch["inputs"][:, 0] = POISON
    return batch

  monkeypatch.setattr(train_lib, "weighted_nll", nll)
  change_batches(monkeypatch, poisoned)


def test_a_nonfinite_step_is_skipped_or_stops_the_run_a_stale_lock_taken_over_an_inf_ppl_written(
  tmp_path, monkeypatch
):
  _poison(monkeypatch, at_step=3)
  orig = train_lib.eval_step
  monkeypatch.setattr(
    train_lib, "eval_step", lambda *a, **kw: (lambda s, c: (s + 1e4 * c, c))(*orig(*a, **kw))
  )
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  holder = _held_lock(workdir)
  holder.kill()
  holder.wait()  # its process gone: the lock is stale, taken over, and released at the end
  results = train_lib.train_and_evaluate(tiny_config(num_train_steps=5), workdir)
  assert not os.path.exists(Workdir(workdir).lock_file) and results["skipped_steps"] == 1
  assert results["valid_ppl"] == math.inf and 1e4 < results["valid_loss"] < math.inf
  assert os.path.exists(os.path.join(workdir, "results.json"))
  records = _records(workdir)
  assert records[-1]["skipped_steps"] == 1
  assert [r["step"] for r in records if r["skipped_steps"] == 1][0] == 3

  # With nonfinite = "stop": the run stops, naming the step, and writes nothing after it.
  workdir = str(tmp_path / "stop")
  config = tiny_config(num_train_steps=5, nonfinite="stop", checkpoint_every_steps=2)
  with pytest.raises(FloatingPointError, match="non-finite loss or gradient at step 3"):
    train_lib.train_and_evaluate(config, workdir)
  assert _steps(workdir) == [2]


def test_a_nonfinite_checkpoint_is_never_written(tmp_path):
  mngr = checkpointing.checkpoint_manager(str(tmp_path), checkpointing.CheckpointConfig())

  state = types.SimpleNamespace(params={"w": jnp.array([1.0, jnp.nan])}, opt_state=())
  with pytest.raises(FloatingPointError, match="refusing to checkpoint non-finite") as err:
    checkpointing.save(mngr, 1, state, types.SimpleNamespace(get_state=dict), {})
  assert mngr.latest_step() is None
  assert "there is no earlier checkpoint" in str(err.value)  # not "step None is intact"


DISK_FULL = """
import resource, signal, sys
from tests.support.helpers import tiny_config
from aft_jax.trainer import checkpointing, train_lib
orig, calls = checkpointing.save, []
def save(mngr, *args):
  orig(mngr, *args)
  calls.append(1)
  if len(calls) == 1:  # the disk fills up once the first checkpoint is written: no file grows
    checkpointing.finish_saving(mngr)  # past 16 KB (the event file's ~6 KB still can, a
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # checkpoint's ~80 KB not)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
checkpointing.save = save
config = tiny_config(num_train_steps=6, checkpoint_every_steps=2, keep_checkpoints=1)
train_lib.train_and_evaluate(config, sys.argv[1])
"""


def test_disk_full_during_a_save_is_an_error_and_keeps_the_previous_checkpoint(tmp_path):
  workdir = str(tmp_path / "run")
  cmd = [sys.executable, "-c", DISK_FULL, workdir]
  out = prefork.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=300)
  assert out.returncode != 0 and "OSError: saving the checkpoint at step 4 failed" in out.stderr
  assert "the previous checkpoint (step 2) is intact" in out.stderr
  # Our error alone: not Orbax's threads' tracebacks, logs and asyncio shutdown noise.
  assert out.stderr.count("Traceback") == 1, out.stderr[-3000:]
  assert "ERROR:absl" not in out.stderr and "Event loop is closed" not in out.stderr
  assert out.stderr.rstrip().splitlines()[-1].startswith("OSError: saving the checkpoint")
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]  # no temporary folder left
  config = tiny_config(num_train_steps=6, checkpoint_every_steps=2, keep_checkpoints=1)
  assert train_lib.train_and_evaluate(config, workdir)["steps"] == 6 and _steps(workdir) == [6]


@pytest.mark.parametrize("name", ["config.json", "trainer.lock"])
def test_a_full_disk_is_one_error_naming_the_file(tmp_path, name):
  """The temporary file is /dev/full (ENOSPC names no file): the error names the file."""
  write = guards.acquire if name == "trainer.lock" else lambda w: Workdir(w).write_config({})
  os.symlink("/dev/full", f"{tmp_path / name}.tmp-{os.getpid()}")
  with pytest.raises(OSError, match=f"^.* cannot write {tmp_path / name}: No space left") as e:
    write(str(tmp_path))
  assert e.value.errno == errno.ENOSPC and os.listdir(tmp_path) == []


def test_damaged_bytes_are_skipped_a_changed_config_allowed_and_a_divergence_names_the_last_good(
  two_checkpoints, tmp_path, monkeypatch, capsys
):
  workdir = _copy(two_checkpoints, tmp_path)
  _damage(workdir, 4)
  _poison(monkeypatch, at_step=3, until=10**6)  # resumed at step 2: batch 3 is step 5's
  steps = dict(TWO_CHECKPOINTS, num_train_steps=30, keep_checkpoints=1, log_every_steps=3)
  config = tiny_config(**steps, max_consecutive_skips=3)
  capsys.readouterr()
  with pytest.raises(FloatingPointError, match="steps 5-7 .* the last good checkpoint is step 4:"):
    train_lib.train_and_evaluate(config, workdir, allow_config_change=True)
  out = capsys.readouterr().out
  assert f"Skipped the damaged checkpoint at step 4 ({MISMATCH}" in out
  assert "Resuming from the checkpoint at step 2" in out
  assert out.count("Resuming with a changed config") == 1
  assert "changed config (--allow_config_change): num_train_steps: 4 in the workdir, 30 now" in out
  assert json.load(open(os.path.join(workdir, "config.json")))["num_train_steps"] == 30
  assert os.listdir(os.path.join(workdir, "damaged_checkpoints")) == ["4"]
  assert _steps(workdir) == [4]
  records = _records(workdir)  # the steps since the last log line (6) too: they show how
  assert {3, 6} <= {r["step"] for r in records} and records[-1]["step"] >= 7, records
  assert math.isnan(records[-1]["loss"]) and records[-1]["skipped_steps"] >= 3


def _lose_checksums(step_dir):
  shutil.rmtree(os.path.join(step_dir, "checksums"))


def _zero_metadata(step_dir, lose_checksums=False):
  if lose_checksums:
    _lose_checksums(step_dir)
  metadata = os.path.join(step_dir, "_CHECKPOINT_METADATA")
  with open(metadata, "r+b") as f:
    f.write(bytes(os.path.getsize(metadata)))


def _edit_json(path, edit):
  saved = json.load(open(path))
  edit(saved)
  with open(path, "w") as f:
    json.dump(saved, f)


def _move_data(step_dir):
  _edit_json(os.path.join(step_dir, "data", "metadata"), lambda d: d.update(global_batch_size=5))


def _before_checksums(step_dir):  # as written before checkpoints carried checksums
  for name in ("checksums", "corpus"):
    shutil.rmtree(os.path.join(step_dir, name))
  handlers = lambda m: [m["item_handlers"].pop(n) for n in ("checksums", "corpus")]  # noqa: E731
  _edit_json(os.path.join(step_dir, "_CHECKPOINT_METADATA"), handlers)


def _truncate_and_an_empty_step_6(step_dir):
  _truncate_largest_file(step_dir)
  os.makedirs(os.path.join(os.path.dirname(step_dir), "6"))


MISMATCH = "DamagedCheckpointError: its contents do not match the checksums saved with them ("
LOST = "DamagedCheckpointError: its checksums (the folder checksums/) are missing, and its"
DATA = f"{MISMATCH}data)"
UNVERIFIED = "written before checkpoints carried checksums, so it is loaded unverified"
EMPTY = "FileNotFoundError: the folder is empty"
NOTE = "note: skipped the damaged checkpoint at step "
OLD = f"note: the checkpoint at step 4 was {UNVERIFIED}"
TRUNCATED = [f"{NOTE}6 ({EMPTY}); using step 2", f"{NOTE}4 ("], [(6, EMPTY), (4, "")]
VERIFIED_OR_REFUSED = {  # name: (done to step 4, the step loaded, the tools' notes, the
  # trainer's lines: (step, why))
  "checksums/ lost": (_lose_checksums, 2, [f"{NOTE}4 ({LOST}"], [(4, LOST)]),
  "checksums/ and metadata lost": (_zero_metadata, 2, [f"{NOTE}4 ({LOST}"], [(4, LOST)], True),
  "data position changed": (_move_data, 2, [f"{NOTE}4 ({DATA}); using step 2"], [(4, DATA)]),
  "written before checksums": (_before_checksums, 4, [OLD], []),
  "zeroed metadata, verified contents": (_zero_metadata, 4, [], []),
  "truncated, and an empty step 6": (_truncate_and_an_empty_step_6, 2, *TRUNCATED),
}


class _Restored(Exception):
  """Raised with the restored step, to stop a run right after its restore."""


@pytest.mark.parametrize("case", VERIFIED_OR_REFUSED)
def test_a_checkpoint_is_verified_before_it_is_compared_or_refused(
  case, two_checkpoints, tmp_path, capsys, monkeypatch
):
  damage, step, notes, skipped, *also = VERIFIED_OR_REFUSED[case]
  workdir = _copy(two_checkpoints, tmp_path)
  damage(os.path.join(workdir, "checkpoints", "4"), *also)
  capsys.readouterr()
  export.main(["--workdir", workdir, "--out", str(tmp_path / "model.msgpack")])
  out, err = capsys.readouterr()
  assert json.loads(out.strip().splitlines()[-1])["step"] == step
  lines = err.strip().splitlines()
  assert len(lines) == len(notes) and all(a.startswith(b) for a, b in zip(lines, notes)), err

  # The resume, stopped as soon as its state is restored (the training loop is not the point).
  restore = train_lib.restore_or_init

  def restore_then_stop(*args):
    raise _Restored(int(restore(*args).step))

  monkeypatch.setattr(train_lib, "restore_or_init", restore_then_stop)
  config = tiny_config(**dict(TWO_CHECKPOINTS, num_train_steps=6))
  with pytest.raises(_Restored) as done:
    train_lib.train_and_evaluate(config, workdir, allow_config_change=True)
  out = capsys.readouterr().out
  assert done.value.args == (step,), out
  resumed = f"Resuming from the checkpoint at step {step} in {workdir}"
  assert resumed + (f" ({UNVERIFIED})\n" if UNVERIFIED in str(notes) else "\n") in out, out
  said = [line for line in out.splitlines() if line.startswith("Skipped the damaged")]
  assert len(said) == len(skipped), out
  for line, (bad, why) in zip(said, skipped):
    assert line.startswith(f"Skipped the damaged checkpoint at step {bad} ({why}"), line
    assert f"; resuming from step {step})" in line, line
  moved = os.path.join(workdir, "damaged_checkpoints")
  assert sorted(os.listdir(moved) if skipped else []) == sorted(str(s) for s, _ in skipped)
  assert os.path.exists(moved) == bool(skipped)


def test_a_tool_asked_for_a_damaged_step_names_the_others(two_checkpoints, tmp_path, capsys):
  workdir = _copy(two_checkpoints, tmp_path)
  _truncate_largest_file(os.path.join(workdir, "checkpoints", "4"), 1000)
  with pytest.raises(SystemExit) as e:
    export.main(["--workdir", workdir, "--out", str(tmp_path / "m"), "--step", "4"])
  assert "step 4:" in str(e.value) and "the other checkpoints: --step 2" in str(e.value)
  assert "\n" not in str(e.value) and "\x00" not in str(e.value)  # (NUL: a file's bytes)


def _train(allow=False, **overrides):
  def run(workdir, tmp_path):
    config = override(trained_run_config(), overrides)
    train_lib.train_and_evaluate(config, workdir, allow_config_change=allow)

  return run


COMMANDS = {  # each as a user runs it, on a workdir (tmp_path: where an export goes)
  "train": _train(),
  "generate": lambda workdir, tmp_path: generate.main(["--workdir", workdir, "--length", "4"]),
  "evaluate": lambda workdir, _: evaluate.main(["--workdir", workdir, "--split", "validation"]),
  "export": lambda workdir, tmp_path: export.main(["--workdir", workdir, "--out", f"{tmp_path}/m"]),
}


def _other_corpus(workdir):
  """An intact checkpoint written on another corpus: one more train token, checksum updated."""
  step_dir = os.path.join(workdir, "checkpoints", "4")
  saved = json.load(open(os.path.join(step_dir, "corpus", "metadata")))
  saved["tokens"]["train"] += 1
  sums = json.load(open(os.path.join(step_dir, "checksums", "metadata")))
  sums["json"]["corpus"] = checkpointing.json_checksum(saved)
  for name, obj in (("corpus", saved), ("checksums", sums)):
    with open(os.path.join(step_dir, name, "metadata"), "w") as f:
      json.dump(obj, f)


WORDS = {"data.tokenizer": "word"}
DAMAGED = "step 4: DamagedCheckpointError: its contents do not match the checksums"
REFUSALS = {
  # name: (the command, the error, what its line says)
  "another schedule": (_train(num_train_steps=6), ValueError, "6 now .the learning.*; compared"),
  "another vocabulary, even allowed": (_train(True, **WORDS), ValueError, "another vocabulary .d"),
  "another model, allowed": (_train(True, **{"model.d_model": 32}), RuntimeError, "no checkp"),
  "another batch, allowed": (_train(True, batch_size=8), ValueError, r"_size = 4 \(now 8\)"),
  "a bad config": (_train(learning_rate=-1.0), ValueError, "learning_rate"),
  "another corpus": (_train(), ValueError, r"step 4: the train split has [\d,]+ tokens, had"),
  "a mesh this machine lacks": (_train(**{"mesh.data": 2}), ValueError, "does not match the"),
  "a batch larger than the data": (_train(True, batch_size=40_000), ValueError, "split too short"),
  "a held lock": (_train(), guards.WorkdirInUse, "is in use by another trainer .pid"),
  # The only checkpoint damaged: every command refuses it, naming the step and the checksums.
  **{
    f"{name}, damaged": (run, (RuntimeError, SystemExit), DAMAGED) for name, run in COMMANDS.items()
  },
}


@pytest.mark.parametrize("case", REFUSALS)
def test_every_refused_run_leaves_the_workdir_byte_for_byte_as_it_was(
  case, trained_run, tmp_path, quiet_after_failure
):
  command, error, says = REFUSALS[case]
  workdir = _copy(trained_run[0], tmp_path)
  holder = _held_lock(workdir) if case == "a held lock" else None
  if case == "another corpus":
    _other_corpus(workdir)
  if case.endswith("damaged"):
    _damage(workdir, 4)
  before = listing(workdir)
  try:
    with pytest.raises(error, match=says) as e:
      with contextlib.redirect_stdout(io.StringIO()):
        command(workdir, tmp_path)
  finally:
    if holder is not None:
      holder.kill()
      holder.wait()
  assert "\n" not in str(e.value) and str(e.value)
  assert listing(workdir) == before and not os.path.exists(tmp_path / "m")
  if holder is not None:
    assert f"another trainer (pid {holder.pid} on" in str(e.value)


class _Flag:
  """A step's finite flag that records when the training loop reads it."""

  def __init__(self, value, step, events):
    self.value, self.step, self.events = value, step, events

  def __bool__(self):
    self.events.append(("read", self.step))
    return bool(self.value)


def test_a_signal_is_acted_on_within_two_steps_and_flushes_the_metrics(tmp_path, monkeypatch):
  events = []

  def step(orig, *args):
    n = sum(1 for e in events if e[0] == "dispatch") + 1
    events.append(("dispatch", n))
    state, metrics = orig(*args)
    if n == 5:
      os.kill(os.getpid(), signal.SIGTERM)
    return state, dict(metrics, finite=_Flag(metrics["finite"], n, events))

  wrap_train_step(monkeypatch, step)
  workdir = str(tmp_path / "run")
  config = tiny_config(num_train_steps=50, log_every_steps=1000)
  assert train_lib.train_and_evaluate(config, workdir) == {"interrupted": True, "step": 5}
  for n in (4, 5):
    assert events.index(("read", n - 3)) < events.index(("dispatch", n)), events
  records = _records(workdir)
  assert [r["step"] for r in records] == [5] and np.isfinite(records[0]["loss"])


def test_several_processes_agree_on_sigint_at_log_steps_and_leave_sigterm_to_jax(monkeypatch):
  monkeypatch.setattr(guards.jax, "process_count", lambda: 2)
  gathered, sync_steps = [], []
  utils = guards.multihost_utils
  allgather = lambda x: gathered.append(int(x)) or np.array([int(x), 0])  # noqa: E731
  monkeypatch.setattr(utils, "process_allgather", allgather)
  sync_point = lambda step: sync_steps.append(step) or step == 7  # noqa: E731
  monkeypatch.setattr(utils, "reached_preemption_sync_point", sync_point)
  sigterm, sigint = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  with guards.Preemption() as p:
    assert signal.getsignal(signal.SIGTERM) is sigterm
    assert not p.should_stop(1, every=2) and not p.should_stop(2, every=2)
    os.kill(os.getpid(), signal.SIGINT)
    assert not p.should_stop(3, every=2)  # not a log step
    assert p.should_stop(4, every=2) and p.signal == signal.SIGINT
  assert gathered == [0, 1] and sync_steps == [1, 2, 3, 4]
  with guards.Preemption() as p:  # the sync manager's step, between log steps
    assert not p.should_stop(5, every=2) and p.should_stop(7, every=2)
    assert p.signal.startswith("SIGTERM, preemption notice")
  assert signal.getsignal(signal.SIGINT) is sigint  # the handler found (SIG_IGN in background)


def test_sigterm_in_the_final_evaluation_keeps_the_finished_splits(tmp_path, monkeypatch, capsys):
  workdir = str(tmp_path / "run")
  config = tiny_config(num_train_steps=2, **{"sample.length": 0})
  original, scored, once = train_lib.Trainer.evaluate, [], [True]

  def evaluate(self, params, tokens, bos_id, desc="eval", **kw):
    scored.append(desc)
    if desc == "test" and once and once.pop():
      os.kill(os.getpid(), signal.SIGTERM)  # recorded by the run's handler, acted on next batch
    return original(self, params, tokens, bos_id, desc, **kw)

  monkeypatch.setattr(train_lib.Trainer, "evaluate", evaluate)
  # (And the run builds its config once, and checks each component once.)
  built, checked = [], []
  from_tree, problems = RunConfig.from_tree.__func__, TypedConfig.problems
  monkeypatch.setattr(
    RunConfig, "from_tree", classmethod(lambda c, t: built.append(t) or from_tree(c, t))
  )
  monkeypatch.setattr(TypedConfig, "problems", lambda c: checked.append(type(c)) or problems(c))
  assert train_lib.train_and_evaluate(config, workdir) == {"interrupted": True, "step": 2}
  assert len(built) == 1 and sorted(map(str, checked)) == sorted(map(str, SLICES.values()))
  said = capsys.readouterr().out
  assert f"signal {int(signal.SIGTERM)}) during the final evaluation of the test split" in said
  wd = Workdir(workdir)
  assert not os.path.exists(wd.results_file) and not os.path.exists(wd.lock_file)
  kept = wd.read_final_eval()
  assert kept["step"] == 2 and set(kept["splits"]) == {"validation"}

  scored.clear()
  results = train_lib.train_and_evaluate(config, workdir)
  assert scored == ["test"]  # the validation split was not scored again
  assert results["valid_loss"] == kept["splits"]["validation"]["nll"]
  assert json.load(open(wd.results_file))["test_tokens"] == results["test_tokens"] > 0
