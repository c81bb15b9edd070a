"""Exports a trained run to one file: aft-export --workdir runs/x --out model.msgpack

The file is a msgpack document (``flax.serialization``) holding the parameters and a JSON
string with the model config and the vocabulary, or, with ``--format safetensors`` (the default
for an ``--out`` ending in ``.safetensors``), a safetensors file: one tensor per parameter,
named by its path in the parameter tree (``decoder/block_0/mlp/wi/kernel``), the same JSON in
its metadata (key ``aft_jax``). Either carries a SHA-256 of its contents, and loads back with
one call that needs neither Orbax nor the workdir nor the dataset:

    from aft_jax import load_pretrained
    model, params, vocab = load_pretrained("model.msgpack")  # or "model.safetensors"
    logp_BTV = model.apply({"params": params}, vocab.encode("The ")[None])  # [1, T, V]

``model`` is an ``aft_jax.model.TransformerLM``, ``params`` its parameters (NumPy arrays, exactly
the checkpoint's values), ``vocab`` an ``aft_jax.data.Vocab`` (``encode`` / ``decode``). Sample
with ``aft_jax.decode.sample_text(model, params, vocab, "The ", 200)``.

``--format stablehlo`` (the default for an ``--out`` ending in ``.npz``) writes a serving
artifact of a stream (``model.position_embedding = 'none'``): one ``.npz`` file holding the
model's one-token decoding step and its prefill of ``chunk`` tokens (the model's ``max_len``),
both lowered and serialized with ``jax.export`` (``step``, ``prefill``: bytes, any batch size),
the parameters beside them (``param.0`` ... as float32, cast to the model's dtype inside), the
state before any token (``state.0`` ..., one row) and ``meta``, JSON: the model config, the
vocabulary, the number of params and state arrays, ``chunk``. Both functions map (params, state,
tokens ``[B, T]``) to (log-probabilities ``[B, V]`` of the next token, state); an id outside
[0, V) gives NaN, never another id's log-probabilities. A process that
imports only jax and numpy loads and runs it (docs/training.md, "A serving artifact"); it runs
on the platform it was exported on.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os

from aft_jax import files

FORMAT = "aft_jax.export"  # the name of the file format, written in every file (not a module path)
# 3: the parameters and model config as one payload, with the SHA-256 of the format name, the
# version and the payload (``_digest``), so that any changed byte, the version's too, is refused
# as damage; 2: the SHA-256 of the payload alone; 1: no checksum (both still read). Every later
# version keeps version 3's rule, so a reader tells a newer file (whose digest verifies under
# the version it claims) from a damaged one.
VERSION = 3
FORMATS = ("msgpack", "safetensors", "stablehlo")
STABLEHLO = "aft_jax.stablehlo"  # the format name in a stablehlo artifact's meta
# What an export keeps of the corpus record (``aft_jax.data.record``): what the ids mean, not
# where the training files were.
CORPUS_KEYS = ("name", "unit", "tokenizer", "bos_id", "vocab_size", "vocab_sha256")
SAFETENSORS_META = "aft_jax"  # the safetensors metadata key holding the JSON meta


def _model_config_dict(model_cfg) -> dict:
  d = dataclasses.asdict(model_cfg)
  d["dtype"], d["param_dtype"] = str(d["dtype"]), str(d["param_dtype"])
  d["adaptive_cutoffs"] = list(d["adaptive_cutoffs"])
  return d


def _payload(meta: str, params) -> bytes:
  """The bytes an export's SHA-256 is taken of: the msgpack of {meta, params}, keys sorted
  (a safetensors file, which keeps tensors by name, rebuilds exactly these bytes)."""
  from flax import serialization  # pylint: disable=g-import-not-at-top

  return serialization.msgpack_serialize(_to_numpy({"meta": meta, "params": _sorted(params)}))


def _digest(version: int, payload: bytes) -> str:
  """The SHA-256 an export of ``version`` carries for its ``payload``: from version 3 on, of the
  format name and the version too (``VERSION``)."""
  head = b"" if version == 2 else f"{FORMAT} {version}\n".encode()
  return hashlib.sha256(head + payload).hexdigest()


def _check_digest(path: str, version, payload, sha256) -> None:
  """Refuses a file whose digest does not verify (damage, whatever its version says), then one
  of a version this reader does not know (a newer aft_jax wrote it)."""
  known = isinstance(version, int) and version >= 2
  if not (known and isinstance(payload, bytes) and _digest(version, payload) == sha256):
    raise ValueError(
      f"load_pretrained: {path} is damaged: its contents do not match their SHA-256 checksum"
    )
  if version > VERSION:
    raise ValueError(f"load_pretrained: {path} has format version {version}; update aft_jax")


def _sorted(tree):
  return {k: _sorted(tree[k]) for k in sorted(tree)} if isinstance(tree, dict) else tree


def _flat(params) -> dict:
  """{"a/b/c": array} of a nested parameter dict (the safetensors names)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  out = {}
  for key, value in params.items():
    if isinstance(value, dict):
      out.update({f"{key}/{k}": v for k, v in _flat(value).items()})
    else:
      out[key] = np.ascontiguousarray(value)
  return out


