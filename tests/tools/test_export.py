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
from flax import serialization
from safetensors.numpy import save as safetensors_save

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
  """(folder, {format: the command's JSON line}), the format from the name."""
  folder, lines = tmp_path_factory.mktemp("exports"), {}
  for name in ("model.msgpack", "model.safetensors"):
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
  assert jax.tree.structure(params) == jax.tree.structure(jax.device_get(run.params))
  assert vocab.decode(vocab.encode("héllo")) == "héllo"


_msgpack = serialization.msgpack_serialize


def _wrapped(payload, version=export.VERSION, sha256=None) -> bytes:
  """A msgpack export of ``payload`` claiming ``version``, its digest by that version's rule."""
  sha256 = sha256 or export._digest(version, payload)
  header = dict(format=export.FORMAT, version=version, sha256=sha256)
  return _msgpack({**header, "payload": payload})


def _payload(folder) -> bytes:
  return serialization.msgpack_restore((folder / "model.msgpack").read_bytes())["payload"]


def _edited(edit):
  """The msgpack export edited by ``edit(meta, params)``, its checksum valid again."""

  def make(folder):
    body = export._read(str(folder / "model.msgpack"))
    meta, params = json.loads(body["meta"]), body["params"]
    edit(meta, params)
    return _wrapped(_msgpack({"meta": json.dumps(meta), "params": params}))

  return make


def _flipped(name, xor, part):
  """The export ``name``, its bytes ``part(length)`` (a slice) xor ``xor``."""

  def make(folder):
    data = bytearray((folder / name).read_bytes())
    where = part(len(data))
    data[where] = bytes(b ^ xor for b in data[where])
    return bytes(data)

  return make


def _version_2(folder):  # its digest the payload's SHA-256 alone
  return _wrapped(_payload(folder), 2, hashlib.sha256(_payload(folder)).hexdigest())


def _no_block(meta, params):
  params.pop(max(k for k in params if k.startswith("block")))


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
  "no_block": (_edited(_no_block), "lacks the parameter block"),
  "wider": (_edited(lambda m, p: m["model"].update(d_model=1024)), "the model config makes it"),
  "unknown_key": (_edited(lambda m, p: m["model"].update(colour="blue")), "config cannot be read"),
  "newer": (lambda f: _wrapped(_payload(f), version=7), "has format version 7; update aft_jax"),
  "version_2": (_version_2, None),
  "no_version": (lambda f: _msgpack({"format": export.FORMAT}), "has no format version"),
  "not_msgpack": (lambda f: b"\x00not msgpack at all", "is not an aft_jax export"),
  "missing": (None, "cannot read"),
  "safetensors_damaged": (_flipped("model.safetensors", 0xFF, LAST_8), SUM),
  "other_safetensors": (lambda f: safetensors_save({"w": np.zeros(2)}), "safetensors file but not"),
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


def _serving_snippet() -> str:
  docs = open(os.path.join(ROOT, "docs", "training.md"), encoding="utf-8").read()
  section = docs.split("### A serving artifact", 1)[1]
  return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_a_streams_stablehlo_artifact_generates_the_same_tokens_without_flax_or_aft_jax(
  stream_run, tmp_path, capsys
):
  """docs/training.md's loader, importing neither: ``decode.generate``'s greedy tokens after a
  prompt of two prefill chunks and a step; an id outside the vocabulary gives NaN."""
  out = tmp_path / "stream.npz"
  export.main(["--workdir", stream_run[0], "--out", str(out)])
  assert json.loads(capsys.readouterr().out.splitlines()[-1])["format"] == "stablehlo"
  prompt = b"class Stream:\n  def step(self):\n"[:33]
  snippet = _serving_snippet()
  assert 'b"The "' in snippet and 'np.load("stream.npz")' in snippet
  (tmp_path / "loader.py").write_text(snippet.replace('b"The "', repr(prompt)))
  check = (
    "exec(open('loader.py').read()); import sys; assert not {'flax', 'aft_jax'} & set(sys.modules)"
  )
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  cmd = [sys.executable, "-c", check]
  proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
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
