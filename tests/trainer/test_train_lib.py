"""End-to-end training: train.py in a subprocess, exact resume, evaluation, generation."""

import functools
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from tests.support import prefork
from tests.trainer import change_batches, run_train_in_process, wrap_train_step
from tests.support.helpers import FAST_COMPILE, ROOT, tiny_config, train_py
from aft_jax.tools import trained
from aft_jax.trainer import cpu_devices, train, train_lib
from aft_jax.trainer.run_config import RunConfig
from aft_jax.workdir import Workdir
from configs import quickstart

QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
COUNT = "--xla_force_host_platform_device_count"


def _losses(workdir):
  return {r["step"]: r["loss"] for r in Workdir(workdir).read_metrics() if "loss" in r}


def _interrupt_after(monkeypatch, n):
  """Sends this process SIGTERM right after the n-th train step, as a preemption would."""
  calls = {"n": 0}

  def step(orig, *args):
    out = orig(*args)
    calls["n"] += 1
    if calls["n"] == n:
      os.kill(os.getpid(), signal.SIGTERM)
    return out

  wrap_train_step(monkeypatch, step)


def _hold_the_save_at_2(monkeypatch, workdir, until_batch):
  """Holds the save at step 2 unfinished until the run draws batch ``until_batch``: (batches from
  3 on drawn while its folder was not in place, [whether released, not timed out]), filled live."""
  import orbax.checkpoint as ocp

  release, released, during = threading.Event(), [], []

  def hold():
    if not released:
      released.append(release.wait(timeout=600))  # (only a failing test waits that long)

  def on_draw(n, batch):
    if n >= 3 and not os.path.isdir(workdir / "checkpoints" / "2"):
      during.append(n)
    if n == until_batch:
      release.set()
    return batch

  options = functools.partial(
    ocp.CheckpointManagerOptions, async_options=ocp.AsyncOptions(post_finalization_callback=hold)
  )
  monkeypatch.setattr(ocp, "CheckpointManagerOptions", options)
  change_batches(monkeypatch, on_draw)
  return during, released


def test_steps_run_while_a_save_is_written_and_a_packed_run_resumes_exactly(
  docs, tmp_path, monkeypatch
):
  text = {"data.dataset": "text", "data.train_files": str(docs / "*.py")}
  text["data.data_dir"] = str(tmp_path / "data")
  steps = dict(num_train_steps=6, checkpoint_every_steps=2, keep_checkpoints=3)
  config = tiny_config(**steps, **text, **{"data.packing": True})
  during, released = _hold_the_save_at_2(monkeypatch, tmp_path / "a", until_batch=4)
  straight = train_lib.train_and_evaluate(config, str(tmp_path / "a"))
  assert during == [3, 4] and released == [True]
  monkeypatch.undo()
  assert trained.load_run(str(tmp_path / "a"), step=2).step == 2  # verified, else an error

  resumed_dir = str(tmp_path / "b")
  _interrupt_after(monkeypatch, 3)
  said = []  # what the run printed, and whether checkpoint 3 was on disk when it did
  on_disk = lambda: os.path.isdir(os.path.join(resumed_dir, "checkpoints", "3"))  # noqa: E731
  monkeypatch.setattr(
    train_lib, "print", lambda *a, **kw: said.append((" ".join(a), on_disk())), False
  )
  assert train_lib.train_and_evaluate(config, resumed_dir) == {"interrupted": True, "step": 3}
  interrupted = "\nInterrupted (signal 15): saved the checkpoint at step 3; run the same command"
  assert (interrupted + " again to resume.", True) in said
  monkeypatch.undo()
  resumed = train_lib.train_and_evaluate(config, resumed_dir)

  a, b = _losses(str(tmp_path / "a")), _losses(resumed_dir)
  assert sorted(b) == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([b[s] for s in range(1, 7)], [a[s] for s in range(1, 7)], rtol=1e-5)
  assert resumed["valid_loss"] == pytest.approx(straight["valid_loss"], rel=1e-5)
  assert resumed["steps"] == straight["steps"] == 6
  assert math.isfinite(straight["valid_bpb"]) and straight["train_rows"].startswith("packed")
  stream = train_lib.train_and_evaluate(tiny_config(num_train_steps=1, **text), str(tmp_path / "c"))
  assert (stream["valid_tokens"], stream["train_rows"][:6]) == (straight["valid_tokens"], "stream")


_TEMPORARIES = """
import os, resource
from aft_jax.trainer import train
train.restart_with_huge_pages()
import jax, jax.numpy as jnp
a = jnp.ones((4096, 8))
f = jax.jit(lambda a: jnp.tanh(a @ a.T) @ a)  # a [4096, 4096] temporary: 64 MiB
pages = f.lower(a).compile().memory_analysis().temp_size_in_bytes / 4096
for _ in range(3):
  f(a).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
  f(a).block_until_ready()
share = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10 / pages
print(os.environ.get("GLIBC_TUNABLES"), share)
"""