def _nested(flat: dict) -> dict:
  tree = {}
  for name, value in flat.items():
    *parents, leaf = name.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return _sorted(tree)


def export_params(
  path: str, model_cfg, params, vocab, corpus_info: dict, fmt: str = "msgpack"
) -> None:
  """Writes ``params`` with the model config and vocabulary to ``path`` (atomically). msgpack:
  a map {format, version, sha256, payload}, the payload the msgpack of {meta, params};
  safetensors: the parameters by name, {format, version, sha256, aft_jax: meta} as metadata,
  the SHA-256 of the same payload."""
  from flax import serialization  # pylint: disable=g-import-not-at-top

  from aft_jax.workdir import vocab_payload  # pylint: disable=g-import-not-at-top

  corpus_info = {k: corpus_info[k] for k in CORPUS_KEYS if k in corpus_info}
  meta = json.dumps(
    {"model": _model_config_dict(model_cfg), "corpus": corpus_info, "vocab": vocab_payload(vocab)}
  )
  params = _to_numpy(serialization.to_state_dict(params))
  payload = _payload(meta, params)
  header = {"format": FORMAT, "version": VERSION, "sha256": _digest(VERSION, payload)}
  if fmt == "safetensors":
    from safetensors.numpy import save  # pylint: disable=g-import-not-at-top

    header = {k: str(v) for k, v in header.items()}
    data = save(_flat(params), metadata={**header, SAFETENSORS_META: meta})
  else:
    data = serialization.msgpack_serialize({**header, "payload": payload})
  try:
    with files.atomic_path(path) as tmp, open(tmp, "wb") as f:
      f.write(data)
  except OSError as e:  # a read-only folder, a full disk: nothing is left behind
    raise ValueError(f"--out {path}: cannot write it: {e.strerror or e}") from None


def _to_numpy(tree):
  import numpy as np  # pylint: disable=g-import-not-at-top

  if isinstance(tree, dict):
    return {k: _to_numpy(v) for k, v in tree.items()}
  if isinstance(tree, (str, int, float)):
    return tree
  return np.asarray(tree)


def _is_safetensors(data: bytes) -> bool:
  """A safetensors file: an 8-byte little-endian header length, then that much JSON."""
  n = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
  return 0 < n <= len(data) - 8 and data[8:9] == b"{"


def _read_safetensors(path: str, data: bytes) -> dict:
  """{meta, params} of a safetensors export, its checksum checked (one-line ValueErrors)."""
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load  # pylint: disable=g-import-not-at-top

  try:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    flat = load(data)
  except (SafetensorError, ValueError) as e:
    raise ValueError(f"load_pretrained: {path} is not a readable safetensors file ({e})") from None
  info = header.get("__metadata__") or {}
  if info.get("format") != FORMAT or SAFETENSORS_META not in info:
    raise ValueError(f"load_pretrained: {path} is a safetensors file but not an aft_jax export")
  params = _nested(flat)
  version = int(info["version"]) if str(info.get("version", "")).isdigit() else None
  _check_digest(path, version, _payload(info[SAFETENSORS_META], params), info.get("sha256"))
  return {"meta": info[SAFETENSORS_META], "params": params}


