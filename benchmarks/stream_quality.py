"""What a position embedding is worth, and what a stream gives past its training length, CPU:
the quickstart recipe with and without positions, scored on texts of 1x, 4x and 16x the training
length from their start (docs/training.md, "Streams"; RESULTS.md, "Streams").

    python -m benchmarks.stream_quality --out benchmarks/results     # ~6 quickstart runs
    python -m benchmarks.stream_quality --quick --out /tmp/sq        # seconds
"""

from __future__ import annotations

import math
import os
import tempfile
import time

import jax
import numpy as np

from aft_jax import data as data_lib
from aft_jax.tools import evaluate, trained
from aft_jax.trainer import recipes
from aft_jax.trainer.default_config import override
from benchmarks import common, quality

# (mixing, position embedding): the streams beside the same layers with learned positions, then
# the references.
ROWS = [(m, p) for m in ("aft_simple", "aft_conv1d") for p in ("learned", "none")]
ROWS += [("softmax", "learned"), ("aft_local", "learned")]
MULTIPLES = (1, 4, 16)  # text lengths, in training lengths
QUICK = quality.settings(quick=True)  # a tiny model, 4 steps


def make_config(mixing: str, positions: str, quick: bool):
  """The quickstart recipe with ``mixing`` and ``positions`` (shrunk: ``quick``)."""
  config = recipes.load("quickstart")
  config.model.mixing = mixing
  config.model.position_embedding = positions
  return override(config, QUICK if quick else {})


def _nll_of_texts(run, tokens: np.ndarray, length: int, batch: int = 8) -> np.ndarray:
  """NLL ``[texts, length]`` of ``tokens`` cut into texts, each scored from its start (bos)."""
  n = len(tokens) // length
  texts = np.asarray(tokens[: n * length], np.int32).reshape(n, length)
  inputs = np.concatenate([np.full((n, 1), run.bos_id, np.int32), texts[:, :-1]], axis=1)
  apply = jax.jit(lambda p, x, y: run.model.apply({"params": p}, x, y))
  out = [apply(run.params, inputs[i : i + batch], texts[i : i + batch]) for i in range(0, n, batch)]
  return np.concatenate(out).astype(np.float64)


def run_one(mixing: str, positions: str, quick: bool, workdir: str) -> dict:
  results, wall = common.train(make_config(mixing, positions, quick), workdir)
  run = trained.load_run(workdir)
  seq_len = run.config.train.seq_len
  valid = data_lib.load_corpus(run.config.data).splits["validation"]
  rec = dict(mixing=mixing, position_embedding=positions, valid_ppl=results["valid_ppl"])
  rec.update(num_params=results["num_params"], wall_s=wall, texts={})
  multiples = MULTIPLES if run.model.cfg.streams else (1,)
  for k in multiples:
    nll = _nll_of_texts(run, valid, k * seq_len)
    rec["texts"][str(k)] = dict(length=k * seq_len, texts=nll.shape[0], ppl=math.exp(nll.mean()),
                                last_ppl=math.exp(nll[:, -seq_len:].mean()))  # fmt: skip
  if run.model.cfg.streams:
    whole = evaluate.evaluate_run(run, split="validation")
    rec["whole_split"] = {"ppl": whole["ppl"], "tokens": whole["tokens"]}
  return rec


def to_markdown(result: dict) -> str:
  seq_len = result["seq_len"]
  lengths = [f"{k * seq_len}" for k in MULTIPLES]
  lines = [
    f"**Validation perplexity on pydoc bytes** (the quickstart recipe{' shrunk' * result['quick']}"
    f": {result['layers']} layers, d {result['d_model']}, trained at T = {seq_len}; texts of N "
    "tokens each scored from its start with all of its past)",
    "",
    "| mixing | positions | valid ppl (results.json) | "
    + " | ".join(f"texts of {n}" for n in lengths)
    + f" | last {seq_len} of {lengths[-1]} | whole split, one text | parameters | train wall |",
    "|---|---|---:|" + "---:|" * len(lengths) + "---:|---:|---:|---:|",
  ]
  fmt = lambda x: f"{x:.3f}" if x is not None else "-"
  for r in result["records"]:
    texts = [r["texts"].get(str(k), {}).get("ppl") for k in MULTIPLES]
    last = r["texts"].get(str(MULTIPLES[-1]), {}).get("last_ppl")
    whole = r.get("whole_split", {}).get("ppl")
    lines.append(
      f"| {r['mixing']} | {r['position_embedding']} | {r['valid_ppl']:.3f} | "
      + " | ".join(fmt(t) for t in texts)
      + f" | {fmt(last)} | {fmt(whole)} | {r['num_params']:,} | {common.fmt_time(r['wall_s'])} |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  p = common.parser(__doc__, "a tiny model and 4 steps (seconds)")
  a = p.parse_args(argv)
  start, info, records = time.perf_counter(), common.machine_info(), []
  config = make_config("aft_local", "learned", a.quick)
  result = {"machine": info, "quick": a.quick, "records": records, "seq_len": config.seq_len}
  result.update(layers=config.model.num_layers, d_model=config.model.d_model)
  with tempfile.TemporaryDirectory() as tmp:
    for mixing, positions in ROWS:
      print(f"--- {mixing}, position embedding {positions}", flush=True)
      workdir = os.path.join(tmp, f"{mixing}_{positions}")
      records.append(run_one(mixing, positions, a.quick, workdir))
      common.write_outputs(a.out, "stream_quality", result, to_markdown(result))
  info["wall_s"] = time.perf_counter() - start
  common.write_outputs(a.out, "stream_quality", result, to_markdown(result), partial=False)
  return result


if __name__ == "__main__":
  main()
