"""Generation at 1k to 64k tokens, CPU: per-token time and peak memory of a stream (AFT-simple,
AFT-conv1d without positions) against sliding re-encoding (AFT-local, max_len 256) and a
softmax KV cache as long as the text, each row in a fresh process (docs/benchmarks.md;
RESULTS.md, "Streams").

    python -m benchmarks.stream_generation --out benchmarks/results     # ~10 processes
    python -m benchmarks.stream_generation --quick --out /tmp/sg        # seconds
"""

from __future__ import annotations

import functools
import json
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax import decode
from aft_jax.model import ModelConfig, TransformerLM
from benchmarks import common

LENGTHS, QUICK_LENGTHS = (1024, 4096, 16384, 65536), (64, 256)
STREAMS, SLIDING_MAX_LEN, TEMPERATURE = ("aft_simple", "aft_conv1d"), 256, 0.8


def model_config(row: str, length: int, quick: bool) -> ModelConfig:
  size = (1, 16, 32, 2) if quick else (2, 128, 384, 4)
  common_kw = dict(zip(("num_layers", "d_model", "mlp_dim", "num_heads"), size))
  common_kw.update(vocab_size=256, dropout_rate=0.0)
  if row in STREAMS:
    return ModelConfig(mixing=row, position_embedding="none", max_len=64, **common_kw)
  if row == "sliding":
    max_len = 32 if quick else SLIDING_MAX_LEN
    return ModelConfig(mixing="aft_local", max_len=max_len, window=max_len // 8, **common_kw)
  return ModelConfig(mixing="softmax", max_len=length, **common_kw)  # "softmax"


def _setup(cfg: ModelConfig):  # the model and its initial parameters
  model = TransformerLM(cfg.validate())
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
  return model, params


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _peak_rss() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def measure_stream(row: str, lengths, window: int, piece: int, quick: bool) -> list[dict]:
  """The stream to max(lengths), its RSS read at each length, then timed in rounds."""
  model, params = _setup(model_config(row, 0, quick))
  gen = functools.partial(decode.generate, model, params, temperature=TEMPERATURE)
  empty = np.zeros((1, 0), np.int32)
  _, stream = gen(np.asarray([[10]], np.int32), 1, rng=jax.random.key(0), return_stream=True)
  records, at = [], {}
  for length in lengths:
    _, stream = gen(empty, length - stream.position, stream=stream, return_stream=True)
    at[length] = stream  # generate leaves a stream it continues as it is
    rec = dict(row=row, length=length, peak_rss=_peak_rss(), state_bytes=_nbytes(stream.cache))
    records.append(rec)
    print(json.dumps(rec), flush=True)
  times = {n: [] for n in lengths}
  for _ in range(window // piece):
    for n in lengths:
      times[n] += common.wall_times(lambda _: gen(empty, piece, stream=at[n]), 1)
  for rec in records:
    rec["per_token_s"] = statistics.median(times[rec["length"]]) / piece
  return records


def measure_sliding(length: int, window: int, piece: int, quick: bool) -> dict:
  model, params = _setup(model_config("sliding", length, quick))
  prompt = np.random.default_rng(0).integers(0, 256, (1, length - window), dtype=np.int32)
  gen = functools.partial(decode.generate, model, params, temperature=TEMPERATURE)
  gen(prompt[:, -model.cfg.max_len - 1 :], 2, rng=jax.random.key(0))  # compiles
  times = common.wall_times(lambda i: gen(prompt, piece, rng=jax.random.key(i)), window // piece)
  per_token = statistics.median(times) / piece
  return dict(row="sliding", length=length, per_token_s=per_token, peak_rss=_peak_rss(),
              state_bytes=None)  # fmt: skip


def measure_kv_cache(length: int, window: int, piece: int, quick: bool) -> dict:
  model, params = _setup(model_config("softmax", length, quick))
  cache = decode.init_cache(model, 1)
  filled = length - window
  at = lambda path, x: jnp.full_like(x, filled) if path[-1].key in ("pos", "index") else x
  cache = jax.tree_util.tree_map_with_path(at, cache)

  @functools.partial(jax.jit, donate_argnums=(1,))
  def step(params, cache, tok_B, rng):
    logp_B1V, mutated = model.apply(
      {"params": params, "cache": cache}, tok_B[:, None], decode=True, mutable=["cache"]
    )
    rng, sub = jax.random.split(rng)
    return mutated["cache"], decode.sample_logits(sub, logp_B1V[:, 0], TEMPERATURE), rng

  carry = [cache, jnp.zeros((1,), jnp.int32), jax.random.key(0)]

  def one_piece(_):
    for _ in range(piece):
      carry[:] = step(params, *carry)
      carry[1] = jnp.asarray(np.asarray(carry[1]))  # on the host, as generate has it

  times = common.wall_times(one_piece, window // piece)
  times = times[1:] or times  # the first piece compiled the step
  per_token = statistics.median(times) / piece
  return dict(row="softmax", length=length, per_token_s=per_token, peak_rss=_peak_rss(),
              state_bytes=_nbytes(carry[0]))  # fmt: skip


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
  lines = []

  def table(title, key, text):
    lines.extend([title, "", f"| generation | {head} | L = {lengths[-1]:,} / L = {lengths[0]:,} |",
                  "|---|" + "---:|" * (len(lengths) + 1)])  # fmt: skip
    for row in LABELS:
      cells = [by[row, n] if by.get((row, n), {}).get(key) else None for n in lengths]
      first, last = cells[0], cells[-1]
      ratio = f"{last[key] / first[key]:.2f}x" if first and last else "-"
      cells = ["-" if c is None else text(c) for c in cells]
      lines.append(f"| {LABELS[row]} | " + " | ".join(cells) + f" | {ratio} |")

  table(f"**Per-token time** (the median over pieces of {result['piece']} tokens, "
        f"{result['window']} tokens per length: a stream's continuing the state it kept at L, "
        "the others' the last tokens before L)", "per_token_s",
        lambda c: common.fmt_time(c["per_token_s"]))  # fmt: skip
  lines.append("")
  state = lambda c: f" ({common.fmt_bytes(c['state_bytes'])})" if c.get("state_bytes") else ""
  table("**Peak memory** (the process's resident-set high-water mark; in brackets the decoding "
        "state carried from token to token)", "peak_rss",
        lambda c: common.fmt_bytes(c["peak_rss"]) + state(c))  # fmt: skip
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  p = common.parser(__doc__, "a tiny model and short texts (seconds)")
  p.add_argument("--row", choices=tuple(LABELS), help="one row, in this process (the driver's)")
  p.add_argument("--lengths", type=int, nargs="+")
  p.add_argument("--window", type=int, help="tokens timed before each L (default 512; quick 32)")
  p.add_argument("--piece", type=int, help="tokens per timed piece (default 64; quick 8)")
  a = p.parse_args(argv)
  a.lengths = a.lengths or (QUICK_LENGTHS if a.quick else LENGTHS)
  a.window, a.piece = a.window or (32 if a.quick else 512), a.piece or (8 if a.quick else 64)
  if a.row is not None:
    records = _row(a)
    common.emit(records)
    return {"records": records}
  start, info = time.perf_counter(), common.machine_info()
  result = dict(machine=info, quick=a.quick, lengths=list(a.lengths), window=a.window)
  result.update(piece=a.piece, temperature=TEMPERATURE, records=[])
  jobs = [(row, a.lengths) for row in STREAMS]
  jobs += [(row, [n]) for row in ("sliding", "softmax") for n in a.lengths]
  for row, lengths in jobs:
    args = ["--row", row, "--lengths", *lengths, "--window", a.window, "--piece", a.piece]
    args += ["--quick"] * a.quick
    print("--- benchmarks.stream_generation", *args, flush=True)
    got = common.child("benchmarks.stream_generation", args)
    if isinstance(got, dict):  # the child failed
      result["records"] += [{"row": row, "length": n, common.ERROR: got["reason"]} for n in lengths]
      print(got["reason"], flush=True)
    else:
      result["records"] += got
    common.write_outputs(a.out, "stream_generation", result, to_markdown(result))
  info["wall_s"] = time.perf_counter() - start
  common.write_outputs(a.out, "stream_generation", result, to_markdown(result), partial=False)
  return result


if __name__ == "__main__":
  main()
