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

import jax.numpy as jnp
import numpy as np
import pytest

from tests.support import prefork, shared
from tests.trainer import change_batches, wrap_train_step
from tests.support.helpers import (
  ROOT,
  config_flags,
  listing,
  tiny_config,
  train_py,
  trained_run_config,
)
from aft_jax.tools import evaluate, export, generate
from aft_jax.trainer import checkpointing, checksum, guards, train_lib
from aft_jax.trainer.run_config import RunConfig
from aft_jax.workdir import Workdir


def _steps(workdir):
  return sorted(
    int(os.path.basename(p))
    for p in glob.glob(os.path.join(workdir, "checkpoints", "*"))
    if os.path.basename(p).isdigit()
  )


def _wait_for(predicate, proc, timeout=240):
  start = time.time()
  while not predicate():
    if proc.poll() is not None:
      raise AssertionError(f"training exited early: {proc.stderr.read()[-3000:]}")
    if time.time() - start > timeout:
      proc.kill()
      raise AssertionError("timed out")
    time.sleep(0.05)


def _start_train(workdir, flags):
  """train.py as a process of its own (tests/support/prefork.py), its output piped."""
  return prefork.popen(
    train_py(workdir, *flags), cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
  )


def _logged(workdir, n):
  path = os.path.join(workdir, "metrics.jsonl")
  return lambda: os.path.exists(path) and sum(1 for _ in open(path)) >= n


@pytest.fixture
def quiet_after_failure(monkeypatch):
  """Undoes the silence a run that stopped on unreadable checkpoints leaves in its process."""
  for name in ("stderr", "unraisablehook"):
    monkeypatch.setattr(sys, name, getattr(sys, name))
  monkeypatch.setattr(threading, "excepthook", threading.excepthook)
  for name in ("absl", "asyncio", "concurrent.futures"):
    monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)


def _copy(workdir, tmp_path, name="run"):
  dst = str(tmp_path / name)
  shutil.copytree(workdir, dst, symlinks=True)
  return dst


def _largest_file(folder):
  paths = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
  return max(paths, key=os.path.getsize)


def _flip_a_bit(data: bytearray) -> None:
  data[len(data) // 2] ^= 0x10


def _eight_bytes_of_ff(data: bytearray) -> None:
  middle = len(data) // 2
  data[middle : middle + 8] = b"\xff" * 8


DAMAGE = {"a flipped bit": _flip_a_bit, "8 bytes of 0xff": _eight_bytes_of_ff}


def _state_dir(workdir, step) -> str:
  return os.path.join(workdir, "checkpoints", str(step), "state")


def _read_array(state, name):
  """The array ``name`` of a checkpoint's state as TensorStore reads it (the zarr array in the
  OCDBT store), or the exception its read raises."""
  import tensorstore as ts

  kvstore = {"driver": "ocdbt", "base": f"file://{state}", "path": f"{name}/"}
  try:
    return ts.open({"driver": "zarr", "kvstore": kvstore}).result().read().result()
  except Exception as e:  # noqa: BLE001  (what a damaged store raises varies)
    return e


def _damage(workdir, step, how) -> str:
  """Damages (``DAMAGE[how]``) one parameter chunk of checkpoint ``step`` so that it still reads,
  changed (only the checksums see it), the largest chunk first; the parameter's name."""
  import tensorstore as ts

  state = _state_dir(workdir, step)
  store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state}"}).result()
  chunks = [k.decode() for k in store.list().result() if k.startswith(b"params.")]
  chunks = [(store.read(k).result().value, k) for k in chunks if not k.endswith("/.zarray")]
  files = glob.glob(os.path.join(state, "ocdbt.process_*", "d", "*"))
  for value, key in sorted(chunks, key=lambda c: -len(c[0])):
    name = key.rsplit("/", 1)[0]
    before = _read_array(state, name)
    for path in files:
      data = bytearray(open(path, "rb").read())
      at = data.find(value)
      if at < 0:
        continue
      chunk = data[at : at + len(value)]
      DAMAGE[how](chunk)
      with open(path, "wb") as f:
        f.write(bytes(data[:at] + chunk + data[at + len(value) :]))
      after = _read_array(state, name)
      if not isinstance(after, Exception) and not np.array_equal(after, before, equal_nan=True):
        return name
      with open(path, "wb") as f:  # a read error or no change: undone, the next chunk tried
        f.write(bytes(data))
  raise AssertionError(f"no parameter chunk of {state} could be damaged and still read")


