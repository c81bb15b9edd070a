"""The fast source fingerprint that decides whether prepared data is stale."""

import os

from aft_jax.data import sources

MIB = 1 << 20


def _write(path, data):
  with open(path, "wb") as f:
    f.write(data)
  return str(path)


def test_fingerprint_sees_size_ends_and_replacement_not_a_deep_same_size_edit(tmp_path):
  data = bytes(range(256)) * (3 * MIB // 256)  # 3 MiB: a middle MiB the fingerprint skips
  path = _write(tmp_path / "enwik8", data)
  base = sources.fingerprint([path])
  assert base.startswith("size+ends-sha256:") and sources.fingerprint([path]) == base
  changed = {
    "truncated": data[:-1],
    "appended": data + b"x",
    "first MiB edited": b"X" + data[1:],
    "last MiB edited": data[:-1] + b"X",
  }
  for what, other in changed.items():
    _write(path, other)
    assert sources.fingerprint([path]) != base, what
  _write(path, data[: 3 * MIB // 2] + b"X" + data[3 * MIB // 2 + 1 :])
  assert sources.fingerprint([path]) == base  # documented limit: same size, deep inside
  # The file's name is part of it: the same bytes under another name are another source.
  os.rename(path, tmp_path / "other")
  assert sources.fingerprint([str(tmp_path / "other")]) != base
