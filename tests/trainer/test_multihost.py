"""train.py on several devices and processes (gloo on 127.0.0.1) gives one device's losses."""

import json
import os
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from tests.support import prefork
from tests.support.helpers import ROOT, config_flags, tiny_config, train_py, xla_flags
from aft_jax.workdir import Workdir

STEPS, TIMEOUT_S = 4, 300
BASE = {"model.mixing": "aft_full", "model.dropout_rate": 0.0, "batch_size": 8}
BASE.update(eval_batch_size=512, num_train_steps=STEPS, checkpoint_every_steps=2)


def _config(mesh, **overrides):
  c = tiny_config(**{**BASE, **overrides})
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


_STARTED = []  # every process a test starts; the fixture below kills any still running


@pytest.fixture(autouse=True)
def _kill_leftovers():
  yield
  _kill(_STARTED)
  _STARTED.clear()


def _kill(procs):
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def _start(workdir, config, devices, log, *extra):
  """train.py on ``devices`` CPU devices, its output in the file ``log`` (``proc.log``)."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")
  with open(log, "w") as out:
    proc = prefork.popen(
      train_py(workdir, *config_flags(config), *extra),
      cwd=ROOT,
      env=env,
      stdout=out,
      stderr=subprocess.STDOUT,
      start_new_session=True,
    )
  proc.log = log
  _STARTED.append(proc)
  return proc


def _two(workdir, config, name):
  """Two processes of 2 devices, one run coordinated on 127.0.0.1: logs NAME_0.log, NAME_1.log."""
  with socket.socket() as s:  # a free port
    s.bind(("127.0.0.1", 0))
    dist = [f"--coordinator_address=127.0.0.1:{s.getsockname()[1]}", "--num_processes=2"]
  log = os.path.join(os.path.dirname(workdir), name)
  return [
    _start(workdir, config, 2, f"{log}_{i}.log", *dist, f"--process_id={i}") for i in range(2)
  ]


def _wait_all(procs, succeed=True):
  """Waits for every process; on a timeout kills them all (no hung test) and fails."""
  deadline = time.monotonic() + TIMEOUT_S
  try:
    for p in procs:
      p.wait(timeout=max(1.0, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    _kill(procs)
    pytest.fail("a train.py process hung; logs:\n" + _tails(procs))
  for p in procs:
    assert (p.returncode == 0) == succeed, _tails(procs)


def _tails(procs):
  return "\n".join(f"--- {p.log}\n" + open(p.log).read()[-3000:] for p in procs)


def _losses(workdir):
  return [r["loss"] for r in Workdir(workdir).read_metrics() if "loss" in r]


@pytest.mark.slow
def test_mesh_and_multiprocess_losses_match_one_device(tmp_path):
  runs = {"one_device": ((1, 1, 1), 1), "one_process": ((2, 1, 2), 4)}  # and "two_processes"
  procs = [
    _start(str(tmp_path / name), _config(mesh), devices, tmp_path / f"{name}.log")
    for name, (mesh, devices) in runs.items()
  ]
  # fsdp = 2 spans the processes; process 0 samples alone, from parameters gathered from both.
  sampled = {"sample.length": 4, "sample.prompt": "def "}
  two = tmp_path / "two_processes"
  procs += _two(str(two), _config((1, 2, 2), **sampled), "two_processes")
  # Batch axes that do not split across the processes: refused before compiling.
  bad = _two(str(tmp_path / "bad_mesh"), _config((1, 1, 4), **sampled), "bad_mesh")
  _wait_all(procs)
  _wait_all(bad, succeed=False)
  for p in bad:
    assert "mesh data x fsdp = 1 is not a multiple of the 2 processes" in open(p.log).read()

  losses = {name: _losses(str(tmp_path / name)) for name in [*runs, "two_processes"]}
  assert len(losses["one_device"]) == STEPS, losses
  for name in ("one_process", "two_processes"):
    np.testing.assert_allclose(losses[name], losses["one_device"], rtol=0, atol=1e-4, err_msg=name)

  # Only process 0 writes metrics: each step's record appears once (the file is shared).
  records = [json.loads(line) for line in open(two / "metrics.jsonl")]
  assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1)), records
  assert len(os.listdir(two / "tensorboard")) == 1
  out0, out1 = (open(tmp_path / f"two_processes_{i}.log").read() for i in range(2))
  assert "validation perplexity" in out0 and "Sample:\ndef " in out0
  assert "validation perplexity" not in out1 and "Sample:" not in out1
  assert "mesh {'data': 1, 'fsdp': 2, 'tensor': 2}" in out0
  assert sorted(os.listdir(two / "checkpoints")) == ["2", "4"]
  results = {n: json.load(open(tmp_path / n / "results.json")) for n in [*runs, "two_processes"]}
  one = results["one_device"]
  for name in ("one_process", "two_processes"):
    assert results[name]["valid_loss"] == pytest.approx(one["valid_loss"], abs=1e-4)
    assert results[name]["valid_tokens"] == one["valid_tokens"]

  # Rerun when finished: both processes restore their shards and evaluate again, to the same result.
  before = results["two_processes"]
  again = _two(str(two), _config((1, 2, 2), **sampled), "two_processes_again")
  _wait_all(again)
  assert "Resuming from the checkpoint at step 4" in open(again[0].log).read()
  again = json.load(open(two / "results.json"))
  assert again["steps"] == 4
  assert again["valid_loss"] == pytest.approx(before["valid_loss"], abs=1e-6)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_all_at_the_same_step(tmp_path):
  steps = dict(num_train_steps=10**5, log_every_steps=2, checkpoint_every_steps=10**5)
  workdir = str(tmp_path / "run")
  procs = _two(workdir, _config((1, 2, 2), **steps), "p")
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + TIMEOUT_S
  while not (os.path.exists(metrics_path) and sum(1 for _ in open(metrics_path)) >= 2):
    assert all(p.poll() is None for p in procs), _tails(procs)
    assert time.monotonic() < deadline, _tails(procs)
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGTERM)  # only the second process is told
  _wait_all(procs)
  # JAX's preemption sync manager names the step (not "from another process"); both saved it.
  out0 = open(procs[0].log).read()
  assert "Interrupted (signal SIGTERM, preemption notice" in out0, _tails(procs)
  step = int(out0.split("saved the checkpoint at step ")[1].split(";")[0])
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [str(step)]