def _one_line(e) -> str:
  line = str(e.value if hasattr(e, "value") else e)
  assert line and "\n" not in line, line
  return line


@pytest.mark.slow
def test_sigterm_saves_the_step_and_exits_0_and_sigkill_in_a_save_leaves_a_usable_one(
  tmp_path, capsys
):
  """SIGTERM: the current step saved, exit 0. Resumed, saving every step, and SIGKILLed while a
  checkpoint is written: the last complete one resumes."""
  workdir = str(tmp_path / "run")
  proc = _start_train(workdir, config_flags(tiny_config(num_train_steps=100_000)))
  _wait_for(_logged(workdir, 3), proc)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  assert "Interrupted (signal 15): saved the checkpoint at step" in out
  step = int(out.split("saved the checkpoint at step ")[1].split(";")[0])
  assert step >= 3 and _steps(workdir) == [step]

  every_step = dict(checkpoint_every_steps=1, log_every_steps=1000)
  flags = config_flags(tiny_config(num_train_steps=100_000, **every_step))
  proc = _start_train(workdir, [*flags, "--allow_config_change"])
  saving = os.path.join(workdir, "checkpoints", "*tmp*")
  _wait_for(lambda: _steps(workdir)[-1] > step and glob.glob(saving), proc)
  proc.kill()
  out, _ = proc.communicate(timeout=120)
  assert f"Resuming from the checkpoint at step {step}" in out
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
    bad = jnp.any(batch["inputs"] == POISON)
    return jnp.where(bad, jnp.nan, total), count

  monkeypatch.setattr(train_lib, "weighted_nll", nll)

  def poisoned(n, batch):
    if not at_step <= n <= (until or at_step):
      return batch
    inputs = np.array(batch["inputs"])
    inputs[:, 0] = POISON
    return dict(batch, inputs=inputs)

  change_batches(monkeypatch, poisoned)


def test_a_nonfinite_step_is_skipped_and_counted_a_stale_lock_taken_over_an_inf_ppl_written(
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
  assert not os.path.exists(Workdir(workdir).lock_file)
  assert results["skipped_steps"] == 1
  assert results["valid_ppl"] == math.inf and 1e4 < results["valid_loss"] < math.inf
  assert os.path.exists(os.path.join(workdir, "results.json"))
  records = [r for r in Workdir(workdir).read_metrics() if "loss" in r]
  assert [r["skipped_steps"] for r in records][-1] == 1
  assert [r["step"] for r in records if r["skipped_steps"] == 1][0] == 3


def test_nonfinite_step_stops_with_its_number_when_configured(tmp_path, monkeypatch):
  _poison(monkeypatch, at_step=3)
  workdir = str(tmp_path / "run")
  with pytest.raises(FloatingPointError, match="non-finite loss or gradient at step 3"):
    train_lib.train_and_evaluate(
      tiny_config(num_train_steps=5, nonfinite="stop", checkpoint_every_steps=2), workdir
    )
  assert _steps(workdir) == [2]  # nothing written after the bad step


def test_a_nonfinite_checkpoint_is_never_written(tmp_path):
  mngr = checkpointing.checkpoint_manager(str(tmp_path), checkpointing.CheckpointConfig())
  state = {"w": jnp.array([1.0, jnp.nan])}

  class S:  # the two fields save inspects
    params, opt_state = state, ()

  class It:
    def get_state(self):
      return {}

  with pytest.raises(FloatingPointError, match="refusing to checkpoint non-finite") as err:
    checkpointing.save(mngr, 1, S(), It(), {})
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
  """The save at step 4 fails in the background; the next wait raises, naming step 4 and step 2
  (due to go once step 4 was written, so still there)."""
  workdir = str(tmp_path / "run")
  cmd = [sys.executable, "-c", DISK_FULL, workdir]
  out = prefork.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=300)
  assert out.returncode != 0
  assert "OSError: saving the checkpoint at step 4 failed" in out.stderr
  assert "the previous checkpoint (step 2) is intact" in out.stderr
  # Our error alone: not Orbax's threads' tracebacks, logs and asyncio shutdown noise.
  assert out.stderr.count("Traceback") == 1, out.stderr[-3000:]
  assert "ERROR:absl" not in out.stderr and "Event loop is closed" not in out.stderr
  assert out.stderr.rstrip().splitlines()[-1].startswith("OSError: saving the checkpoint")
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]  # no temporary folder left
  results = train_lib.train_and_evaluate(
    tiny_config(num_train_steps=6, checkpoint_every_steps=2, keep_checkpoints=1), workdir
  )
  assert results["steps"] == 6 and _steps(workdir) == [6]


