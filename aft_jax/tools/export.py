"""Exports a trained run to one file: aft-export --workdir runs/x --out model.msgpack

msgpack, safetensors or a stream's serving artifact: docs/training.md, "After training"."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os

from aft_jax import files, tools

FORMAT = "aft_jax.export"  # the name of the file format, written in every file (not a module path)
# 3: the SHA-256 of the format name, the version and the payload (any changed byte is damage);
# 2: of the payload alone; 1: no checksum (both still read). Later versions keep 3's rule, so a
# reader tells a newer file (whose digest verifies) from a damaged one.
VERSION = 3
FORMATS = ("msgpack", "safetensors", "stablehlo")
# What an export keeps of the corpus record: what the ids mean, not where the files were.
CORPUS_KEYS = ("name", "unit", "tokenizer", "bos_id", "vocab_size", "vocab_sha256")
SAFETENSORS_META = "aft_jax"  # the safetensors metadata key holding the JSON meta


def _payload(meta: str, params) -> bytes:
  """What an export's SHA-256 is taken of (a safetensors file rebuilds these bytes)."""
  from flax import serialization  # pylint: disable=g-import-not-at-top

  return serialization.msgpack_serialize(_to_numpy({"meta": meta, "params": _sorted(params)}))


def _digest(version: int, payload: bytes) -> str:
  head = b"" if version == 2 else f"{FORMAT} {version}\n".encode()
  return hashlib.sha256(head + payload).hexdigest()


def _check_digest(path: str, version, payload, sha256) -> None:
  # Damage first (whatever the version says), then a version newer than this reader's.
  known = isinstance(version, int) and version >= 2
  if not (known and isinstance(payload, bytes) and _digest(version, payload) == sha256):
    raise ValueError(
      f"load_pretrained: {path} is damaged: its contents do not match their SHA-256 checksum"
    )
  if version > VERSION:
    raise ValueError(f"load_pretrained: {path} has format version {version}; update aft_jax")


def _sorted(tree):
  return {k: _sorted(tree[k]) for k in sorted(tree)} if isinstance(tree, dict) else tree


