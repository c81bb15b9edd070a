"""The AFT paper's quality comparison at CPU scale: every mixing layer trained alike through the
real trainer on pydoc bytes, with validation bits per byte, curves, parameters and speed
(docs/benchmarks.md; RESULTS.md, "Model quality").

    python -m benchmarks.quality --out benchmarks/results       # ~4 min on 2 idle CPU cores
    python -m benchmarks.quality --quick --out /tmp/quality     # seconds: tests run this
"""

from __future__ import annotations

import math
import os
import tempfile
import time

import numpy as np

from aft_jax.trainer.default_config import get_config, override
from aft_jax.model import MIXINGS
from aft_jax.workdir import Workdir
from benchmarks import common

# The paper's order (Table 4: Transformer, AFT-local-32, AFT-simple), then the others.
ORDER = ("softmax", "aft_local", "aft_simple", "aft_full", "aft_conv1d", "aft_decay")
assert sorted(ORDER) == sorted(MIXINGS)


def settings(quick: bool) -> dict:
  """One model and schedule for every mixing (dotted keys): the quickstart's, window 32."""
  if quick:
    return {"model.num_layers": 1, "model.d_model": 16, "model.num_heads": 2, "model.mlp_dim": 32,
            "model.max_len": 16, "model.window": 4, "model.kernel_size": 4, "seq_len": 16,
            "batch_size": 4, "num_train_steps": 4, "warmup_steps": 1, "log_every_steps": 2,
            "eval_every_steps": 2, "eval_batch_size": 256}  # fmt: skip
  return {"model.num_layers": 2, "model.d_model": 128, "model.num_heads": 4, "model.mlp_dim": 384,
          "model.max_len": 128, "model.window": 32, "model.kernel_size": 32, "seq_len": 128,
          "batch_size": 16, "num_train_steps": 600, "warmup_steps": 50, "log_every_steps": 50,
          "eval_every_steps": 100, "eval_batch_size": 64}  # fmt: skip


def make_config(mixing: str, overrides: dict, seed: int):
  config = get_config()
  config.data.dataset, config.data.tokenizer = "pydoc", "byte"
  config.model.mixing = mixing
  config.model.dropout_rate = 0.0
  config.learning_rate = 3e-3
  config.seed = seed
  return override(config, overrides)


def run_one(mixing: str, overrides: dict, seed: int, workdir: str) -> dict:
  """Trains one mixing layer in ``workdir``; its record with the validation curve."""
  results, wall = common.train(make_config(mixing, overrides, seed), workdir)
  records = Workdir(workdir).read_metrics()
  # The first logged interval includes compilation: tokens/s is the median of the others.
  speeds = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][1:]
  # Validation records during training, then the final one (write_results logs it too).
  curve = [(r["step"], r["valid_loss"] / math.log(2)) for r in records if "valid_loss" in r]
  curve = [c for c in curve if c[0] != results["steps"]]
  curve.append((results["steps"], results["valid_bpb"]))
  rec = {"mixing": mixing, **{k: results[k] for k in ("valid_bpb", "test_bpb", "num_params")}}
  rec.update(tokens_per_s=float(np.median(speeds)) if speeds else None, wall_s=wall)
  rec.update({k: results[k] for k in ("steps", "tokens_seen", "eval_protocol")})
  return dict(rec, curve=curve)


def to_markdown(result: dict) -> str:
  s = result["settings"]
  base = {r["mixing"]: r for r in result["records"]}["softmax"]["valid_bpb"]
  lines = [
    f"**Validation bits per byte on pydoc** ({s['model.num_layers']} layers, d "
    f"{s['model.d_model']}, T {s['seq_len']}, batch {s['batch_size']}, "
    f"{s['num_train_steps']} steps, seed {result['seed']}; exact over the whole validation "
    "split, disjoint windows)",
    "",
    "| mixing | valid bpb | vs softmax | test bpb | parameters | train tokens/s | wall time |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in result["records"]:
    speed = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
    lines.append(
      f"| {r['mixing']} | {r['valid_bpb']:.4f} | {r['valid_bpb'] - base:+.4f} | "
      f"{r['test_bpb']:.4f} | {r['num_params']:,} | {speed} | {common.fmt_time(r['wall_s'])} |"
    )
  return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for r in result["records"]:
    steps, bpb = zip(*r["curve"])
    ax.plot(steps, bpb, marker="o", markersize=3, label=f"{r['mixing']} ({r['valid_bpb']:.3f})")
  ax.set(xlabel="training step", ylabel="validation bits per byte")
  ax.set_title("pydoc bytes: validation curves, same model size and schedule")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  p = common.parser(__doc__, "tiny model and 4 steps (seconds)")
  p.add_argument("--mixings", nargs="+", default=list(ORDER), choices=ORDER)
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args(argv)
  start, info = time.perf_counter(), common.machine_info()
  overrides, records = settings(a.quick), []
  with tempfile.TemporaryDirectory() as tmp:
    for mixing in a.mixings:
      print(f"--- {mixing}", flush=True)
      records.append(run_one(mixing, overrides, a.seed, os.path.join(tmp, mixing)))
  info["wall_s"] = time.perf_counter() - start
  result = dict(machine=info, settings=overrides, seed=a.seed, quick=a.quick, records=records)
  md = to_markdown(result) if "softmax" in a.mixings else ""
  common.write_outputs(a.out, "quality", result, md, lambda path: plot(result, path))
  return result


if __name__ == "__main__":
  main()