@pytest.mark.parametrize(
  "write, name",
  [
    (lambda workdir: Workdir(workdir).write_config({}), "config.json"),
    (guards.acquire, "trainer.lock"),
  ],
)
def test_a_full_disk_is_one_error_naming_the_file(tmp_path, write, name):
  """A disk still full (the temporary file is /dev/full: ENOSPC names no file): the error names
  the file, and nothing is left behind."""
  os.symlink("/dev/full", f"{tmp_path / name}.tmp-{os.getpid()}")
  with pytest.raises(OSError, match=f"^.* cannot write {tmp_path / name}: No space left") as e:
    write(str(tmp_path))
  assert e.value.errno == errno.ENOSPC and os.listdir(tmp_path) == []


def test_divergence_stops_after_consecutive_skips_and_keeps_the_last_good_checkpoint(
  tmp_path, monkeypatch
):
  """Every update from step 4 on is non-finite: the run stops at the 5th in a row, naming step 2,
  which rotation never removed."""
  _poison(monkeypatch, at_step=4, until=10**6)
  workdir = str(tmp_path / "run")
  config = tiny_config(
    num_train_steps=30,
    checkpoint_every_steps=2,
    keep_checkpoints=1,
    max_consecutive_skips=5,
    log_every_steps=3,
  )
  with pytest.raises(FloatingPointError, match="steps 4-8 .* the last good checkpoint is step 2"):
    train_lib.train_and_evaluate(config, workdir)
  assert _steps(workdir) == [2]
  # The steps since the last log line (step 6) are written too: they show the divergence.
  records = [r for r in Workdir(workdir).read_metrics() if "loss" in r]
  assert [r["step"] for r in records][:2] == [3, 6] and records[-1]["step"] >= 8, records
  assert math.isnan(records[-1]["loss"]) and records[-1]["skipped_steps"] >= 5


def test_a_changed_config_is_refused_unless_allowed_and_config_json_written_only_after(
  tmp_path, capsys, quiet_after_failure
):
  workdir = str(tmp_path / "run")
  one_step = tiny_config(num_train_steps=1)
  train_lib.train_and_evaluate(one_step, workdir)
  refused = {
    # Extending the run would restart the cosine schedule from another length: a conflict.
    "num_train_steps: 1 in the workdir, 2 now .the learning": {"num_train_steps": 2},
    "model.d_model: 16 in the workdir, 32 now": {"model.d_model": 32},
    "learning_rate: 0.003 in the workdir, 0.001 now": {"learning_rate": 1e-3},
  }
  for says, overrides in refused.items():
    with pytest.raises(ValueError, match=says):
      train_lib.train_and_evaluate(tiny_config(**{"num_train_steps": 1, **overrides}), workdir)
  # Without config.json the checkpoint's own config still refuses another learning rate.
  os.remove(os.path.join(workdir, "config.json"))
  with pytest.raises(ValueError, match="learning_rate: 0.003 in the workdir, 0.1 now"):
    train_lib.train_and_evaluate(tiny_config(learning_rate=0.1), workdir)
  # A change that cannot be restored fails without touching config.json. (The failure leaves
  # background threads silenced for the rest of the process: undone by quiet_after_failure.)
  Workdir(workdir).write_config(RunConfig.from_tree(one_step).tree)
  with pytest.raises(RuntimeError, match="no checkpoint .* can be restored .step 1: "):
    train_lib.train_and_evaluate(
      tiny_config(**{"model.d_model": 32}), workdir, allow_config_change=True
    )
  assert json.load(open(os.path.join(workdir, "config.json")))["model"]["d_model"] == 16
  assert _steps(workdir) == [1]  # nothing moved aside: no checkpoint is damaged
  # --allow_config_change resumes, says so once (not per comparison: setup's and the
  # restore's), and the workdir records the config it resumed with.
  capsys.readouterr()
  changed = tiny_config(num_train_steps=2, learning_rate=1e-3)
  assert train_lib.train_and_evaluate(changed, workdir, allow_config_change=True)["steps"] == 2
  said = capsys.readouterr().out
  assert said.count("Resuming with a changed config") == 1
  assert "Resuming with a changed config (--allow_config_change): learning_rate: 0.003" in said
  assert json.load(open(os.path.join(workdir, "config.json")))["learning_rate"] == 1e-3