def export_params(
  path: str, model_cfg, params, vocab, corpus_info: dict, fmt: str = "msgpack"
) -> None:
  """msgpack: {format, version, sha256, payload: msgpack of {meta, params}}; safetensors: the
  parameters by path ("a/b/c"), {format, version, sha256, aft_jax: meta} as metadata."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import serialization, traverse_util  # pylint: disable=g-import-not-at-top

  meta = json.dumps(_meta(model_cfg, vocab, corpus_info))
  params = _to_numpy(serialization.to_state_dict(params))
  payload = _payload(meta, params)
  header = {"format": FORMAT, "version": VERSION, "sha256": _digest(VERSION, payload)}
  if fmt == "safetensors":
    from safetensors.numpy import save  # pylint: disable=g-import-not-at-top

    header = {k: str(v) for k, v in header.items()}
    flat = traverse_util.flatten_dict(params, sep="/")
    flat = {k: np.ascontiguousarray(v) for k, v in flat.items()}
    data = save(flat, metadata={**header, SAFETENSORS_META: meta})
  else:
    data = serialization.msgpack_serialize({**header, "payload": payload})
  with files.output_path("--out", path) as tmp, open(tmp, "wb") as f:
    f.write(data)


def _meta(model_cfg, vocab, corpus_info: dict) -> dict:
  from aft_jax.workdir import vocab_payload  # pylint: disable=g-import-not-at-top

  model = dataclasses.asdict(model_cfg)
  model["dtype"], model["param_dtype"] = str(model["dtype"]), str(model["param_dtype"])
  model["adaptive_cutoffs"] = list(model["adaptive_cutoffs"])
  corpus = {k: corpus_info[k] for k in CORPUS_KEYS if k in corpus_info}
  return {"model": model, "corpus": corpus, "vocab": vocab_payload(vocab)}


def _to_numpy(tree):
  import numpy as np  # pylint: disable=g-import-not-at-top

  if isinstance(tree, dict):
    return {k: _to_numpy(v) for k, v in tree.items()}
  if isinstance(tree, (str, int, float)):
    return tree
  return np.asarray(tree)


def _read_safetensors(path: str, data: bytes) -> dict:
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
  from flax import traverse_util  # pylint: disable=g-import-not-at-top

  params = _sorted(traverse_util.unflatten_dict(flat, sep="/"))
  version = int(info["version"]) if str(info.get("version", "")).isdigit() else None
  _check_digest(path, version, _payload(info[SAFETENSORS_META], params), info.get("sha256"))
  return {"meta": info[SAFETENSORS_META], "params": params}


def _read(path: str) -> dict:
  from flax import serialization  # pylint: disable=g-import-not-at-top

  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise ValueError(f"load_pretrained: cannot read {path}: {e.strerror}") from None
  n = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
  if 0 < n <= len(data) - 8 and data[8:9] == b"{":  # safetensors: a header's length, then JSON
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


def load_pretrained(path: str, api: str = "linen"):
  """(model, params, vocab) from an ``aft-export`` file (msgpack or safetensors, told apart by
  their contents) or a workdir (its newest checkpoint), or a one-line ValueError; a model key
  added since takes its old value. ``api="nnx"``: (``nnx_modules.TransformerLM``, vocab)."""
  from aft_jax.model import ModelConfig, TransformerLM  # pylint: disable=g-import-not-at-top
  from aft_jax.workdir import vocab_from_info  # pylint: disable=g-import-not-at-top

  if api not in ("linen", "nnx"):
    raise ValueError(f"load_pretrained: api must be 'linen' or 'nnx'; got {api!r}")
  if os.path.isdir(path):
    import jax  # pylint: disable=g-import-not-at-top
    from aft_jax.tools import trained  # pylint: disable=g-import-not-at-top

    run = trained.load_run(path)
    model, params, vocab = run.model, jax.device_get(run.params), run.vocab
  else:
    body = _read(path)
    try:
      meta = json.loads(body["meta"])
      vocab = vocab_from_info(meta["corpus"], meta["vocab"])
      model = TransformerLM(ModelConfig(**ModelConfig.as_written(meta["model"])).validate())
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"load_pretrained: {path}: its model config cannot be read ({e})") from None
    _check_params(path, model, body["params"])
    params = body["params"]
  if api == "linen":
    return model, params, vocab
  from aft_jax import nnx_modules  # pylint: disable=g-import-not-at-top

  return nnx_modules.TransformerLM(model.cfg, params=params), vocab


def export_stablehlo(path: str, model, params, vocab, corpus_info: dict) -> None:
  """A stream's serving artifact at ``path``, one .npz (docs/training.md, "A serving artifact")."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax import export as jax_export  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from aft_jax import decode  # pylint: disable=g-import-not-at-top

  cfg = model.cfg
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

  meta = {"format": "aft_jax.stablehlo", "version": VERSION, **_meta(cfg, vocab, corpus_info)}
  meta.update(num_params=len(leaves), num_state=len(state), chunk=cfg.max_len)
  arrays = {"step": serialized(1), "prefill": serialized(cfg.max_len)}
  arrays.update({f"param.{i}": np.asarray(x, np.float32) for i, x in enumerate(leaves)})
  arrays.update({f"state.{i}": np.asarray(x) for i, x in enumerate(state)})
  arrays["meta"] = np.asarray(json.dumps(meta))
  with files.output_path("--out", path, suffix=".npz") as tmp:
    np.savez(tmp, **arrays)


def parse_args(argv=None) -> argparse.Namespace:
  p = tools.parser("export", __doc__)
  p.add_argument("--out", required=True, help="The file to write (e.g. model.msgpack).")
  p.add_argument("--format", choices=FORMATS, help="Default: by the --out suffix, else msgpack.")
  return p.parse_args(argv)


def export_main(args: argparse.Namespace) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from aft_jax.model import STREAM  # pylint: disable=g-import-not-at-top
  from aft_jax.tools import trained  # pylint: disable=g-import-not-at-top

  files.check_file_path("--out", args.out)
  out = os.path.abspath(args.out)
  suffixes = {".safetensors": "safetensors", ".npz": "stablehlo"}
  fmt = args.format or suffixes.get(os.path.splitext(out)[1], "msgpack")
  config = trained.run_config(args.workdir, args.step)
  cfg = config.model
  if fmt == "stablehlo" and not cfg.streams:  # before anything slow
    raise ValueError(
      f"--format stablehlo exports a stream's decoding step ({STREAM}), not mixing "
      f"{cfg.mixing!r} with position embedding {cfg.position_embedding!r}, whose decoding ends "
      f"at max_len = {cfg.max_len}"
    )
  run = trained.load_run(args.workdir, args.step, config=config)
  params = jax.device_get(run.params)
  if fmt == "stablehlo":
    export_stablehlo(out, run.model, params, run.vocab, run.corpus_info)
  else:
    export_params(out, run.model.cfg, params, run.vocab, run.corpus_info, fmt)
  return {"out": out, "step": run.step, "bytes": os.path.getsize(out), "format": fmt}


def main(argv=None) -> None:
  tools.run_command("export", export_main, parse_args(argv), print_json=True)


if __name__ == "__main__":
  main()
