"""What fits where: every recipe's train and evaluation steps compiled for each deviceless
target (1 and 8 devices), XLA's buffer assignment per device (docs/what_fits.md, which this
writes). One process per platform; each row is written as it is done, so a run resumes.

    python -m benchmarks.fit_table   # docs/what_fits.md, benchmarks/results/fit_table.json
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time

from aft_jax import deviceless, files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_JSON = os.path.join(ROOT, "benchmarks", "results", "fit_table.json")
OUT_MD = os.path.join(ROOT, "docs", "what_fits.md")
MIXINGS = ("aft_local", "aft_simple", "aft_full", "aft_conv1d", "softmax")
# The 12 x 512 enwik8 size only for the paper's two rows at that size (Table 4).
RECIPES = ["quickstart", *(f"enwik8:{m}" for m in MIXINGS)]
RECIPES += [f"enwik8:{m},12x512" for m in ("aft_local", "softmax")]
RECIPES += [f"wikitext103:{m}" for m in MIXINGS]
TARGETS = [t.name for t in deviceless.TARGETS.values() if t.kind != "cpu"]
DEVICES = (1, 8)


def _config(recipe: str):
  name, _, arg = recipe.partition(":")
  module = importlib.import_module(f"configs.{name}")
  return module.get_config(arg) if arg else module.get_config()


def _load() -> list[dict]:
  return json.load(open(OUT_JSON))["rows"] if os.path.exists(OUT_JSON) else []


def _row_key(row) -> tuple:
  return row["recipe"], row["target"], row["num_devices"]


def compile_rows(kind: str) -> None:
  """Compiles every missing row of ``kind``'s targets (in a process of that environment)."""
  from aft_jax.trainer import dry_run
  from aft_jax.trainer.run_config import RunConfig

  done = {_row_key(r) for r in _load()}
  for target in (t for t in TARGETS if deviceless.get(t).kind == kind):
    for recipe in RECIPES:
      for n in DEVICES:
        if (recipe, target, n) in done:
          continue
        start = time.time()
        row = {"recipe": recipe, "target": target, "num_devices": n}
        try:
          cfg, device = RunConfig.from_tree(_config(recipe)), deviceless.get(target)
          res = dry_run.compile_steps(cfg, device, n, say=print)
          train, usable = res["train"], dry_run.usable_bytes(device)
          row.update(impl=res["impl"], triton_kernels=res["triton_kernels"])
          row.update(train_bytes=train.total, eval_bytes=res["eval"].total)
          row.update(argument_bytes=train.argument, temp_bytes=train.temp, usable_bytes=usable)
          row["fits"] = max(train.total, res["eval"].total) <= usable
        except Exception as e:  # noqa: BLE001 (a row that fails is recorded, the table goes on)
          row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        row["seconds"] = round(time.time() - start, 1)
        print(json.dumps(row), flush=True)
        rows = [r for r in _load() if _row_key(r) != _row_key(row)] + [row]
        version = importlib.metadata.version("jax")
        files.atomic_write_json(OUT_JSON, {"rows": rows, "jax_version": version})


def _cell(row) -> str:
  if row is None:
    return "—"
  refused = re.search(r"temporaries \(([\d.]+)G\)", row.get("error", ""))
  if refused:  # XLA's TPU compiler refuses a program larger than the chip, naming its size
    return f">{float(refused.group(1)):.0f} ✗"
  if "error" in row:
    return "error"
  return f"{row['train_bytes'] / 2**30:.1f} {'✓' if row['fits'] else '✗'}"


def render() -> str:
  rows = {_row_key(r): r for r in _load()}
  head = open(OUT_MD).read().split("| recipe |")[0]  # the page's prose stays as written
  cols = [f"{t} x{n}" for t in TARGETS for n in DEVICES]
  lines = ["| recipe | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
  for recipe in RECIPES:
    cells = [_cell(rows.get((recipe, t, n))) for t in TARGETS for n in DEVICES]
    lines.append(f"| `{recipe}` | " + " | ".join(cells) + " |")
  errors = [r for r in rows.values() if "error" in r and "RESOURCE_EXHAUSTED" not in r["error"]]
  tail = ["", "Rows that did not compile:", ""] if errors else [""]
  tail += [f"- `{r['recipe']}` on {r['target']} x{r['num_devices']}: {r['error']}" for r in errors]
  return head + "\n".join(lines + tail) + "\n"


def main(argv) -> int:
  if len(argv) == 2 and argv[0] == "--kind":
    compile_rows(argv[1])
    return 0
  children = []
  for kind in ("cuda", "tpu"):  # one process per platform, side by side
    deviceless.install(kind)
    cmd = [sys.executable, "-m", "benchmarks.fit_table", "--kind", kind]
    children.append(subprocess.Popen(cmd, cwd=ROOT, env=deviceless.environment(kind)))
  for child in children:
    child.wait()
  os.makedirs(os.path.dirname(OUT_MD), exist_ok=True)
  files.atomic_write(OUT_MD, render())
  print(f"wrote {OUT_MD}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
