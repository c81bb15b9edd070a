"""aft_jax.tools.export and aft_jax.load_pretrained: a trained run as one file, without Orbax."""

import contextlib
import errno
import hashlib
import io
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import serialization, traverse_util

from tests.support.helpers import ROOT

import aft_jax
from aft_jax import decode
from aft_jax.tools import export
from aft_jax.tools import trained


@pytest.fixture(scope="module")
def run_dir(trained_run):
  return trained_run[0]


@pytest.mark.parametrize(
  "name, fmt", [("model.msgpack", "msgpack"), ("m.safetensors", "safetensors")]
)
def test_export_then_load_pretrained_reproduces_the_checkpoint_exactly(
  run_dir, tmp_path, capsys, monkeypatch, name, fmt
):
  out = str(tmp_path / name)
  export.main(["--workdir", run_dir, "--out", out])  # the format from the name
  result = json.loads(capsys.readouterr().out.splitlines()[-1])
  assert result["out"] == out and result["format"] == fmt

  run = trained.load_run(run_dir)
  tokens_BT = np.asarray([run.vocab.encode("def main():\n    return 42")], np.int32)
  want = run.model.apply({"params": run.params}, tokens_BT)

  import orbax.checkpoint as ocp  # load_pretrained must not need Orbax or the workdir

  monkeypatch.setattr(ocp, "CheckpointManager", None)
  model, params, vocab = aft_jax.load_pretrained(out)
  got = model.apply({"params": params}, tokens_BT)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert model.cfg == run.model.cfg and vocab.size == run.vocab.size
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
    jax.device_get(run.params)
  )
  assert vocab.decode(vocab.encode("héllo")) == "héllo"


@pytest.mark.parametrize(
  "out, message",
  [
    ("no/m.msgpack", r"--out .*no/m.msgpack: folder .*no does not exist"),
    ("", "--out is empty: give a file name"),
    ("pipe", r"--out .*pipe is not a regular file"),
  ],
)
def test_export_to_a_path_that_is_no_file_is_a_one_line_error(run_dir, tmp_path, out, message):
  # A pipe, not a device such as /dev/null: should the check go, the export (as root) would
  # replace it, and a device replaced breaks the machine.
  os.mkfifo(tmp_path / "pipe")
  out = str(tmp_path / out) if out else out
  with pytest.raises(SystemExit, match=f"^export: {message}") as e:
    export.main(["--workdir", run_dir, "--out", out])
  assert "\n" not in str(e.value.code)


def _tamper(path, out, edit):
  """The export at ``path`` edited by ``edit(meta, params)``, its checksum valid again."""
  body = export._read(path)
  meta, params = json.loads(body["meta"]), body["params"]
  edit(meta, params)
  payload = serialization.msgpack_serialize({"meta": json.dumps(meta), "params": params})
  return _write(out, payload)


def _write(out, payload, version=export.VERSION, sha256=None):
  """An export of ``payload`` claiming ``version``, its digest by that version's rule."""
  sha256 = sha256 or export._digest(version, payload)
  with open(out, "wb") as f:
    f.write(
      serialization.msgpack_serialize(
        dict(format=export.FORMAT, version=version, sha256=sha256, payload=payload)
      )
    )
  return str(out)


