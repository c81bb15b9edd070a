"""Every config file loads and validates; invalid values fail before anything is compiled."""

import glob
import os

import ml_collections
import pytest
import importlib.util

from aft_jax.trainer import checkpointing, default_config, run_config
from aft_jax.trainer.run_config import RunConfig
from aft_jax.model import MIXINGS
from tests.support.helpers import ROOT

# Recipes whose get_config takes the variant as its argument (file.py:arg).
PER_MIXING = {
  "wikitext103.py": MIXINGS,
  "enwik8.py": MIXINGS + tuple(f"{m},12x512" for m in MIXINGS),
}
CONFIGS = [
  (os.path.basename(path), arg)
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "[!_]*.py")))
  for arg in PER_MIXING.get(os.path.basename(path), (None,))
]


def load(name, arg=None):
  path = os.path.join(ROOT, "configs", name)
  spec = importlib.util.spec_from_file_location(name[:-3], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config() if arg is None else mod.get_config(arg)


def test_there_are_configs_for_every_mixing_layer():
  assert ("quickstart.py", None) in CONFIGS
  for mixing in MIXINGS:
    assert ("wikitext103.py", mixing) in CONFIGS
  with pytest.raises(ValueError, match="'linear' is not one of"):
    load("wikitext103.py", "linear")
  for bad in ("linear", "aft_local,12x256"):
    with pytest.raises(ValueError, match="configs/enwik8.py:<mixing>"):
      load("enwik8.py", bad)


@pytest.mark.parametrize("name, arg", CONFIGS, ids=[f"{n}:{a}" if a else n for n, a in CONFIGS])
def test_config_loads_and_validates(name, arg):
  config = load(name, arg)
  vocab = 267_735 if config.data.dataset == "wikitext103" else 256
  cfg = RunConfig.from_tree(config).with_vocab(vocab).model
  assert cfg.mixing == config.model.mixing
  if config.data.dataset == "wikitext103":
    assert (cfg.num_layers, cfg.d_model, config.seq_len) == (16, 128, 256)
    assert cfg.adaptive_cutoffs == (20000, 40000, 200000)
    assert config.final_eval_stride == 1  # the small setting's sliding-window protocol
  if config.data.dataset == "enwik8":
    size = (12, 512) if arg.endswith(",12x512") else (24, 256)
    assert (cfg.num_layers, cfg.d_model, config.seq_len, config.batch_size) == (*size, 1024, 128)
    assert (cfg.window, cfg.factor_dim, cfg.mlp_dim) == (32, 256, 4 * cfg.d_model)


def _quick():
  return load("quickstart.py")


SOFTMAX = {"model.mixing": "softmax"}


@pytest.mark.parametrize(
  "values, message",
  [
    ({"model.window": 1000}, "config.model.window = 1000 must be in \\[1, config.model.max_len"),
    (
      {**SOFTMAX, "model.num_heads": 3},
      "d_model = 128 is not divisible by config.model.num_heads = 3",
    ),
    ({"model.mixing": "linear"}, "mixing = 'linear' is not one of"),
    ({"seq_len": 512}, "seq_len = 512 exceeds config.model.max_len = 64"),
    ({"batch_size": 0}, "batch_size = 0 must be >= 1"),
    ({"learning_rate": float("nan")}, "learning_rate = nan must be > 0"),
    ({"weight_decay": float("nan")}, "weight_decay = nan must be >= 0"),
    ({"sample.temperature": float("nan")}, "temperature = nan must be >="),
    ({"nonfinite": "ignore"}, "nonfinite = 'ignore'"),
    # A negative clip norm flips the gradient: training by gradient ascent.
    ({"grad_clip_norm": -1.0}, "grad_clip_norm = -1.0 must be > 0"),
    ({"b1": 5.0}, "b1 = 5.0 must be in \\[0, 1\\)"),
    ({"b2": 1.0}, "b2 = 1.0 must be in \\[0, 1\\)"),
    ({"weight_decay": -0.1}, "weight_decay = -0.1 must be >= 0"),
    ({"seed": -1}, "seed = -1 must be in \\[0, 2\\*\\*31 - 1\\)"),
    ({"model.dtype": "float16"}, "dtype = 'float16': use 'float32' or"),
    (
      {**SOFTMAX, "model.impl": "pallas"},
      "impl = 'pallas': softmax attention takes impl 'auto' | 'xla' | 'cudnn'",
    ),
    (
      {**SOFTMAX, "model.impl": "cudnn"},
      "impl = 'cudnn': cuDNN flash attention needs dtype bfloat16 or float16, not float32",
    ),
    ({"model.impl": "cudnn"}, "impl = 'cudnn' is not one of .* for aft_"),
    ({"sample.top_k": -1}, "sample.top_k = -1 must be >= 0"),
    ({"sample.temperature": -1.0}, "sample.temperature = -1.0 must be >= 0"),
    ({"max_consecutive_skips": -1}, "max_consecutive_skips = -1 must be"),
    ({"final_eval_stride": 129}, "final_eval_stride = 129 must be in"),
    ({"data.dataset": "enwik9"}, "'enwik9' is not one of"),
    ({"data.dataset": "enwik8", "data.tokenizer": "word"}, "enwik8 is bytes"),
  ],
)
def test_invalid_values_fail_with_a_message(values, message):
  with pytest.raises(ValueError, match=message):
    RunConfig.from_tree(default_config.override(_quick(), values))


def test_unknown_keys_and_wrong_types_fail():
  d = _quick().to_dict()  # (a ConfigDict itself refuses a str for an int field)
  d["learning_rte"] = 0.1
  d["model"]["num_layers"] = "two"
  d["model"]["nosuch"] = 1
  config = ml_collections.ConfigDict(d)
  with pytest.raises(ValueError) as err:
    RunConfig.from_tree(config)
  # The whole key, and the known keys closest to it (none is close to 'nosuch').
  assert "unknown config key 'learning_rte'; did you mean 'learning_rate'?" in str(err.value)
  assert "unknown config key 'model.nosuch';" in str(err.value)
  assert "config.model.num_layers = 'two' should be a int" in str(err.value)
  # A misplaced key: the place it belongs.
  assert run_config.unknown_keys(["model.learning_rate", "model", "data.packed"]) == [
    "unknown config key 'model.learning_rate'; did you mean 'learning_rate'?",
    "unknown config key 'data.packed'; did you mean 'data.packing'?",
  ]


def test_resume_conflicts_ignore_only_harmless_keys():
  a = _quick().to_dict()
  b = _quick()
  b.log_every_steps = 1
  b.max_consecutive_skips = 0
  assert checkpointing.resume_conflicts(a, b.to_dict()) == []
  b.model.d_model = 64
  b.seed = 3
  conflicts = checkpointing.resume_conflicts(a, b.to_dict())
  assert any(c.startswith("model.d_model: 128") for c in conflicts)
  assert any(c.startswith("seed: 0") for c in conflicts)
  # A new num_train_steps would restart the cosine decay from another length.
  b = _quick()
  b.num_train_steps = 5000
  assert checkpointing.resume_conflicts(a, b.to_dict()) == [
    "num_train_steps: 1000 in the workdir, 5000 now (the learning-rate schedule is built from it)"
  ]


def test_a_key_added_since_the_workdir_was_written_compares_as_its_old_value(tmp_path):
  """A workdir written before a key existed ran with the value its version used
  (run_config.as_written), not today's default: resuming it at the old value is no conflict,
  at the default the refusal names the flag that resumes it as written."""
  from aft_jax.trainer.run_config import as_written

  saved = _quick().to_dict()
  del saved["model"]["init"], saved["mesh"]["sequence"]  # written before bdcc2f1 and 2bacbb7
  as_then = _quick()
  as_then.model.init = "glorot"
  check = checkpointing.check_resume_config
  check(saved, as_then.to_dict(), tmp_path, False, as_written)
  with pytest.raises(ValueError) as refused:
    check(saved, _quick().to_dict(), tmp_path, False, as_written)
  assert str(refused.value).startswith(
    f"workdir {tmp_path} holds a run with a different config (model.init: 'glorot' in the "
    "workdir, 'gpt2' now; compared with the checkpoint); it was written before model.init "
    "existed, by a version that ran as --config.model.init=glorot: pass that to resume the run "
    "as it was written; use another --workdir"
  )
  assert checkpointing.resume_conflicts(saved, _quick().to_dict()) == [
    "model.init: None in the workdir, 'gpt2' now"
  ]
