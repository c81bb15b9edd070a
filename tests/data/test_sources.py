"""The fast source fingerprint that decides whether prepared data is stale, and the per-file
digest a run records of its text files (the same rule: name, size, first and last MiB)."""

import os

from aft_jax.data import sources, store

MIB = 1 << 20


def test_fingerprint_sees_size_ends_and_replacement_not_a_deep_same_size_edit(tmp_path):
  data = bytes(range(256)) * (3 * MIB // 256)  # 3 MiB: a middle MiB the fingerprint skips
  path = str(tmp_path / "enwik8")
  open(path, "wb").write(data)
  base, digest = sources.fingerprint([path]), store.file_digest(path)
  assert base.startswith("size+ends-sha256:") and sources.fingerprint([path]) == base
  assert len(digest) == 16
  changed = {
    "truncated": data[:-1],
    "appended": data + b"x",
    "first MiB edited": b"X" + data[1:],
    "last MiB edited": data[:-1] + b"X",
  }
  for what, other in changed.items():
    open(path, "wb").write(other)
    assert sources.fingerprint([path]) != base and store.file_digest(path) != digest, what
  open(path, "wb").write(data[: 3 * MIB // 2] + b"X" + data[3 * MIB // 2 + 1 :])
  # The documented limit: same size, deep inside.
  assert sources.fingerprint([path]) == base and store.file_digest(path) == digest
  # The file's name is part of it: the same bytes under another name are another source.
  os.rename(path, tmp_path / "other")
  assert sources.fingerprint([str(tmp_path / "other")]) != base