TWO_CHECKPOINTS = dict(num_train_steps=4, checkpoint_every_steps=2, keep_checkpoints=3)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
  """A tiny run with checkpoints at steps 2 and 4, trained once (tests damage copies)."""

  def build(folder):
    with contextlib.redirect_stdout(io.StringIO()):
      train_lib.train_and_evaluate(tiny_config(**TWO_CHECKPOINTS), str(folder / "run"))

  workdir = str(shared.once(tmp_path_factory, "two_checkpoints", build)[0] / "run")
  assert Workdir(workdir).checkpoint_steps() == [2, 4]
  return workdir


def test_resume_walks_back_from_damaged_checkpoints(two_checkpoints, tmp_path, capsys):
  workdir = _copy(two_checkpoints, tmp_path)
  ckpts = os.path.join(workdir, "checkpoints")
  largest = _largest_file(os.path.join(ckpts, "4"))
  with open(largest, "r+b") as f:
    f.truncate(os.path.getsize(largest) // 2)
  os.makedirs(os.path.join(ckpts, "6"))  # an empty step folder
  capsys.readouterr()
  results = train_lib.train_and_evaluate(tiny_config(**TWO_CHECKPOINTS), workdir)
  out = capsys.readouterr().out
  skipped = [line for line in out.splitlines() if line.startswith("Skipped the damaged")]
  assert len(skipped) == 2, out
  assert skipped[0].startswith(
    "Skipped the damaged checkpoint at step 6 (FileNotFoundError: the folder is empty; resuming"
  )
  assert skipped[1].startswith("Skipped the damaged checkpoint at step 4 (")
  assert all("resuming from step 2" in line for line in skipped)
  assert "Resuming from the checkpoint at step 2" in out
  assert results["steps"] == 4 and _steps(workdir) == [2, 4]
  assert sorted(os.listdir(os.path.join(workdir, "damaged_checkpoints"))) == ["4", "6"]


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_bytes_are_skipped_and_the_divergence_names_the_step_that_verified(
  how, two_checkpoints, tmp_path, capsys, monkeypatch
):
  """Damaged bytes that still parse: the resume moves step 4 aside and, diverging, names step 2."""
  workdir = _copy(two_checkpoints, tmp_path)
  _damage(workdir, 4, how)
  _poison(monkeypatch, at_step=1, until=10**6)  # every update from step 3 on is non-finite
  config = tiny_config(**TWO_CHECKPOINTS, max_consecutive_skips=2)
  with pytest.raises(FloatingPointError, match="steps 3-4 .* the last good checkpoint is step 2:"):
    train_lib.train_and_evaluate(config, workdir)
  out = capsys.readouterr().out
  assert f"Skipped the damaged checkpoint at step 4 ({MISMATCH}" in out
  assert "Resuming from the checkpoint at step 2" in out
  assert os.listdir(os.path.join(workdir, "damaged_checkpoints")) == ["4"]


def _lose_checksums(step_dir):
  shutil.rmtree(os.path.join(step_dir, "checksums"))


def _lose_checksums_and_metadata(step_dir):
  _lose_checksums(step_dir)
  metadata = os.path.join(step_dir, "_CHECKPOINT_METADATA")
  with open(metadata, "r+b") as f:
    f.write(bytes(os.path.getsize(metadata)))


def _change_data_position(step_dir):
  path = os.path.join(step_dir, "data", "metadata")
  saved = json.load(open(path))
  saved["global_batch_size"] += 1
  with open(path, "w") as f:
    json.dump(saved, f)


def _as_written_before_checksums(step_dir):
  for name in ("checksums", "corpus"):
    shutil.rmtree(os.path.join(step_dir, name))
  path = os.path.join(step_dir, "_CHECKPOINT_METADATA")
  metadata = json.load(open(path))
  for name in ("checksums", "corpus"):
    del metadata["item_handlers"][name]
  with open(path, "w") as f:
    json.dump(metadata, f)


MISMATCH = "DamagedCheckpointError: its contents do not match the checksums saved with them ("
LOST = "DamagedCheckpointError: its checksums (the folder checksums/) are missing, and its"
UNVERIFIED = "written before checkpoints carried checksums, so it is loaded unverified"
VERIFIED_OR_REFUSED = {
  # name: (what is done to step 4, the step loaded, the tools' note, the trainer's line on it)
  "checksums/ lost": (
    _lose_checksums,
    2,
    f"note: skipped the damaged checkpoint at step 4 ({LOST}",
    f"Skipped the damaged checkpoint at step 4 ({LOST}",
  ),
  "checksums/ and metadata lost": (
    _lose_checksums_and_metadata,
    2,
    f"note: skipped the damaged checkpoint at step 4 ({LOST}",
    f"Skipped the damaged checkpoint at step 4 ({LOST}",
  ),
  "data position changed": (
    _change_data_position,
    2,
    f"note: skipped the damaged checkpoint at step 4 ({MISMATCH}data)); using step 2",
    f"Skipped the damaged checkpoint at step 4 ({MISMATCH}data); resuming from step 2)",
  ),
  "written before checksums": (
    _as_written_before_checksums,
    4,
    f"note: the checkpoint at step 4 was {UNVERIFIED}",
    None,
  ),
}


class _Restored(Exception):
  """Raised with the restored step, to stop a run right after its restore."""


@pytest.mark.parametrize("case", VERIFIED_OR_REFUSED)
def test_a_checkpoint_is_verified_before_it_is_compared_or_refused(
  case, two_checkpoints, tmp_path, capsys, monkeypatch
):
  """Lost checksums are damage unless Orbax's metadata shows the step predates them (loaded with
  a note); a changed data position is damage, even allowed. The tools and a resume agree."""
  damage, step, note, skipped = VERIFIED_OR_REFUSED[case]
  workdir = _copy(two_checkpoints, tmp_path)
  damage(os.path.join(workdir, "checkpoints", "4"))
  capsys.readouterr()
  export.main(["--workdir", workdir, "--out", str(tmp_path / "model.msgpack")])
  out, err = capsys.readouterr()
  assert json.loads(out.strip().splitlines()[-1])["step"] == step
  (line,) = err.strip().splitlines()
  assert line.startswith(note), line

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
  assert resumed + ("\n" if skipped else f" ({UNVERIFIED})\n") in out, out
  moved = os.path.join(workdir, "damaged_checkpoints")
  if skipped:
    assert skipped in out and os.listdir(moved) == ["4"], out
  else:
    assert not os.path.exists(moved)


def test_the_tools_say_one_line_on_stderr_about_a_damaged_checkpoint(two_checkpoints, tmp_path):
  """export (as generate and evaluate, through trained.load_run): a damaged latest checkpoint is
  one note; asked for it, one line naming the others; zeroed Orbax metadata with verified
  contents is used, silently."""

  def export(workdir, *flags):
    cmd = [sys.executable, "-m", "aft_jax.tools.export", "--workdir", workdir, *flags]
    out = str(tmp_path / f"{len(os.listdir(tmp_path))}.msgpack")
    return prefork.run([*cmd, "--out", out], cwd=ROOT, capture_output=True, text=True)

  for how in ("truncated", *DAMAGE):
    workdir = _copy(two_checkpoints, tmp_path, how)
    if how == "truncated":  # structural damage: reading fails in TensorStore's threads
      with open(_largest_file(os.path.join(workdir, "checkpoints", "4")), "r+b") as f:
        f.truncate(1000)
    else:
      _damage(workdir, 4, how)
    done = export(workdir)
    assert done.returncode == 0 and len(done.stderr.splitlines()) == 1, done.stderr[-3000:]
    says = "" if how == "truncated" else MISMATCH
    assert done.stderr.startswith(f"note: skipped the damaged checkpoint at step 4 ({says}")
    assert done.stderr.endswith("); using step 2, the newest one that reads\n"), done.stderr
    assert "\x00" not in done.stderr  # NUL bytes (a file's) are no line break: asked apart
    assert json.loads(done.stdout.splitlines()[-1])["step"] == 2
  done = export(workdir, "--step", "4")
  lines = done.stderr.splitlines()
  assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
  assert "step 4:" in lines[0] and "the other checkpoints: --step 2" in lines[0], lines[0]

  workdir = _copy(two_checkpoints, tmp_path, "zeroed")
  metadata = os.path.join(workdir, "checkpoints", "4", "_CHECKPOINT_METADATA")
  with open(metadata, "r+b") as f:
    f.write(bytes(os.path.getsize(metadata)))
  done = export(workdir)
  assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
  assert json.loads(done.stdout.splitlines()[-1])["step"] == 4


def _train(overrides, allow=False):
  def run(workdir, tmp_path):
    config = trained_run_config()
    config.update_from_flattened_dict(overrides)
    train_lib.train_and_evaluate(config, workdir, allow_config_change=allow)

  return run


COMMANDS = {  # each as a user runs it, on a workdir (tmp_path: where an export goes)
  "train": _train({}),
  "generate": lambda workdir, tmp_path: generate.main(["--workdir", workdir, "--length", "4"]),
  "evaluate": lambda workdir, tmp_path: evaluate.main(
    ["--workdir", workdir, "--split", "validation"]
  ),
  "export": lambda workdir, tmp_path: export.main(
    ["--workdir", workdir, "--out", str(tmp_path / "model.msgpack")]
  ),
}


def _held_lock(workdir):
  """A live process (``sleep``) holds the workdir's lock: (its pid, what stops it)."""
  holder = subprocess.Popen(["sleep", "120"])
  with open(Workdir(workdir).lock_file, "w") as f:
    json.dump({"pid": holder.pid, "host": socket.gethostname()}, f)
  return holder


def _other_corpus(workdir):
  """An intact checkpoint written on another corpus: one more train token, checksum updated."""
  step_dir = os.path.join(workdir, "checkpoints", "4")
  saved = json.load(open(os.path.join(step_dir, "corpus", "metadata")))
  saved["tokens"]["train"] += 1
  sums = json.load(open(os.path.join(step_dir, "checksums", "metadata")))
  sums["json"]["corpus"] = checksum.of_json(saved)
  for name, obj in (("corpus", saved), ("checksums", sums)):
    with open(os.path.join(step_dir, name, "metadata"), "w") as f:
      json.dump(obj, f)


REFUSALS = {
  # name: (the command, the error, what its line says)
  "another schedule": (_train({"num_train_steps": 6}), ValueError, "num_train_steps: 4 in the"),
  "another vocabulary, even allowed": (
    _train({"data.tokenizer": "word"}, allow=True),
    ValueError,
    r"trained on another vocabulary \(data.tokenizer: 'byte' in the workdir, 'word' now",
  ),
  "another model, allowed": (
    _train({"model.d_model": 32}, allow=True),
    RuntimeError,
    r"no checkpoint in .* can be restored \(step 4: ",
  ),
  "another batch, allowed": (
    _train({"batch_size": 8}, allow=True),
    ValueError,
    r"the data position in the checkpoint at step 4 is for global_batch_size = 4 \(now 8\)",
  ),
  "a bad config": (_train({"learning_rate": -1.0}), ValueError, "learning_rate"),
  "another corpus": (
    COMMANDS["train"],
    ValueError,
    r"the data changed since the checkpoint at step 4: the train split has [\d,]+ tokens, had",
  ),
  "a mesh this machine lacks": (_train({"mesh.data": 2}), ValueError, "does not match the 1 av"),
  "a batch larger than the data, allowed": (
    _train({"batch_size": 40_000}, allow=True),
    ValueError,
    "split too short",
  ),
  "a held lock": (COMMANDS["train"], guards.WorkdirInUse, "is in use by another trainer"),
  # The only checkpoint damaged: every command refuses it, naming the step and the checksums.
  **{
    f"{command}, {how}": (
      COMMANDS[command],
      (RuntimeError, SystemExit),
      "step 4: DamagedCheckpointError: its contents do not match the checksums",
    )
    for command in COMMANDS
    for how in DAMAGE
  },
}


@pytest.mark.parametrize("case", REFUSALS)
def test_every_refused_run_leaves_the_workdir_byte_for_byte_as_it_was(
  case, trained_run, tmp_path, quiet_after_failure
):
  """Each refusal a command can make, on a copy of the shared run: one line, and every file and
  folder of the workdir as it was (nothing written, moved aside or exported)."""
  command, error, says = REFUSALS[case]
  workdir = _copy(trained_run[0], tmp_path)
  holder = _held_lock(workdir) if case == "a held lock" else None
  if case == "another corpus":
    _other_corpus(workdir)
  if case.split(", ")[-1] in DAMAGE:
    _damage(workdir, 4, case.split(", ")[-1])
  before = listing(workdir)
  try:
    with pytest.raises(error, match=says) as e:
      with contextlib.redirect_stdout(io.StringIO()):
        command(workdir, tmp_path)
  finally:
    if holder is not None:
      holder.kill()
      holder.wait()
  line = _one_line(e)
  assert listing(workdir) == before and not os.path.exists(tmp_path / "model.msgpack")
  if holder is not None:
    assert f"another trainer (pid {holder.pid} on" in line, line
  if case == "a bad config":  # nor is a new workdir left behind
    with pytest.raises(error, match=says):
      command(str(tmp_path / "fresh"), tmp_path)
    assert not os.path.exists(tmp_path / "fresh")


class _Flag:
  """A step's finite flag that records when the training loop reads it."""

  def __init__(self, value, step, events):
    self.value, self.step, self.events = value, step, events

  def __bool__(self):
    self.events.append(("read", self.step))
    return bool(self.value)


def test_a_signal_is_acted_on_within_two_steps_and_flushes_the_metrics(tmp_path, monkeypatch):
  """Step n's finite flag is read before step n+3 is dispatched, and the unlogged metrics are
  written before exiting on a signal."""
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
  records = [r for r in Workdir(workdir).read_metrics() if "loss" in r]
  assert [r["step"] for r in records] == [5] and np.isfinite(records[0]["loss"])


def test_several_processes_agree_on_sigint_at_log_steps_and_leave_sigterm_to_jax(monkeypatch):
  """With several processes JAX's preemption sync manager owns SIGTERM and names the stop step;
  a Ctrl-C is exchanged at log steps only."""
  from aft_jax.trainer import guards as preemption

  monkeypatch.setattr(preemption.jax, "process_count", lambda: 2)
  gathered, sync_steps = [], []
  monkeypatch.setattr(
    preemption.multihost_utils,
    "process_allgather",
    lambda x: gathered.append(int(x)) or np.array([int(x), 0]),
  )
  monkeypatch.setattr(
    preemption.multihost_utils,
    "reached_preemption_sync_point",
    lambda step: sync_steps.append(step) or step == 7,
  )
  sigterm, sigint = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  with preemption.Preemption() as p:
    assert signal.getsignal(signal.SIGTERM) is sigterm
    assert not p.should_stop(1, every=2) and not p.should_stop(2, every=2)
    os.kill(os.getpid(), signal.SIGINT)
    assert not p.should_stop(3, every=2)  # not a log step
    assert p.should_stop(4, every=2) and p.signal == signal.SIGINT
  assert gathered == [0, 1] and sync_steps == [1, 2, 3, 4]
  with preemption.Preemption() as p:  # the sync manager's step, between log steps
    assert not p.should_stop(5, every=2) and p.should_stop(7, every=2)
    assert p.signal.startswith("SIGTERM, preemption notice")
  assert signal.getsignal(signal.SIGINT) is sigint  # the handler found (SIG_IGN in background)


def test_sigterm_in_the_final_evaluation_keeps_the_finished_splits(tmp_path, monkeypatch, capsys):
  """SIGTERM while the test split is scored: one message, no results.json, the lock released,
  validation kept; the rerun scores only the test split."""
  workdir = str(tmp_path / "run")
  config = tiny_config(num_train_steps=2, **{"sample.length": 0})
  original, scored = train_lib.Trainer.evaluate, []

  def evaluate(self, params, tokens, bos_id, desc="eval", **kw):
    scored.append(desc)
    if desc == "test" and signal_once:
      signal_once.pop()
      os.kill(os.getpid(), signal.SIGTERM)  # recorded by the run's handler, acted on next batch
    return original(self, params, tokens, bos_id, desc, **kw)

  signal_once = [True]
  monkeypatch.setattr(train_lib.Trainer, "evaluate", evaluate)
  out = train_lib.train_and_evaluate(config, workdir)
  said = capsys.readouterr().out
  assert out == {"interrupted": True, "step": 2}, out
  assert f"signal {int(signal.SIGTERM)}) during the final evaluation of the test split" in said
  wd = Workdir(workdir)
  assert not os.path.exists(wd.results_file) and not os.path.exists(wd.lock_file)
  kept = wd.read_final_eval()
  assert kept["step"] == 2 and set(kept["splits"]) == {"validation"}

  scored.clear()
  results = train_lib.train_and_evaluate(config, workdir)
  assert scored == ["test"]  # the validation split was not scored again
  assert results["valid_loss"] == kept["splits"]["validation"]["nll"]
  with open(wd.results_file) as f:
    assert json.load(f)["test_tokens"] == results["test_tokens"] > 0
