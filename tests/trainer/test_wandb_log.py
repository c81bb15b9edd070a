"""The optional W&B logging (aft_jax.trainer.step_log), offline."""

import contextlib
import glob
import hashlib
import importlib.util
import io
import json
import os
import types

import pytest

from aft_jax.trainer import step_log, train_lib
from aft_jax.trainer.run_config import RunConfig
from tests.support.helpers import tiny_config


def test_the_project_key_without_the_extra_is_one_line_saying_how_to_install(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
  )
  config = tiny_config(**{"wandb.project": "mine"})
  with pytest.raises(ValueError, match=r"wandb\.project = 'mine' needs Weights & Biases") as e:
    RunConfig.from_tree(config)
  assert step_log.WANDB_INSTALL in str(e.value) and "\n" not in str(e.value)
  RunConfig.from_tree(tiny_config())  # no project: W&B is never asked for


def test_a_fresh_run_gets_a_new_wandb_id_and_a_resume_keeps_it(tmp_path):
  workdir = str(tmp_path / "run")
  first = step_log.wandb_run_id(workdir, resumed=False)
  assert step_log.wandb_run_id(workdir, resumed=True) == first
  second = step_log.wandb_run_id(workdir, resumed=False)
  assert second != first and step_log.wandb_run_id(workdir, resumed=True) == second
  # A workdir from before the id was kept resumes the run its path named.
  old = str(tmp_path / "old")
  assert step_log.wandb_run_id(old, resumed=True) == hashlib.sha256(old.encode()).hexdigest()[:16]


def test_an_offline_run_writes_the_metrics_to_a_local_wandb_run_and_a_rerun_continues_it(
  tmp_path, monkeypatch
):
  for name, value in [("MODE", "offline"), ("SILENT", "true"), ("DIR", str(tmp_path / "run"))]:
    monkeypatch.setenv(f"WANDB_{name}", value)  # offline: nothing leaves the machine
  config = tiny_config(num_train_steps=2, **{"wandb.project": "aft-jax-test", "sample.length": 8})
  with contextlib.redirect_stdout(io.StringIO()):
    results = train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  # run.finish() only asks W&B's service to write the record: complete once teardown returns.
  import wandb

  wandb.teardown()
  (run_id,) = open(tmp_path / "run" / step_log.WANDB_ID_FILE).read().split()
  (run_dir,) = glob.glob(str(tmp_path / "run" / "wandb" / f"offline-run-*-{run_id}"))
  (record,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))  # everything the run logged
  with open(record, "rb") as f:
    data = f.read()
  # The metrics' names and values, as W&B keeps them (JSON text inside its protobuf records).
  for key in ("loss", "grad_norm", "tokens_per_sec", "valid_ppl", "test_loss"):
    assert key.encode() in data, key
  assert json.dumps(results["valid_ppl"]).encode() in data
  assert b"aft-jax-test" in data and b"num_train_steps" in data  # the project and the config
  # The id is new (not the path's), and the rerun of the finished run continues its W&B run.
  assert run_id != hashlib.sha256(str(tmp_path / "run").encode()).hexdigest()[:16]
  # Each record with its step, the sample as a table, the config not twice (wandb.init has it).
  ids, logged = [], []

  run = types.SimpleNamespace(log=lambda values, step: logged.append((step, values)))
  run.finish = lambda: logged.append("finished")
  monkeypatch.setattr(wandb, "init", lambda **kw: ids.append(kw["id"]) or run)
  with contextlib.redirect_stdout(io.StringIO()):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert ids == [run_id] and logged[-1] == "finished"
  (sample,) = [values["sample"] for step, values in logged[:-1] if "sample" in values]
  assert sample.data[0][0].startswith(config.sample.prompt) and all(s == 2 for s, _ in logged[:-1])
  assert not any("config" in values for _, values in logged[:-1])
