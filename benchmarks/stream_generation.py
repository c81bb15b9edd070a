"""Generation at 1k to 64k tokens: a stream against sliding re-encoding and a KV cache, CPU.

Per-token time and peak memory of ``aft_jax.decode.generate`` (what ``aft-generate`` runs: one
decoding step and one sample per token, the token back on the host) for the quickstart's model
size (2 layers, d 128, MLP 384, bytes; parameters at their initialisation: time and memory do
not depend on their values), batch 1, temperature 0.8, at text lengths L:

- **stream, AFT-simple / AFT-conv1d** (``position_embedding = 'none'``): one process generates
  the real 64k tokens from a one-token prompt, in pieces that continue the ``Stream``; on
  reaching each L (1k, 4k, 16k, 64k) it reads its resident-set high-water mark
  (``resource.getrusage``: memory that grew anywhere on the way shows there) and keeps the
  stream there. Then it times pieces of ``piece`` tokens continuing each kept stream, in rounds
  over the lengths (a change in the machine's load reaches every length alike), ``window``
  tokens per length: the median piece per token.
- **sliding re-encoding, AFT-local, max_len 256** (learned positions; the quickstart's mixing):
  past max_len each token is one forward pass over the last 256 tokens, whatever L is. A prompt
  of L - window tokens (random ids: their values do not change the work) starts the sliding
  phase at once; the window's tokens are timed.
- **softmax attention with a KV cache as long as the text** (learned positions, max_len = L):
  the cache of L positions, its index set to L - window (each step attends over all L slots
  under a mask, so the filled part's contents do not change the work), then the window's real
  steps (``model.apply(decode=True)`` and the sample, as ``generate`` does them).

Each row runs in a fresh process (``--row``), so each high-water mark is its own; the JSON keeps
the decoding state's bytes too (the arrays carried from one token to the next).

    python -m benchmarks.stream_generation --out benchmarks/results     # ~10 processes
    python -m benchmarks.stream_generation --quick --out /tmp/sg        # seconds

Writes ``stream_generation.json`` (machine, settings, every record) and ``stream_generation.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax import decode
from aft_jax.model import ModelConfig, TransformerLM
from benchmarks import common

LENGTHS = (1024, 4096, 16384, 65536)
QUICK_LENGTHS = (64, 256)
STREAMS = ("aft_simple", "aft_conv1d")
SLIDING_MAX_LEN = 256
TEMPERATURE = 0.8


def model_config(row: str, length: int, quick: bool) -> ModelConfig:
  size = (
    dict(num_layers=1, d_model=16, mlp_dim=32, num_heads=2)
    if quick
    else dict(num_layers=2, d_model=128, mlp_dim=384, num_heads=4)
  )
  common_kw = dict(vocab_size=256, dropout_rate=0.0, **size)
  if row in STREAMS:
    return ModelConfig(mixing=row, position_embedding="none", max_len=64, **common_kw)
  if row == "sliding":
    max_len = 32 if quick else SLIDING_MAX_LEN
    return ModelConfig(mixing="aft_local", max_len=max_len, window=max_len // 8, **common_kw)
  return ModelConfig(mixing="softmax", max_len=length, **common_kw)  # "softmax"


def _setup(cfg: ModelConfig):
  model = TransformerLM(cfg.validate())
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
  return model, params


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _peak_rss() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _median_per_token(times: list[float], piece: int) -> float:
  return statistics.median(times) / piece


def measure_stream(row: str, lengths, window: int, piece: int, quick: bool) -> list[dict]:
  """The real stream to max(lengths); a record at each length (module doc)."""
  model, params = _setup(model_config(row, 0, quick))
  gen = functools.partial(decode.generate, model, params, temperature=TEMPERATURE)
  empty = np.zeros((1, 0), np.int32)
  _, stream = gen(np.asarray([[10]], np.int32), 1, rng=jax.random.key(0), return_stream=True)
  records, at = [], {}
  for length in lengths:
    _, stream = gen(empty, length - stream.position, stream=stream, return_stream=True)
    at[length] = stream  # generate leaves a stream it continues as it is
    records.append(
      dict(row=row, length=length, peak_rss=_peak_rss(), state_bytes=_nbytes(stream.cache))
    )
    print(json.dumps(records[-1]), flush=True)
  # The time per token at each length: pieces continuing the stream from there, taken in
  # rounds over the lengths, so that a change in the machine's load reaches every length alike.
  times = {n: [] for n in lengths}
  for _ in range(window // piece):
    for n in lengths:
      start = time.perf_counter()
      gen(empty, piece, stream=at[n])
      times[n].append(time.perf_counter() - start)
  for rec in records:
    rec["per_token_s"] = _median_per_token(times[rec["length"]], piece)
  return records


def measure_sliding(length: int, window: int, piece: int, quick: bool) -> dict:
  model, params = _setup(model_config("sliding", length, quick))
  prompt = np.random.default_rng(0).integers(0, 256, (1, length - window), dtype=np.int32)
  gen = functools.partial(decode.generate, model, params, temperature=TEMPERATURE)
  gen(prompt[:, -model.cfg.max_len - 1 :], 2, rng=jax.random.key(0))  # compiles
  times = []
  for i in range(window // piece):
    start = time.perf_counter()
    gen(prompt, piece, rng=jax.random.key(i))
    times.append(time.perf_counter() - start)
  return dict(
    row="sliding",
    length=length,
    per_token_s=_median_per_token(times, piece),
    peak_rss=_peak_rss(),
    state_bytes=None,
  )


def measure_kv_cache(length: int, window: int, piece: int, quick: bool) -> dict:
  model, params = _setup(model_config("softmax", length, quick))
  cache = decode.init_cache(model, 1)
  filled = length - window
  at = lambda path, x: jnp.full_like(x, filled) if path[-1].key in ("pos", "index") else x  # noqa: E731
  cache = jax.tree_util.tree_map_with_path(at, cache)

  @functools.partial(jax.jit, donate_argnums=(1,))
  def step(params, cache, tok_B, rng):
    logp_B1V, mutated = model.apply(
      {"params": params, "cache": cache}, tok_B[:, None], decode=True, mutable=["cache"]
    )
    rng, sub = jax.random.split(rng)
    return mutated["cache"], decode.sample_logits(sub, logp_B1V[:, 0], TEMPERATURE), rng

  tok, rng = jnp.zeros((1,), jnp.int32), jax.random.key(0)
  times = []
  for _ in range(window // piece):
    start = time.perf_counter()
    for _ in range(piece):
      cache, tok, rng = step(params, cache, tok, rng)
      tok = jnp.asarray(np.asarray(tok))  # on the host, as generate has it
    times.append(time.perf_counter() - start)
  times = times[1:] or times  # the first piece compiled the step
  return dict(
    row="softmax",
    length=length,
    per_token_s=_median_per_token(times, piece),
    peak_rss=_peak_rss(),
    state_bytes=_nbytes(cache),
  )


def _row(args) -> list[dict]:
  if args.row in STREAMS:
    return measure_stream(args.row, args.lengths, args.window, args.piece, args.quick)
  (length,) = args.lengths
  fn = measure_sliding if args.row == "sliding" else measure_kv_cache
  return [fn(length, args.window, args.piece, args.quick)]


LABELS = {
  "aft_simple": "stream, AFT-simple",
  "aft_conv1d": "stream, AFT-conv1d",
  "sliding": f"sliding re-encoding, AFT-local (max_len {SLIDING_MAX_LEN})",
  "softmax": "softmax, KV cache of L",
}


def to_markdown(result: dict) -> str:
  lengths = result["lengths"]
  by = {(r["row"], r["length"]): r for r in result["records"]}
  head = " | ".join(f"L = {n:,}" for n in lengths)
  lines = [
    f"**Per-token time** (the median over pieces of {result['piece']} tokens, {result['window']}"
    " tokens per length: a stream's continuing the state it kept at L, the others' the last "
    "tokens before L)",
    "",
    f"| generation | {head} | L = {lengths[-1]:,} / L = {lengths[0]:,} |",
    "|---|" + "---:|" * (len(lengths) + 1),
  ]

  def table(key, fmt):
    for row in LABELS:
      cells = [by.get((row, n), {}).get(key) for n in lengths]
      first, last = cells[0], cells[-1]
      ratio = f"{last / first:.2f}x" if first and last else "-"
      lines.append(f"| {LABELS[row]} | " + " | ".join(fmt(c) for c in cells) + f" | {ratio} |")

  table("per_token_s", common.fmt_time)
  lines += [
    "",
    "**Peak memory** (the process's resident-set high-water mark; in brackets the decoding "
    "state carried from token to token)",
    "",
    f"| generation | {head} | L = {lengths[-1]:,} / L = {lengths[0]:,} |",
    "|---|" + "---:|" * (len(lengths) + 1),
  ]
  for row in LABELS:
    cells = [by.get((row, n)) for n in lengths]
    cells = [c if c and "peak_rss" in c else None for c in cells]
    text = [
      "-"
      if c is None
      else common.fmt_bytes(c["peak_rss"])
      + (f" ({common.fmt_bytes(c['state_bytes'])})" if c.get("state_bytes") else "")
      for c in cells
    ]
    first, last = cells[0], cells[-1]
    ratio = f"{last['peak_rss'] / first['peak_rss']:.2f}x" if first and last else "-"
    lines.append(f"| {LABELS[row]} | " + " | ".join(text) + f" | {ratio} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="benchmarks/results")
  p.add_argument("--quick", action="store_true", help="a tiny model and short texts (seconds)")
  p.add_argument("--row", choices=tuple(LABELS), help="one row, in this process (the driver's)")
  p.add_argument("--lengths", type=int, nargs="+")
  p.add_argument("--window", type=int, help="tokens timed before each L (default 512; quick 32)")
  p.add_argument("--piece", type=int, help="tokens per timed piece (default 64; quick 8)")
  a = p.parse_args(argv)
  a.lengths = a.lengths or (QUICK_LENGTHS if a.quick else LENGTHS)
  a.window = a.window or (32 if a.quick else 512)
  a.piece = a.piece or (8 if a.quick else 64)
  if a.row is not None:
    records = _row(a)
    print("RECORDS " + json.dumps(records), flush=True)
    return {"records": records}
  start = time.perf_counter()
  info = common.machine_info()
  result = {
    "machine": info,
    "quick": a.quick,
    "lengths": list(a.lengths),
    "window": a.window,
    "piece": a.piece,
    "temperature": TEMPERATURE,
    "records": [],
  }
  jobs = [(row, a.lengths) for row in STREAMS]
  jobs += [(row, [n]) for row in ("sliding", "softmax") for n in a.lengths]
  for row, lengths in jobs:
    cmd = [sys.executable, "-m", "benchmarks.stream_generation", "--row", row]
    cmd += ["--lengths", *map(str, lengths), "--window", str(a.window), "--piece", str(a.piece)]
    cmd += ["--quick"] * a.quick
    print("---", " ".join(cmd[2:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RECORDS ")]
    if proc.returncode or not lines:
      rec = [{"row": row, "length": n, common.ERROR: proc.stderr[-2000:]} for n in lengths]
      result["records"] += rec
      print(proc.stderr[-2000:], flush=True)
    else:
      result["records"] += json.loads(lines[-1][len("RECORDS ") :])
    common.write_outputs(a.out, "stream_generation", result, to_markdown(result))
  info["wall_s"] = time.perf_counter() - start
  common.write_outputs(a.out, "stream_generation", result, to_markdown(result), partial=False)
  return result


if __name__ == "__main__":
  main()
