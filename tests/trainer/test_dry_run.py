"""``train.py --dry_run --target NAME``: exit 0 fits, 1 not, 2 refused (one line)."""

import json
import os
import sys
import types

import pytest

from aft_jax import deviceless
from aft_jax.trainer import dry_run
from aft_jax.trainer.run_config import RunConfig
from tests.support import prefork
from tests.support.helpers import ROOT, listing, tiny_config
from tests.trainer import run_train_in_process

KEYS = {"target", "num_devices", "fits", "temp_bytes", "argument_bytes", "device_memory_bytes"}


def _dry_run(*flags, config="configs/quickstart.py", env=None):
  """(exit code, stdout lines, the last line's JSON or None) of train.py --dry_run."""
  cmd = [sys.executable, "train.py", "--config", config, "--dry_run", *flags]
  env = None if env is None else {**os.environ, **env}
  done = prefork.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  lines = done.stdout.strip().splitlines()
  try:
    report = json.loads(lines[-1])
  except (IndexError, json.JSONDecodeError):
    report = None
  return done.returncode, lines, report, done.stderr


@pytest.mark.slow
def test_quickstart_fits_an_h100_with_the_kernels():
  from configs import quickstart
  from tests.support.deviceless_worker import interpreted_kernels

  code, lines, report, err = _dry_run("--target", "h100")
  assert code == 0 and report is not None, err[-2000:]
  assert KEYS <= set(report)
  assert report["fits"] and report["target"] == "h100" and report["num_devices"] == 1
  config = quickstart.get_config()
  assert config.model.mixing == "aft_local" and report["impl"] == "auto"
  # The Pallas calls of one AFT-local layer's forward and backward at the recipe's shapes (its
  # kernels interpreted on this host: they take the same configurations).
  case = {"op": "aft_local", "mode": "grad", "window": config.model.window, "dtype": "float32"}
  case.update(batch=config.batch_size, t=config.seq_len, d=config.model.d_model)
  per_layer = len(interpreted_kernels(case))
  assert report["triton_kernels"] == config.model.num_layers * per_layer >= 2, report
  assert report["device_memory_bytes"] == deviceless.get("h100").memory_bytes
  assert 0 < report["temp_bytes"] < report["usable_bytes"]
  # The human part says what a person needs before renting the GPU.
  text = "\n".join(lines)
  assert "compiled for the target without a device" in text and "Fits:" in text


