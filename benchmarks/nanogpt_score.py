"""The mean NLL of a nanoGPT checkpoint on ``peer_nanogpt``'s validation windows (``inputs``,
``targets`` ``[N, T]`` in an .npz), one JSON line; run with the PyTorch environment's Python
(no jax, no aft_jax).

    python nanogpt_score.py --nanogpt_dir DIR --ckpt out/ckpt.pt --windows windows.npz
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--nanogpt_dir", required=True)
  p.add_argument("--ckpt", required=True)
  p.add_argument("--windows", required=True)
  p.add_argument("--batch", type=int, default=64)
  a = p.parse_args(argv)
  import torch  # pylint: disable=g-import-not-at-top

  sys.path.insert(0, a.nanogpt_dir)
  from model import GPT, GPTConfig  # pylint: disable=g-import-not-at-top  # nanoGPT's model.py

  ckpt = torch.load(a.ckpt, map_location="cpu", weights_only=False)
  model = GPT(GPTConfig(**ckpt["model_args"]))
  # A torch.compile'd model saves its parameters under this prefix.
  state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
  model.load_state_dict(state)
  model.eval()
  windows = np.load(a.windows)
  inputs, targets = windows["inputs"].astype(np.int64), windows["targets"].astype(np.int64)
  total, count = 0.0, 0
  with torch.no_grad():
    for i in range(0, len(inputs), a.batch):
      x, y = torch.from_numpy(inputs[i : i + a.batch]), torch.from_numpy(targets[i : i + a.batch])
      _, loss = model(x, y)  # the mean cross-entropy over the batch's targets
      total += float(loss) * y.numel()
      count += y.numel()
  out = {"nll": total / count, "tokens": count, "iter_num": int(ckpt.get("iter_num", -1))}
  print(json.dumps(out), flush=True)
  return out


if __name__ == "__main__":
  main()
