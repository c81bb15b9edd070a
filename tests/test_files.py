"""aft_jax.files: a file is either the old one or the whole new one, and no temp file stays."""

import json
import os

import pytest

from aft_jax import files


def test_a_write_replaces_the_file_whole_or_keeps_the_old_one_and_leaves_no_temp(tmp_path):
  path = str(tmp_path / "results.json")
  files.atomic_write_json(path, {"b": 1, "a": 2})
  files.atomic_write_json(path, {"c": 3})
  assert json.load(open(path)) == {"c": 3}
  with pytest.raises(RuntimeError):
    with files.atomic_path(path) as tmp:
      with open(tmp, "w") as f:
        f.write("half")
      raise RuntimeError("crash mid-write")
  assert json.load(open(path)) == {"c": 3} and os.listdir(tmp_path) == ["results.json"]


NO_FILE = "is not a regular file (a device or a pipe): give a file name"


@pytest.mark.parametrize(
  "path, message",
  [
    ("", "--out is empty: give a file name"),
    ("{tmp}", "--out {path} is a directory: give a file name"),
    ("/dev/null", "--out {path} " + NO_FILE),
    ("{tmp}/pipe", "--out {path} " + NO_FILE),
    ("{tmp}/link", "--out {path} " + NO_FILE),  # a link to a device
    ("{tmp}/no/m.msgpack", "--out {path}: folder {tmp}/no does not exist"),
  ],
)
def test_a_path_that_cannot_be_written_as_a_file_is_refused_in_one_line(tmp_path, path, message):
  path = path.format(tmp=tmp_path)
  os.mkfifo(tmp_path / "pipe")
  os.symlink("/dev/null", tmp_path / "link")
  with pytest.raises(ValueError) as e:
    files.check_file_path("--out", path)
  assert str(e.value) == message.format(path=path, tmp=os.path.realpath(tmp_path))


def test_a_symlink_is_written_through_to_the_file_it_points_to(tmp_path):
  target, link = tmp_path / "real.state", tmp_path / "link.state"
  target.write_text("old")
  link.symlink_to(target)
  files.check_file_path("--save_state", str(link))
  files.atomic_write(str(link), "new")
  assert link.is_symlink() and target.read_text() == "new"
  assert sorted(os.listdir(tmp_path)) == ["link.state", "real.state"]
