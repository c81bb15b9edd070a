"""The suite's own machinery (tests/support/shared.py) where it could go wrong unseen."""

import os

from tests.support import shared


def test_trim_cache_keeps_the_newest_half_only_past_the_limit(tmp_path):
  for i in range(10):  # 100 bytes each, written one second apart: file 9 the newest
    path = tmp_path / f"entry{i}"
    path.write_bytes(bytes(100))
    os.utime(path, (1000 + i, 1000 + i))
  shared.trim_cache(str(tmp_path), keep=1000)  # 1000 bytes: within the limit, all kept
  assert len(os.listdir(tmp_path)) == 10
  shared.trim_cache(str(tmp_path), keep=999)  # past it: down to 499 bytes, the newest four
  assert sorted(os.listdir(tmp_path)) == [f"entry{i}" for i in (6, 7, 8, 9)]
  shared.trim_cache(str(tmp_path / "missing"), keep=1)  # no folder yet: nothing to do
