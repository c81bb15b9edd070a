"""aft_jax.tools.export and aft_jax.load_pretrained: a trained run as one file, without Orbax."""

import json

import jax
import numpy as np
import pytest

import aft_jax
from aft_jax.tools import export
from aft_jax.tools import trained


@pytest.fixture(scope="module")
def run_dir(trained_run):
  return trained_run[0]


def test_export_then_load_pretrained_reproduces_the_checkpoint_exactly(
  run_dir, tmp_path, capsys, monkeypatch
):
  out = str(tmp_path / "model.msgpack")
  export.main(["--workdir", run_dir, "--out", out])
  assert json.loads(capsys.readouterr().out.splitlines()[-1])["out"] == out

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


def test_load_pretrained_refuses_other_files(tmp_path):
  path = tmp_path / "not.msgpack"
  path.write_bytes(b"\x00not msgpack at all")
  with pytest.raises(ValueError, match="is not an aft_jax export"):
    aft_jax.load_pretrained(str(path))
  with pytest.raises(ValueError, match="cannot read"):
    aft_jax.load_pretrained(str(tmp_path / "missing.msgpack"))


def test_export_to_a_missing_folder_is_a_one_line_error(run_dir, tmp_path):
  with pytest.raises(SystemExit, match="does not exist"):
    export.main(["--workdir", run_dir, "--out", str(tmp_path / "no" / "m.msgpack")])
