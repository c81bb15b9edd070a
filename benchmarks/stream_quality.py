"""Whether more past helps a stream, CPU: configs/stream.py (AFT with a learned decay), AFT-conv1d
without positions and softmax with learned positions, trained alike (the recipe with two
overrides), scored on texts of 1x, 4x, 16x and 64x the training length from their start; the
last T tokens of the long texts with their whole past against the same tokens alone
(docs/training.md, "Streams"; RESULTS.md, "Streams").

    python -m benchmarks.stream_quality --out benchmarks/results     # 3 runs, ~5 min
    python -m benchmarks.stream_quality --quick --out /tmp/sq        # seconds
"""

from __future__ import annotations

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

ROWS = [("aft_decay", "none"), ("aft_conv1d", "none"), ("softmax", "learned")]
MULTIPLES = (1, 4, 16, 64)  # text lengths, in training lengths
PAST = (16, 64)  # the texts whose last T tokens are scored with and without their past
QUICK = quality.settings(quick=True)  # a tiny model, 4 steps


def make_config(mixing: str, positions: str, quick: bool):
  """configs/stream.py with ``mixing`` and ``positions`` (shrunk: ``quick``)."""
  config = recipes.load("stream")
  config.model.mixing = mixing
  config.model.position_embedding = positions
  return override(config, QUICK if quick else {})


def _nll_of_texts(run, texts: np.ndarray, batch: int = 8) -> np.ndarray:
  """NLL ``[n, length]`` of ``texts`` [n, length], each scored from its start (bos)."""
  n = texts.shape[0]
  inputs = np.concatenate([np.full((n, 1), run.bos_id, np.int32), texts[:, :-1]], axis=1)
  apply = jax.jit(lambda p, x, y: run.model.apply({"params": p}, x, y))
  out = [apply(run.params, inputs[i : i + batch], texts[i : i + batch]) for i in range(0, n, batch)]
  return np.concatenate(out).astype(np.float64)


def run_one(mixing: str, positions: str, quick: bool, workdir: str) -> dict:
  results, wall = common.train(make_config(mixing, positions, quick), workdir)
  run = trained.load_run(workdir)
  seq_len = run.config.train.seq_len
  valid = np.asarray(data_lib.load_corpus(run.config.data).splits["validation"], np.int32)
  rec = dict(mixing=mixing, position_embedding=positions, valid_ppl=results["valid_ppl"])
  rec.update(num_params=results["num_params"], wall_s=wall, texts={})
  for k in MULTIPLES if run.model.cfg.streams else (1,):
    n = len(valid) // (k * seq_len)
    texts = valid[: n * k * seq_len].reshape(n, k * seq_len)
    nll = _nll_of_texts(run, texts)
    rec["texts"][str(k)] = text = dict(length=k * seq_len, texts=n, nll=nll.mean())
    if k in PAST:  # nats per token of the last T tokens: with the whole past, and alone
      text.update(
        last=nll[:, -seq_len:].mean(), alone=_nll_of_texts(run, texts[:, -seq_len:]).mean()
      )
  if run.model.cfg.streams:
    whole = evaluate.evaluate_run(run, split="validation")
    rec["whole_split"] = {"ppl": whole["ppl"], "tokens": whole["tokens"]}
  return rec


def to_markdown(result: dict) -> str:
  t = result["seq_len"]
  fmt = lambda x, f=".3f": "-" if x is None else format(x, f)
  lines = [
    f"**Validation NLL on pydoc bytes, nats per byte** (configs/stream.py"
    f"{' shrunk' * result['quick']}: {result['layers']} layers, d {result['d_model']}, trained at "
    f"T = {t}; texts of N bytes each scored from its start with all of its past; last {t} of N: "
    "with the past, alone, and the difference)",
    "",
    "| mixing | positions | " + " | ".join(f"texts of {k * t}" for k in MULTIPLES)
    + "".join(f" | last {t} of {k * t} | alone | past - alone" for k in PAST)
    + " | whole split, one text (ppl) | valid ppl (results.json) | train wall |",
    "|---|---|" + "---:|" * (len(MULTIPLES) + 3 * len(PAST) + 3),
  ]  # fmt: skip
  for r in result["records"]:
    texts = [r["texts"].get(str(k), {}) for k in MULTIPLES]
    cells = [r["mixing"], r["position_embedding"]] + [fmt(x.get("nll")) for x in texts]
    for k in PAST:
      x = r["texts"].get(str(k), {})
      diff = x["last"] - x["alone"] if x else None
      cells += [fmt(x.get("last")), fmt(x.get("alone")), fmt(diff, "+.3f")]
    cells += [fmt(r.get("whole_split", {}).get("ppl")), fmt(r["valid_ppl"])]
    lines.append("| " + " | ".join(cells + [common.fmt_time(r["wall_s"])]) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  p = common.parser(__doc__, "a tiny model and 4 steps (seconds)")
  a = p.parse_args(argv)
  start, info, records = time.perf_counter(), common.machine_info(), []
  config = make_config(*ROWS[0], a.quick)
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
