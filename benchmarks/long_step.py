"""One real train step at a long T on this machine: the 2 x 128 LM of ``context_memory`` on
one CPU device, its step run twice (the first compiles), with the time of the second and the
process' peak memory.

    python -m benchmarks.long_step --mixing aft_simple --seq_len 524288   # one JSON line

``benchmarks.context_memory`` gives the compiled memory of the same step; this runs it, to
show that the figure holds (the peak resident memory includes jax, XLA and the inputs).
"""

from __future__ import annotations

import argparse
import json
import resource
import time


def run(mixing: str, seq_len: int, seed: int = 0) -> dict:
  """Two train steps of ``context_memory``'s model at T = ``seq_len``, batch 1, random bytes."""
  import jax
  import numpy as np

  from aft_jax import sharding
  from aft_jax.trainer import train_lib
  from aft_jax.trainer.run_config import RunConfig
  from benchmarks.context_memory import _config

  cfg = RunConfig.from_tree(_config(mixing, seq_len, 1)).with_vocab(256)
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  trainer = train_lib.Trainer(cfg, mesh)
  rng = np.random.default_rng(seed)
  batch = {
    name: rng.integers(0, 256, spec.shape).astype(spec.dtype)
    for name, spec in trainer.specs(cfg.train.batch_size).items()
  }
  state = trainer.init_state(seed)
  times = []
  for i in range(2):
    start = time.perf_counter()
    state, metrics = trainer.train_step(state, batch, jax.random.key(i))
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return {
    "mixing": mixing,
    "T": seq_len,
    "first_step_s": round(times[0], 1),  # compile + run
    "step_s": round(times[1], 2),
    "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1),
    "loss": float(metrics["loss"]),
    "finite": bool(metrics["finite"]),
  }


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--mixing", default="aft_simple", choices=("aft_simple", "aft_local"))
  p.add_argument("--seq_len", type=int, default=262144)
  args = p.parse_args(argv)
  print(json.dumps(run(args.mixing, args.seq_len)), flush=True)


if __name__ == "__main__":
  main()
