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


@pytest.fixture(scope="module")
def exports(run_dir, tmp_path_factory):
  """(folder, {format: the command's JSON line}): the run exported to each file format."""
  folder, lines = tmp_path_factory.mktemp("exports"), {}
  for name in ("model.msgpack", "model.safetensors"):  # the format from the name
    with contextlib.redirect_stdout(io.StringIO()) as out:
      export.main(["--workdir", run_dir, "--out", str(folder / name)])
    line = json.loads(out.getvalue().splitlines()[-1])
    lines[line["format"]] = line
  return folder, lines


@pytest.mark.parametrize("fmt", ["msgpack", "safetensors"])
def test_export_then_load_pretrained_reproduces_the_checkpoint_exactly(
  run_dir, exports, monkeypatch, fmt
):
  folder, lines = exports
  out = str(folder / f"model.{fmt}")
  assert lines[fmt]["out"] == out and lines[fmt]["bytes"] == os.path.getsize(out)
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


def _wrapped(payload, version=export.VERSION, sha256=None) -> bytes:
  """A msgpack export of ``payload`` claiming ``version``, its digest by that version's rule."""
  sha256 = sha256 or export._digest(version, payload)
  header = dict(format=export.FORMAT, version=version, sha256=sha256)
  return serialization.msgpack_serialize({**header, "payload": payload})


def _payload(folder) -> bytes:
  return serialization.msgpack_restore((folder / "model.msgpack").read_bytes())["payload"]


def _edited(edit):
  """The msgpack export edited by ``edit(meta, params)``, its checksum valid again."""

  def make(folder):
    body = export._read(str(folder / "model.msgpack"))
    meta, params = json.loads(body["meta"]), body["params"]
    edit(meta, params)
    return _wrapped(serialization.msgpack_serialize({"meta": json.dumps(meta), "params": params}))

  return make


def _edited_safetensors(edit):
  """The safetensors export edited by ``edit(tensors)``, its checksum valid again."""

  def make(folder):
    from safetensors.numpy import load, save

    data = (folder / "model.safetensors").read_bytes()
    metadata = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    tensors = load(data)
    edit(tensors)
    params = traverse_util.unflatten_dict(tensors, sep="/")
    digest = export._digest(export.VERSION, export._payload(metadata["aft_jax"], params))
    return save(tensors, metadata={**metadata, "sha256": digest})

  return make


def _flipped(name, xor, part):
  """The export ``name``, its bytes ``part(length)`` (a slice) xor ``xor``."""

  def make(folder):
    data = bytearray((folder / name).read_bytes())
    where = part(len(data))
    data[where] = bytes(b ^ xor for b in data[where])
    return bytes(data)

  return make


def _other_safetensors(folder):
  from safetensors.numpy import save

  return save({"w": np.zeros(2, np.float32)})


def _version_2(folder):  # its digest the payload's SHA-256 alone
  return _wrapped(_payload(folder), 2, hashlib.sha256(_payload(folder)).hexdigest())


MIDDLE = lambda n: slice(n // 2, n // 2 + 4096)  # noqa: E731
LAST = lambda n: slice(n - 1, n)  # a msgpack export's format version  # noqa: E731
LAST_8 = lambda n: slice(n - 8, n)  # a safetensors export's last parameter's last bytes  # noqa: E731
SUM = "is damaged: its contents do not match their SHA-256"
# (how the file is made from the exports' folder, the message; None: it loads). A flipped version
# (to 2, or to 7) is damage, not another format: the digest covers the version.
DAMAGED = {
  "middle": (_flipped("model.msgpack", 0xFF, MIDDLE), SUM),
  "version_to_2": (_flipped("model.msgpack", 1, LAST), SUM),
  "version_to_7": (_flipped("model.msgpack", 4, LAST), SUM),
  "no_block": (
    _edited(lambda m, p: p.pop(max(k for k in p if k.startswith("block")))),
    "lacks the parameter block",
  ),
  "wider": (
    _edited(lambda m, p: m["model"].update(d_model=2 * m["model"]["d_model"])),
    "the model config makes it float32",
  ),
  "unknown_key": (
    _edited(lambda m, p: m["model"].update(colour="blue")),
    "its model config cannot be read",
  ),
  "newer": (lambda f: _wrapped(_payload(f), version=7), "has format version 7; update aft_jax"),
  "version_2": (_version_2, None),
  "no_version": (
    lambda f: serialization.msgpack_serialize({"format": export.FORMAT}),
    "has no format version",
  ),
  "not_msgpack": (lambda f: b"\x00not msgpack at all", "is not an aft_jax export"),
  "missing": (None, "cannot read"),
  "renamed_tensor": (
    _edited_safetensors(lambda t: t.update({min(t) + "_x": t.pop(min(t))})),
    "lacks the parameter",
  ),
  "reshaped_tensor": (
    _edited_safetensors(lambda t: t.update({min(t): np.zeros((3, 3), np.float32)})),
    "the model config makes it",
  ),
  "safetensors_damaged": (_flipped("model.safetensors", 0xFF, LAST_8), SUM),
  "other_safetensors": (_other_safetensors, "is a safetensors file but not an aft_jax export"),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_or_edited_export_is_refused_in_one_line(exports, tmp_path, case):
  make, message = DAMAGED[case]
  path = tmp_path / "model"
  if make is not None:
    path.write_bytes(make(exports[0]))
  if message is None:  # an older version's file still loads
    assert aft_jax.load_pretrained(str(path))[2].size == 256
    return
  with pytest.raises(ValueError) as e:
    aft_jax.load_pretrained(str(path))
  assert f"{path}" in str(e.value) and message in str(e.value) and "\n" not in str(e.value)


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
  stream_run, tmp_path, capsys
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