def _read(path: str) -> dict:
  """{meta, params} of an export, its checksum checked (one-line ValueErrors)."""
  from flax import serialization  # pylint: disable=g-import-not-at-top

  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise ValueError(f"load_pretrained: cannot read {path}: {e.strerror}") from None
  if _is_safetensors(data):
    return _read_safetensors(path, data)
  try:
    tree = serialization.msgpack_restore(data)
  except Exception as e:  # msgpack raises several types for a file that is not msgpack
    raise ValueError(f"load_pretrained: {path} is not an aft_jax export ({e})") from None
  if not isinstance(tree, dict) or tree.get("format") != FORMAT:
    raise ValueError(f"load_pretrained: {path} is not an aft_jax export")
  version = tree.get("version")
  if version is None and "payload" not in tree:
    raise ValueError(f"load_pretrained: {path} has no format version: not a whole export")
  if version == 1 and "payload" not in tree:  # written before exports carried a checksum
    body = tree
  else:
    _check_digest(path, version, tree.get("payload"), tree.get("sha256"))
    body = serialization.msgpack_restore(tree["payload"])
  if not isinstance(body.get("meta"), str) or not isinstance(body.get("params"), dict):
    raise ValueError(f"load_pretrained: {path} has no model config or parameters")
  return body


def _check_params(path: str, model, params) -> None:
  """The parameters must be exactly the tree the model config builds: every path, shape and
  dtype (an edited file otherwise fails later, inside the model)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  tokens = jnp.zeros((1, 1), jnp.int32)
  want = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens)["params"])
  want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  name = lambda p: "/".join(str(getattr(k, "key", k)) for k in p)  # noqa: E731
  for p in sorted(set(want) | set(got), key=name):
    if p not in got:
      raise ValueError(f"load_pretrained: {path} lacks the parameter {name(p)}")
    if p not in want:
      raise ValueError(f"load_pretrained: {path} has a parameter the model has not: {name(p)}")
    a, b = want[p], np.asarray(got[p])
    if a.shape != b.shape or a.dtype != b.dtype:
      raise ValueError(
        f"load_pretrained: {path}: parameter {name(p)} is {b.dtype}{list(b.shape)}, the model "
        f"config makes it {a.dtype}{list(a.shape)}"
      )


def load_pretrained(path: str):
  """(model, params, vocab) from a file written by ``aft-export`` (msgpack or safetensors: told
  apart by their contents, not their names; module doc). A damaged file
  (any changed byte), a file of a newer format, a model config this version does not know and
  parameters that are not the tree that config builds are one-line ValueErrors. A model key
  added since the file was written takes the value its version ran with
  (``ModelConfig.ADDED``)."""
  from aft_jax.model import ModelConfig, TransformerLM  # pylint: disable=g-import-not-at-top
  from aft_jax.workdir import vocab_from_info  # pylint: disable=g-import-not-at-top

  body = _read(path)
  try:
    meta = json.loads(body["meta"])
    vocab = vocab_from_info(meta["corpus"], meta["vocab"])
    model = TransformerLM(ModelConfig(**ModelConfig.as_written(meta["model"])).validate())
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"load_pretrained: {path}: its model config cannot be read ({e})") from None
  _check_params(path, model, body["params"])
  return model, body["params"], vocab


def _check_stablehlo(cfg) -> None:
  """A one-line ValueError unless the model is a stream, which ``--format stablehlo`` needs."""
  if not cfg.streams:
    raise ValueError(
      f"--format stablehlo exports a stream's decoding step (model.position_embedding 'none' "
      f"with mixing aft_simple or aft_conv1d), not mixing {cfg.mixing!r} with position "
      f"embedding {cfg.position_embedding!r}, whose decoding ends at max_len = {cfg.max_len}"
    )


def export_stablehlo(path: str, model, params, vocab, corpus_info: dict) -> None:
  """Writes the serving artifact of a stream (module doc) to ``path`` (atomically)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax import export as jax_export  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from aft_jax import decode  # pylint: disable=g-import-not-at-top
  from aft_jax.workdir import vocab_payload  # pylint: disable=g-import-not-at-top

  cfg = model.cfg
  _check_stablehlo(cfg)
  leaves, params_def = jax.tree.flatten(params)
  state, state_def = jax.tree.flatten(jax.device_get(decode.init_cache(model, 1)))

  def run(params_f32, state, tokens_BT):
    p = [jax.numpy.asarray(x, leaf.dtype) for x, leaf in zip(params_f32, leaves)]
    variables = {"params": jax.tree.unflatten(params_def, p)}
    variables["cache"] = jax.tree.unflatten(state_def, state)
    logp_BTV, mutated = model.apply(variables, tokens_BT, decode=True, mutable=["cache"])
    return logp_BTV[:, -1], jax.tree.leaves(mutated["cache"])

  def serialized(t_len: int) -> np.ndarray:
    (b,) = jax_export.symbolic_shape("b")  # any batch: each state array but the counts has it
    rows = lambda x: jax.ShapeDtypeStruct((b, *x.shape[1:]) if x.ndim else x.shape, x.dtype)
    args = (
      [jax.ShapeDtypeStruct(x.shape, np.float32) for x in leaves],
      [rows(x) for x in state],
      jax.ShapeDtypeStruct((b, t_len), np.int32),
    )
    return np.frombuffer(jax_export.export(jax.jit(run))(*args).serialize(), np.uint8)

  corpus_info = {k: corpus_info[k] for k in CORPUS_KEYS if k in corpus_info}
  meta = {
    "format": STABLEHLO,
    "version": VERSION,
    "model": _model_config_dict(cfg),
    "corpus": corpus_info,
    "vocab": vocab_payload(vocab),
    "num_params": len(leaves),
    "num_state": len(state),
    "chunk": cfg.max_len,
  }
  arrays = {"step": serialized(1), "prefill": serialized(cfg.max_len)}
  arrays.update({f"param.{i}": np.asarray(x, np.float32) for i, x in enumerate(leaves)})
  arrays.update({f"state.{i}": np.asarray(x) for i, x in enumerate(state)})
  arrays["meta"] = np.asarray(json.dumps(meta))
  try:
    with files.atomic_path(path, suffix=".npz") as tmp:
      np.savez(tmp, **arrays)
  except OSError as e:
    raise ValueError(f"--out {path}: cannot write it: {e.strerror or e}") from None


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog="python -m aft_jax.tools.export", description=__doc__.split("\n")[0]
  )
  p.add_argument("--workdir", required=True, help="A workdir written by train.py.")
  p.add_argument("--out", required=True, help="The file to write (e.g. model.msgpack).")
  p.add_argument(
    "--format",
    choices=FORMATS,
    help="msgpack, safetensors or stablehlo (a stream's serving artifact); default: by the --out "
    "suffix (.safetensors, .npz), else msgpack.",
  )
  p.add_argument("--step", type=int, help="Checkpoint step (default: the latest).")
  return p.parse_args(argv)