@pytest.mark.skipif(train.with_huge_pages({}) is None, reason="not glibc, or no huge pages")
def test_a_restarted_command_faults_its_temporaries_in_by_huge_pages():
  """Page faults a call, as a share of its temporary's 4 KiB pages: without the restart, all."""
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  cmd = [sys.executable, "-c", _TEMPORARIES]
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
  tunables, share = out.stdout.split()
  assert tunables == train.HUGE_PAGES and float(share) < 0.25, out.stdout


@pytest.mark.slow
def test_quickstart_recipe_learns_then_generate_continues_it(tmp_path):
  workdir = str(tmp_path / "quick")
  steps = 120
  flags = (f"--config.num_train_steps={steps}", "--config.sample.length=20")
  cmd = train_py(workdir, *flags, "--jax_debug_nans=false", "--verbosity=0")
  # XLA's own optimisations, as a user's run has them (without them 120 steps took 2.3x as long).
  env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE, ""))
  out = prefork.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  results = json.load(open(os.path.join(workdir, "results.json")))
  assert results["unigram_valid_ppl"] > 20  # bytes of English text
  assert results["valid_ppl"] < results["unigram_valid_ppl"] / 1.6, results
  assert f"validation perplexity {results['valid_ppl']:.3f} (unigram baseline" in out.stdout
  assert "Sample:\nThe " in out.stdout
  # train.py made the CPU one device per core (as many as split the batches) and trained on all.
  n = cpu_devices.count_for(RunConfig.from_tree(quickstart.get_config()), cpu_devices.cores())
  assert f"mesh {{'data': {n}, 'fsdp': 1" in out.stdout, out.stdout[:2000]
  assert results["test_ppl"] > 1 and results["num_params"] > 0
  saved = json.load(open(os.path.join(workdir, "config.json")))
  assert saved["model"]["d_model"] == 128 and saved["num_train_steps"] == results["steps"] == steps
  assert results["tokens_seen"] == steps * saved["batch_size"] * saved["seq_len"]
  every = saved["log_every_steps"]  # and the last step, whatever its remainder
  assert list(_losses(workdir)) == [*range(every, steps, every), steps]
  assert os.path.isdir(os.path.join(workdir, "checkpoints", str(steps)))
  assert os.listdir(os.path.join(workdir, "tensorboard"))

  generate = [sys.executable, "-m", "aft_jax.tools.generate", "--workdir", workdir]
  flags = ["--prompt", "class ", "--length", "12", "--temperature", "0"]
  gen = prefork.run(generate + flags, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert gen.returncode == 0, gen.stderr[-3000:]
  assert gen.stdout.startswith("class ") and len(gen.stdout.rstrip("\n")) > len("class ")


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
  def valid_loss(name, **overrides):
    config = tiny_config(**{"model.dropout_rate": 0.0, "warmup_steps": 0}, **overrides)
    return train_lib.train_and_evaluate(config, str(tmp_path / name))["valid_loss"]

  accum = valid_loss("accum", batch_size=4, grad_accum_steps=2, num_train_steps=2)
  big = valid_loss("big", batch_size=8, num_train_steps=1)
  assert accum == pytest.approx(big, rel=1e-5)
  untrained = valid_loss("none", batch_size=8, num_train_steps=1, learning_rate=1e-12)
  assert abs(big - untrained) > 1e-3  # the update did something


CLI = [  # (the command line after --config QUICKSTART, the one line it says); {tmp}: the cwd
  ("--workdir run --config.seed=-1", "config.seed = -1"),
  # A mistyped key (ml_collections raises while absl parses): the whole key, the closest ones.
  ("--workdir run --config.model.d_modle=1", "unknown config key 'model.d_modle'; did you m"),
  ("--workdir run --num_devices=x", "error: flag --num_devices=x: invalid literal for int()"),
  # A recipe's argument its get_config refuses (given again: the last --config is used).
  ("--workdir run --config=wikitext103:aft_bogus", "--config: ValueError: configs/wikitext1"),
  ("--workdir run --config={root}/configs/wikitext103.py:aft_x", "'aft_x' is not one of ('a"),
  ("--workdir run --config=configs/nosuch.py:x --config.seed=1", "no config file 'configs/"),
  ("", "--workdir is required"),  # not the current directory
  ("--workdir ''", "--workdir is required"),
  ("--workdir ' '", "--workdir = ' ' is blank"),
  # The README's --config "text:~/notes/**/*.md": the glob reaches the recipe whole (~: $HOME);
  # given after --config QUICKSTART, with an override: the last --config is the run's.
  ("--workdir run --config text:~/n/**/*.md --config.num_train_steps=2", "'{tmp}/n/**/*.md"),
  ("--config {root}/configs/text.py:~/n/**/*.md --workdir run", "files: '{tmp}/n/**/*.md' ma"),
  (f"XLA_FLAGS={COUNT}=abc --workdir run", f"XLA_FLAGS has {COUNT}=abc: no number of"),
  (f"XLA_FLAGS={COUNT}=0 --workdir run", "device_count=0: no num"),
]


def _command(flags, tmp_path):
  """(environment variables, argv) of a ``CLI`` row."""
  flags = shlex.split(flags.format(root=ROOT))
  env = dict(f.split("=", 1) for f in flags if "=" in f and not f.startswith("-"))
  flags = [f for f in flags if "=" not in f or f.startswith("-")]
  config = [] if flags[:1] == ["--config"] else ["--config", QUICKSTART]
  return {**env, "HOME": str(tmp_path)}, ["train.py", *config, *flags]


@pytest.mark.parametrize("flags, message", CLI)
def test_a_bad_command_line_is_one_line_on_stderr(flags, message, tmp_path, monkeypatch, capsys):
  """From an empty folder: one line, exit status 1, nothing written."""
  env, argv = _command(flags, tmp_path)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  monkeypatch.chdir(tmp_path)
  status, said = run_train_in_process(argv, monkeypatch, capsys)
  lines = [line for line in said.splitlines() if line.strip()]
  assert status == 1 and len(lines) == 1 and message.format(tmp=tmp_path) in lines[0], said
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
  "flags, message",
  [
    # jax refuses a word when imported: before the trainer is.
    ("JAX_NUM_CPU_DEVICES=abc --workdir run", 'Invalid value "abc" for JAX flag jax_num_cpu_de'),
    # JAX's own flags pass through absl; 0 failed as jax's CPU backend started, blaming a plugin.
    ("--workdir run --jax_num_cpu_devices=0", "jax_num_cpu_devices = 0 (JAX_NUM_CPU_DEVICES, aft"),
  ],
)
def test_a_bad_jax_setting_is_one_line_and_exit_status_1(tmp_path, flags, message):
  env, argv = _command(flags, tmp_path)
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), *argv[1:]]
  env = {**os.environ, **env}
  out = prefork.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert out.returncode == 1 and len(lines) == 1, out.stderr[-2000:]
  assert message in lines[0] and os.listdir(tmp_path) == [], lines[0]