def test_a_damaged_or_edited_export_is_refused_in_one_line(run_dir, tmp_path, capsys):
  path = str(tmp_path / "model.msgpack")
  export.main(["--workdir", run_dir, "--out", path])
  data = bytearray(open(path, "rb").read())
  assert aft_jax.load_pretrained(path)  # whole, it loads
  middle = len(data) // 2
  data[middle : middle + 4096] = bytes(4096)[: len(data[middle : middle + 4096])]
  damaged = tmp_path / "damaged.msgpack"
  damaged.write_bytes(bytes(data))
  with pytest.raises(ValueError, match="is damaged: its contents do not match their SHA-256"):
    aft_jax.load_pretrained(str(damaged))

  def drop_block(meta, params):
    params.pop(sorted(k for k in params if k.startswith("block"))[-1])

  def wider(meta, params):
    meta["model"]["d_model"] *= 2

  def unknown_key(meta, params):
    meta["model"]["colour"] = "blue"

  cases = [
    (drop_block, "lacks the parameter block"),
    (wider, "the model config makes it float32"),
    (unknown_key, "its model config cannot be read"),
  ]
  for edit, message in cases:
    with pytest.raises(ValueError, match=message):
      aft_jax.load_pretrained(_tamper(path, tmp_path / f"{edit.__name__}.msgpack", edit))
  # The last byte of a msgpack export is its format version: flipped (to 2, or to 7), it is
  # damage, not another format, since the digest covers the version.
  for bit in (1, 4):
    last = bytearray(open(path, "rb").read())
    last[-1] ^= bit
    (tmp_path / "last.msgpack").write_bytes(bytes(last))
    with pytest.raises(ValueError, match="last.msgpack is damaged: its contents do not match"):
      aft_jax.load_pretrained(str(tmp_path / "last.msgpack"))
  # A file a newer aft_jax wrote (its digest verifies under the version it claims) says so,
  # and one of version 2 (the payload's SHA-256 alone) still loads.
  payload = serialization.msgpack_restore(open(path, "rb").read())["payload"]
  with pytest.raises(ValueError, match="has format version 7; update aft_jax"):
    aft_jax.load_pretrained(_write(tmp_path / "newer.msgpack", payload, version=7))
  old = _write(tmp_path / "v2.msgpack", payload, 2, hashlib.sha256(payload).hexdigest())
  assert aft_jax.load_pretrained(old)[2].size == aft_jax.load_pretrained(path)[2].size
  no_version = tmp_path / "no_version.msgpack"
  no_version.write_bytes(serialization.msgpack_serialize({"format": export.FORMAT}))
  with pytest.raises(ValueError, match="has no format version"):
    aft_jax.load_pretrained(str(no_version))
  (tmp_path / "not.msgpack").write_bytes(b"\x00not msgpack at all")
  with pytest.raises(ValueError, match="is not an aft_jax export"):
    aft_jax.load_pretrained(str(tmp_path / "not.msgpack"))
  with pytest.raises(ValueError, match="cannot read"):
    aft_jax.load_pretrained(str(tmp_path / "missing.msgpack"))


def test_export_to_a_full_disk_is_a_one_line_error(run_dir, tmp_path, monkeypatch):
  """A failed write (a full disk): one line naming --out and why, nothing left behind."""
  real = export.files.atomic_path

  @contextlib.contextmanager
  def full_disk(path, suffix=""):
    with real(path, suffix) as tmp:
      yield tmp
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(export.files, "atomic_path", full_disk)
  out = tmp_path / "m.msgpack"
  with pytest.raises(SystemExit, match=r"--out .*m.msgpack: cannot write it: No space left"):
    export.main(["--workdir", run_dir, "--out", str(out)])
  assert os.listdir(tmp_path) == []


def test_an_edited_safetensors_export_is_refused_in_one_line(run_dir, tmp_path):
  from safetensors.numpy import load_file, save_file

  path = str(tmp_path / "model.safetensors")
  with contextlib.redirect_stdout(io.StringIO()):
    export.main(["--workdir", run_dir, "--out", path])
  with open(path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    metadata = json.loads(f.read(n))["__metadata__"]
  tensors = load_file(path)

  def rewrite(name, edit):
    """The export edited by ``edit(tensors)``, its checksum valid again."""
    edited = dict(tensors)
    edit(edited)
    meta = metadata[export.SAFETENSORS_META]
    params = traverse_util.unflatten_dict(edited, sep="/")
    digest = export._digest(export.VERSION, export._payload(meta, params))
    out = str(tmp_path / name)
    save_file(edited, out, metadata={**metadata, "sha256": digest})
    return out

  some = sorted(tensors)[0]
  cases = [
    (lambda t: t.update({some + "_renamed": t.pop(some)}), "lacks the parameter"),
    (lambda t: t.update({some: np.zeros((3, 3), np.float32)}), "the model config makes it"),
  ]
  for i, (edit, message) in enumerate(cases):
    with pytest.raises(ValueError, match=message) as e:
      aft_jax.load_pretrained(rewrite(f"edited{i}.safetensors", edit))
    assert "\n" not in str(e.value)
  damaged = bytearray(open(path, "rb").read())
  damaged[-8:] = bytes(b ^ 0xFF for b in damaged[-8:])  # the last parameter's last bytes
  (tmp_path / "damaged.safetensors").write_bytes(bytes(damaged))
  with pytest.raises(ValueError, match="is damaged: its contents do not match their SHA-256"):
    aft_jax.load_pretrained(str(tmp_path / "damaged.safetensors"))
  save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "other.safetensors"))
  with pytest.raises(ValueError, match="is a safetensors file but not an aft_jax export"):
    aft_jax.load_pretrained(str(tmp_path / "other.safetensors"))


