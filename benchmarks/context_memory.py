"""Context parallelism: the compiled per-device memory of one train step of a 2 x 128 LM with T
split over ``mesh.sequence`` CPU devices (compiled, not run), the table written into
RESULTS.md ("Context parallelism") and each row to the JSON as it is done (a run resumes);
``--step``: one real step of that model on one device, its time and peak memory.

    python -m benchmarks.context_memory   # benchmarks/results/context_memory.json, RESULTS.md
    python -m benchmarks.context_memory --step --mixing aft_simple --seq_len 524288  # one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_JSON = os.path.join(ROOT, "benchmarks", "results", "context_memory.json")
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
DEVICES = 8
MIXINGS = ("aft_simple", "aft_local")
ROWS = [(m, t, n) for m in MIXINGS for t in (65536, 262144) for n in (1, 2, 4, 8)]
ROWS += [(m, 1048576, 8) for m in MIXINGS]
START, END = "<!-- context_memory:start -->", "<!-- context_memory:end -->"


def _trainer(mixing: str, t_len: int, n: int):
  """The trainer of a 2 x 128 byte-level LM at T = ``t_len``, T split over ``n`` CPU devices."""
  import jax

  from aft_jax import sharding
  from aft_jax.trainer import train_lib
  from aft_jax.trainer.default_config import get_config
  from aft_jax.trainer.run_config import RunConfig

  c = get_config()
  c.data.tokenizer = "byte"
  m = c.model
  m.mixing, m.num_layers, m.d_model, m.mlp_dim, m.num_heads = mixing, 2, 128, 512, 4
  m.max_len, m.window, m.factor_dim, m.dropout_rate = t_len, 128, 64, 0.0
  c.seq_len, c.batch_size, c.eval_batch_size = t_len, 1, 1
  c.mesh.data, c.mesh.sequence = 1, n
  cfg = RunConfig.from_tree(c).with_vocab(256)
  return train_lib.Trainer(cfg, sharding.make_mesh(cfg.mesh, jax.devices()[:n]))


def row(mixing: str, t_len: int, n: int) -> dict:
  """One row: the train step of ``mixing`` at T = ``t_len`` compiled for ``n`` CPU devices."""
  from aft_jax.trainer.dry_run import StepMemory

  trainer = _trainer(mixing, t_len, n)
  start = time.perf_counter()
  mem = StepMemory.of(trainer.lower_train_step().compile())
  out = dict(mixing=mixing, T=t_len, sequence=n, temp=mem.temp, arguments=mem.argument)
  return dict(out, compile_s=round(time.perf_counter() - start, 1))


def step(mixing: str, seq_len: int, seed: int = 0) -> dict:
  """Two train steps at T = ``seq_len`` (batch 1): the second's time, peak RSS, the loss."""
  import jax
  import numpy as np

  trainer = _trainer(mixing, seq_len, 1)
  rng = np.random.default_rng(seed)
  specs = trainer.specs(trainer.config.train.batch_size).items()
  batch = {name: rng.integers(0, 256, spec.shape).astype(spec.dtype) for name, spec in specs}
  state, times = trainer.init_state(seed), []
  for i in range(2):
    start = time.perf_counter()
    state, metrics = trainer.train_step(state, batch, jax.random.key(i))
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  out = dict(mixing=mixing, T=seq_len, first_step_s=round(times[0], 1), step_s=round(times[1], 2))
  out.update(peak_rss_gib=round(rss, 1), loss=float(metrics["loss"]))
  return dict(out, finite=bool(metrics["finite"]))


def _gib(b) -> str:
  return f"{b / 2**30:.2f}" if isinstance(b, int) else "-"


def table(rows: list[dict]) -> str:
  """The markdown table of ``rows``: one line per (mixing, T), the temp memory per device (GiB)
  at each ``mesh.sequence`` with its ratio to sequence = 1, and the arguments per device."""
  counts = sorted({r["sequence"] for r in rows})
  keys = list(dict.fromkeys((r["mixing"], r["T"]) for r in rows))
  at = {(r["mixing"], r["T"], r["sequence"]): r for r in rows}
  out = ["| mixing | T | " + " | ".join(f"sequence = {n}" for n in counts) + " | arguments |"]
  out.append("|---|---:|" + "---:|" * (len(counts) + 1))
  for mixing, t_len in keys:
    one = at.get((mixing, t_len, 1), {}).get("temp")
    cells, args = [], []
    for n in counts:
      r = at.get((mixing, t_len, n))
      if r is None:
        cells.append("-")
      elif "error" in r:
        cells.append(r["error"])
      else:
        ratio = f" ({r['temp'] / one:.2f}x)" if one and n != 1 else ""
        cells.append(f"{_gib(r['temp'])}{ratio}")
        args.append(_gib(r["arguments"]))
    arg = " / ".join(dict.fromkeys(args)) or "-"
    out.append(f"| {mixing} | {t_len:,} | {' | '.join(cells)} | {arg} |")
  return "\n".join(out)


def write_results(rows: list[dict]) -> None:
  """The table into RESULTS.md between the markers, after the section's prose."""
  from aft_jax import files

  head, rest = open(RESULTS).read().split(START)
  prose, tail = rest.split(END)
  prose = prose.split("\n| mixing |")[0]
  files.atomic_write(RESULTS, f"{head}{START}{prose}\n{table(rows)}\n{END}{tail}")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--step", action="store_true", help="one real step on one device instead")
  p.add_argument("--mixing", default="aft_simple", choices=MIXINGS)
  p.add_argument("--seq_len", type=int, default=262144)
  a = p.parse_args(argv)
  if a.step:
    print(json.dumps(step(a.mixing, a.seq_len)), flush=True)
    return
  import jax

  from aft_jax import files

  if jax.device_count() < DEVICES:
    sys.exit(f"context_memory: needs {DEVICES} CPU devices; run it as a module (it sets them)")
  rows = json.load(open(OUT_JSON)) if os.path.exists(OUT_JSON) else []
  done = {(r["mixing"], r["T"], r["sequence"]) for r in rows}
  for mixing, t_len, n in ROWS:
    if (mixing, t_len, n) in done:
      continue
    try:
      r = row(mixing, t_len, n)
    except Exception as e:  # noqa: BLE001 (a row that does not compile is a row of the table)
      r = {"mixing": mixing, "T": t_len, "sequence": n, "error": f"error({type(e).__name__})"}
    print(json.dumps(r), flush=True)
    rows.append(r)
    files.atomic_write_json(OUT_JSON, rows, indent=1)
  order = {key: i for i, key in enumerate(ROWS)}
  rows.sort(key=lambda r: order.get((r["mixing"], r["T"], r["sequence"]), len(order)))
  write_results(rows)


if __name__ == "__main__":
  # The device count is fixed when jax's CPU backend starts: before the first jax import.
  flag = f"--xla_force_host_platform_device_count={DEVICES}"
  if flag not in os.environ.get("XLA_FLAGS", "") and "--step" not in sys.argv:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " " + flag
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  main()
