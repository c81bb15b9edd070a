"""Exports a trained run to one file: aft-export --workdir runs/x --out model.msgpack

The file is a msgpack document (``flax.serialization``) holding the parameters and a JSON
string with the model config and the vocabulary; it loads back with one call and needs neither
Orbax nor the workdir nor the dataset:

    from aft_jax import load_pretrained
    model, params, vocab = load_pretrained("model.msgpack")
    logp_BTV = model.apply({"params": params}, vocab.encode("The ")[None])  # [1, T, V]

``model`` is an ``aft_jax.model.TransformerLM``, ``params`` its parameters (NumPy arrays, exactly
the checkpoint's values), ``vocab`` an ``aft_jax.data.Vocab`` (``encode`` / ``decode``). Sample
with ``aft_jax.decode.sample_text(model, params, vocab, "The ", 200)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np
from flax import serialization

from aft_jax import files
from aft_jax.data import vocab as vocab_lib

FORMAT = "aft_jax.export"  # the name of the file format, written in every file (not a module path)
VERSION = 1


def _model_config_dict(model_cfg) -> dict:
  d = dataclasses.asdict(model_cfg)
  d["dtype"], d["param_dtype"] = str(d["dtype"]), str(d["param_dtype"])
  d["adaptive_cutoffs"] = list(d["adaptive_cutoffs"])
  return d


def export_params(path: str, model_cfg, params, vocab, corpus_info: dict) -> None:
  """Writes ``params`` with the model config and vocabulary to ``path`` (atomically)."""
  meta = {
    "model": _model_config_dict(model_cfg),
    "corpus": corpus_info,
    "vocab": vocab.tokens if isinstance(vocab, vocab_lib.WordVocab) else None,
  }
  params = serialization.to_state_dict(params)
  host = {"format": FORMAT, "version": VERSION, "meta": json.dumps(meta), "params": params}
  data = serialization.msgpack_serialize(_to_numpy(host))
  with files.atomic_path(path) as tmp, open(tmp, "wb") as f:
    f.write(data)


def _to_numpy(tree):
  if isinstance(tree, dict):
    return {k: _to_numpy(v) for k, v in tree.items()}
  if isinstance(tree, (str, int, float)):
    return tree
  return np.asarray(tree)


def load_pretrained(path: str):
  """(model, params, vocab) from a file written by ``aft-export`` (module doc)."""
  from aft_jax.model import ModelConfig, TransformerLM  # pylint: disable=g-import-not-at-top
  from aft_jax.workdir import vocab_from_info  # pylint: disable=g-import-not-at-top

  try:
    with open(path, "rb") as f:
      tree = serialization.msgpack_restore(f.read())
  except OSError as e:
    raise ValueError(f"load_pretrained: cannot read {path}: {e.strerror}") from None
  except Exception as e:  # msgpack raises several types for a file that is not msgpack
    raise ValueError(f"load_pretrained: {path} is not an aft_jax export ({e})") from None
  if not isinstance(tree, dict) or tree.get("format") != FORMAT:
    raise ValueError(f"load_pretrained: {path} is not an aft_jax export")
  if tree["version"] > VERSION:
    raise ValueError(
      f"load_pretrained: {path} has format version {tree['version']}; update aft_jax"
    )
  meta = json.loads(tree["meta"])
  vocab = vocab_from_info(meta["corpus"], meta["vocab"])
  model = TransformerLM(ModelConfig(**meta["model"]).validate())
  return model, tree["params"], vocab


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog="python -m aft_jax.tools.export", description=__doc__.split("\n")[0]
  )
  p.add_argument("--workdir", required=True, help="A workdir written by train.py.")
  p.add_argument("--out", required=True, help="The file to write (e.g. model.msgpack).")
  p.add_argument("--step", type=int, help="Checkpoint step (default: the latest).")
  return p.parse_args(argv)


def export_main(args: argparse.Namespace) -> dict:
  """Runs the command: writes the file and prints (and returns) one JSON line about it."""
  import jax  # pylint: disable=g-import-not-at-top

  from aft_jax.tools import trained  # pylint: disable=g-import-not-at-top
  from aft_jax.workdir import Workdir  # pylint: disable=g-import-not-at-top

  out = os.path.abspath(args.out)
  if os.path.isdir(out):
    raise ValueError(f"--out {args.out} is a directory: give a file name")
  if not os.path.isdir(os.path.dirname(out)):
    raise ValueError(f"--out {args.out}: folder {os.path.dirname(out)} does not exist")
  Workdir(args.workdir).check(args.step)
  run = trained.load_run(args.workdir, args.step)
  params = jax.device_get(run.params)
  export_params(out, run.model.cfg, params, run.vocab, run.corpus_info)
  result = {"out": out, "step": run.step, "bytes": os.path.getsize(out)}
  return result


def main(argv=None) -> None:
  """Console-script entry point (``aft-export``); ``argv`` defaults to ``sys.argv[1:]``."""
  from aft_jax import tools  # pylint: disable=g-import-not-at-top

  tools.run_command("export", export_main, parse_args(argv), print_json=True)


if __name__ == "__main__":
  main()