def export_main(args: argparse.Namespace) -> dict:
  """Runs the command: writes the file and prints (and returns) one JSON line about it."""
  import jax  # pylint: disable=g-import-not-at-top

  from aft_jax.tools import trained  # pylint: disable=g-import-not-at-top
  from aft_jax.workdir import Workdir  # pylint: disable=g-import-not-at-top

  files.check_file_path("--out", args.out)
  out = os.path.abspath(args.out)
  Workdir(args.workdir).check(args.step)
  suffixes = {".safetensors": "safetensors", ".npz": "stablehlo"}
  fmt = args.format or suffixes.get(os.path.splitext(out)[1], "msgpack")
  config = trained.run_config(args.workdir)
  if fmt == "stablehlo":
    _check_stablehlo(config.model)  # before anything slow
  run = trained.load_run(args.workdir, args.step, config=config)
  params = jax.device_get(run.params)
  if fmt == "stablehlo":
    export_stablehlo(out, run.model, params, run.vocab, run.corpus_info)
  else:
    export_params(out, run.model.cfg, params, run.vocab, run.corpus_info, fmt)
  result = {"out": out, "step": run.step, "bytes": os.path.getsize(out), "format": fmt}
  return result


def main(argv=None) -> None:
  """Console-script entry point (``aft-export``); ``argv`` defaults to ``sys.argv[1:]``."""
  from aft_jax import tools  # pylint: disable=g-import-not-at-top

  tools.run_command("export", export_main, parse_args(argv), print_json=True)


if __name__ == "__main__":
  main()