@pytest.mark.slow
def test_a_step_too_large_exits_1_and_says_what_would_fit():
  size = ("d_model=16384", "mlp_dim=65536", "mixing=aft_simple")
  flags = ("--target", "cpu", "--num_devices", "2", *(f"--config.model.{s}" for s in size))
  code, lines, report, err = _dry_run(*flags)
  assert code == 1 and report is not None, err[-2000:]
  assert not report["fits"] and report["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1}
  assert report["argument_bytes"] > report["usable_bytes"] and report["triton_kernels"] == 0
  fsdp = [s for s in report["suggestions"] if "--config.mesh.fsdp=4" in s]
  assert len(fsdp) == 1 and "(compiled)" in fsdp[0], report["suggestions"]
  assert "Does not fit" in "\n".join(lines)


def _fake_dist(folder, name, files):
  """A pip ``--target`` install's dist-info of ``name`` whose RECORD lists ``files``."""
  info = folder / f"{name.replace('-', '_')}-1.0.dist-info"
  info.mkdir(parents=True)
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
  rows = [f"{path},sha256=x,{len(data)}" for path, data in files.items()]
  (info / "RECORD").write_text("\n".join(rows + [f"{info.name}/RECORD,,"]) + "\n")


@pytest.fixture
def plugin_root(tmp_path, monkeypatch):  # its own $AFT_JAX_PLUGIN_DIR: the real one untouched
  monkeypatch.setenv("AFT_JAX_PLUGIN_DIR", str(tmp_path / "plugins"))
  return tmp_path / "plugins"


def test_a_half_installed_plugin_is_named_with_the_reinstall_command(plugin_root, monkeypatch):
  folder = plugin_root / f"jaxlib-{deviceless._jaxlib_version()}" / "cuda"
  assert not deviceless.installed("cuda") and deviceless.incomplete("cuda") is None  # absent
  (folder / "jax_plugins" / "xla_cuda12").mkdir(parents=True)  # (then: the refused dry run's row)
  _fake_dist(folder, "jax-cuda12-plugin", {"jax_plugins/xla_cuda12/x.so": b"12345"})
  _fake_dist(folder, "jax_cuda12_pjrt", {"jax_plugins/p.so": b"678"})
  assert deviceless.incomplete("cuda") == "jax_plugins/xla_cuda12/x.so is missing or cut short"
  (folder / "jax_plugins" / "xla_cuda12" / "x.so").write_bytes(b"1234")  # cut short
  assert deviceless.incomplete("cuda") == "jax_plugins/xla_cuda12/x.so is missing or cut short"
  (folder / "jax_plugins" / "xla_cuda12" / "x.so").write_bytes(b"12345")
  (folder / "jax_plugins" / "p.so").write_bytes(b"678")
  assert deviceless.incomplete("cuda") is None and deviceless.installed("cuda")
  os.remove(folder / "jax_plugins" / "p.so")
  with pytest.raises(RuntimeError) as e:
    deviceless.environment("cuda")
  assert str(e.value) == (
    f"the cuda compiler plugin in {folder} is incomplete (jax_plugins/p.so is missing or cut "
    "short): reinstall: python -m aft_jax.deviceless install cuda"
  )
  pip = []
  done = types.SimpleNamespace(returncode=0, stdout="", stderr="")
  monkeypatch.setattr(deviceless.subprocess, "run", lambda cmd, **kw: pip.append(cmd) or done)
  assert deviceless.install("cuda", quiet=True) == str(folder)
  assert not folder.exists() and pip and pip[0][-2:] == deviceless.plugin_packages("cuda")


BIG_BATCH = (
  r"--config.batch_size = 1,000,000,000: one device's share of the batch alone \(1,000,000,000 x "
  r"32 tokens\) takes 238.42 GiB, more than the 11.06 GiB usable on NVIDIA Tesla T4.*it cannot fit"
)


def test_what_a_dry_run_refuses_is_checked_without_a_compiler(monkeypatch):
  monkeypatch.delenv(dry_run.MEM_FRACTION, raising=False)
  with pytest.raises(ValueError, match="the targets are: t4 .*a100-40.*h200.*v5e.*cpu"):
    deviceless.get("k80")
  cpu, t4, v5e = (deviceless.get(t) for t in ("cpu", "t4", "v5e"))
  config = RunConfig.from_tree(tiny_config())  # as the command line builds it, once
  assert dry_run.check(config, cpu, 1) == dry_run.usable_bytes(cpu)
  big_batch = RunConfig.from_tree(tiny_config(batch_size=10**9))
  refusals = [  # (config, target, --num_devices, the message)
    (config, cpu, 10**6, "--num_devices 1,000,000: a dry run for cpu compiles for at most 512"),
    (config, t4, 10**6, "--num_devices 1,000,000: a dry run for t4 compiles for at most 65,536"),
    (config, cpu, 0, "--num_devices must be >= 1, got 0"),
    (config, v5e, 3, "a TPU slice has 1, 2, 4, ... 256 chips, not 3"),
    (config, cpu, 3, "batch_size = 4 is not divisible by the 3 data-parallel devices"),
    (big_batch, t4, 1, BIG_BATCH),
  ]
  for config_, target, devices, message in refusals:
    with pytest.raises(ValueError, match=message) as e:
      dry_run.check(config_, target, devices)
    assert "\n" not in str(e.value)
  for value in ("abc", "0", "5", "nan", "-0.5", ""):
    monkeypatch.setenv(dry_run.MEM_FRACTION, value)
    with pytest.raises(ValueError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION = .* must be a number"):
      dry_run.check(config, t4, 1)
    assert dry_run.check(config, cpu, 1)  # a GPU's share: the CPU target does not read it
  monkeypatch.setenv(dry_run.MEM_FRACTION, "1")
  assert dry_run.usable_bytes(t4) == t4.memory_bytes


def test_an_xla_error_in_a_dry_run_compile_is_one_line():
  class Lowered:
    def compile(self):
      raise RuntimeError("INTERNAL: something in XLA\n" + "  at frame\n" * 50)

  with pytest.raises(RuntimeError) as e:
    dry_run._compile(Lowered(), ())
  assert str(e.value) == "XLA could not compile the step: INTERNAL: something in XLA"


@pytest.mark.parametrize(
  "flags, message",
  [
    (("--target", "k80"), "unknown target 'k80'; the targets are: t4 (NVIDIA Tesla T4, 16 GB"),
    (("--config.learning_rte=1",), "override: unknown config key 'learning_rte'; did you"),
    (("--config", "nosuch"), "unknown recipe 'nosuch'; the recipes are: enwik8, quickstart"),
    (("--target", "t4"), "incomplete (jax-cuda12-plugin is not"),  # a half-installed plugin
  ],
)
def test_a_refused_dry_run_is_one_line_and_exit_status_2(
  flags, message, plugin_root, monkeypatch, capsys
):
  plugins = plugin_root / f"jaxlib-{deviceless._jaxlib_version()}" / "cuda" / "jax_plugins"
  plugins.mkdir(parents=True)  # half installed: the t4 row's
  argv = ["train.py", "--config", "configs/quickstart.py", "--dry_run", *flags]
  status, said = run_train_in_process(argv, monkeypatch, capsys)
  lines = [line for line in said.splitlines() if line.strip()]
  assert status == dry_run.REFUSED and len(lines) == 1 and message in lines[0], said


@pytest.mark.slow
def test_a_dry_run_of_a_word_level_text_recipe_writes_nothing(docs, tmp_path):
  from aft_jax.data import corpus as corpus_lib
  from aft_jax.data.config import DataConfig

  data = {"data.tokenizer": "word", "data.data_dir": str(tmp_path / "data")}
  small = {"model.num_layers": 1, "model.d_model": 16, "model.num_heads": 2, "model.mlp_dim": 32}
  small.update({"model.max_len": 32, "model.window": 4, "seq_len": 32, "eval_batch_size": 32})
  flags = [f"--config.{k}={v}" for k, v in {**data, **small}.items()]
  before = listing(tmp_path)
  env = {"HOME": str(tmp_path / "home")}
  code, _, report, err = _dry_run(*flags, config=f"text:{docs}/*.py", env=env)
  assert code == dry_run.FITS and report is not None and report["fits"], err[-2000:]
  cfg = {"dataset": "text", "train_files": f"{docs}/*.py", "tokenizer": "word"}
  counted = corpus_lib.vocab_size(DataConfig(**cfg, data_dir=data["data.data_dir"]))[0]
  assert report["vocab_size"] == counted > 256
  assert listing(tmp_path) == before  # no data_dir, no $HOME, nothing beside the files