# Run first in the loader's process (its PYTHONPATH holds only ``sitecustomize.py``, below):
# importing flax or aft_jax must fail there.
_BLOCKER = """
import importlib.abc
import sys


class _Blocked(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("flax", "aft_jax"):
      raise ImportError(f"{name} is blocked in this process")


sys.meta_path.insert(0, _Blocked())
"""
_CHECK = (
  "import importlib\n"
  "for name in ('flax', 'aft_jax'):\n"
  "  try:\n"
  "    importlib.import_module(name)\n"
  "  except ImportError:\n"
  "    continue\n"
  "  raise SystemExit(name + ' was importable')\n"
  "exec(open('loader.py').read())\n"
)


def _serving_snippet() -> str:
  docs = open(os.path.join(ROOT, "docs", "training.md"), encoding="utf-8").read()
  section = docs.split("### A serving artifact", 1)[1]
  return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_a_streams_stablehlo_artifact_generates_the_same_tokens_without_flax_or_aft_jax(
  stream_run, run_dir, tmp_path, capsys
):
  """aft-export to a .npz, run by docs/training.md's lines where flax and aft_jax cannot be
  imported: ``decode.generate``'s greedy tokens after a prompt of two prefill chunks and a
  step; an id outside the vocabulary gives NaN."""
  out = tmp_path / "stream.npz"
  export.main(["--workdir", stream_run[0], "--out", str(out)])
  assert json.loads(capsys.readouterr().out.splitlines()[-1])["format"] == "stablehlo"
  prompt = b"class Stream:\n  def step(self):\n"[:33]
  snippet = _serving_snippet()
  assert 'b"The "' in snippet and 'np.load("stream.npz")' in snippet
  (tmp_path / "loader.py").write_text(snippet.replace('b"The "', repr(prompt)))
  (tmp_path / "blocker").mkdir()
  (tmp_path / "blocker" / "sitecustomize.py").write_text(_BLOCKER)
  env = {**os.environ, "PYTHONPATH": str(tmp_path / "blocker")}
  proc = subprocess.run(
    [sys.executable, "-c", _CHECK], cwd=tmp_path, env=env, capture_output=True, text=True,
    timeout=300,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  run = trained.load_run(stream_run[0])
  ids = np.asarray([run.vocab.encode(prompt.decode())], np.int32)
  want = decode.generate(run.model, run.params, ids, 200, rng=jax.random.key(0), temperature=0)
  assert proc.stdout == run.vocab.decode(want[0]) + "\n"
  # An id outside [0, V) gives NaN, never another id's log-probabilities (-1 is not V - 1).
  z = np.load(out)
  meta, step = json.loads(str(z["meta"])), jax.export.deserialize(bytearray(z["step"]))
  params = [z[f"param.{i}"] for i in range(meta["num_params"])]
  state = [z[f"state.{i}"] for i in range(meta["num_state"])]
  v = meta["model"]["vocab_size"]
  logp = {i: step.call(params, state, np.asarray([[i]], np.int32))[0] for i in (-1, v, v - 1)}
  assert np.isnan(logp[-1]).all() and np.isnan(logp[v]).all() and np.isfinite(logp[v - 1]).all()
  # Only a stream has a step that goes on at any length: one line, before anything is loaded.
  with pytest.raises(SystemExit, match="--format stablehlo exports a stream's decoding step"):
    export.main(["--workdir", run_dir, "--out", str(tmp_path / "local.npz")])