def test_a_warmup_longer_than_the_run_and_a_vocab_size_bytes_and_words_do_not_use_are_said():
  """Notes, not errors: a workdir that recorded such a value still resumes as it ran."""
  from aft_jax.data.config import DataConfig, vocab_size_note
  from aft_jax.trainer.optimizer import OptimizerConfig, warmup_note

  cfg = RunConfig.from_tree(tiny_config(**{"data.vocab_size": 1000, "warmup_steps": 50}))
  said = []
  train_lib.make_trainer(cfg, 256, jax.devices()[:1], say=said.append)
  assert said == [
    "note: warmup_steps = 50 is not shorter than the run's 6 updates: the learning rate warms up "
    "over 5 and then decays",
    "note: config.data.vocab_size = 1000 is not used: tokenizer = 'byte' has its 256 byte "
    "values (vocab_size is the size of a 'subword' vocabulary)",
  ]
  assert warmup_note(OptimizerConfig(warmup_steps=3), 10) is None
  assert "run's 5 updates" in warmup_note(OptimizerConfig(warmup_steps=5, grad_accum_steps=2), 10)
  word = vocab_size_note(DataConfig(tokenizer="word", vocab_size=5))
  assert "'word' has the words of the train split" in word
  assert vocab_size_note(DataConfig(dataset="text", tokenizer="subword", vocab_size=400)) is None
  assert vocab_size_note(DataConfig(tokenizer="byte")) is None


def test_cpu_compile_options_only_on_cpu_meshes_and_not_over_xla_flags(monkeypatch):
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("data",))
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert train_lib.compiler_options(mesh) == train_lib.CPU_COMPILER_OPTIONS
  (name,) = train_lib.CPU_COMPILER_OPTIONS
  monkeypatch.setenv("XLA_FLAGS", f"--{name}=dot")  # the user's flag wins
  assert train_lib.compiler_options(mesh) is None

  class Gpu:  # a mesh whose devices are not CPUs (a GPU's, a deviceless topology's)
    devices = np.array([type("D", (), {"platform": "gpu"})()])

  assert train_lib.compiler_options(Gpu()) is None
