"""aft_jax.files: a file is either the old one or the whole new one, and no temp file stays."""

import json
import os

import pytest

from aft_jax import files


def test_atomic_write_json_replaces_and_leaves_no_temp(tmp_path):
  path = str(tmp_path / "results.json")
  files.atomic_write_json(path, {"b": 1, "a": 2})
  files.atomic_write_json(path, {"c": 3})
  assert json.load(open(path)) == {"c": 3}
  assert os.listdir(tmp_path) == ["results.json"]


def test_failed_write_keeps_the_old_file(tmp_path):
  path = str(tmp_path / "vocab.txt")
  files.atomic_write(path, "old\n")
  with pytest.raises(RuntimeError):
    with files.atomic_path(path) as tmp:
      with open(tmp, "w") as f:
        f.write("half")
      raise RuntimeError("crash mid-write")
  assert open(path).read() == "old\n"
  assert os.listdir(tmp_path) == ["vocab.txt"]
