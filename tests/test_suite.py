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


def test_cpu_probe_adds_up_each_folders_tests(tmp_path):
  """The per-folder table of docs/development.md (tests/support/cpu_probe.py): each worker's
  file read, tests counted in their folder, the folder with the most CPU first, the totals."""
  from tests.support import cpu_probe

  (tmp_path / "gw0.json").write_text(
    '[["tests/ops/test_a.py::t1", 2.0, 1.5, 0.0], ["tests/test_b.py::t2", 4.0, 0.5, 3.0]]'
  )
  (tmp_path / "gw1.json").write_text('[["tests/ops/test_c.py::t3[x]", 1.0, 1.0, 0.25]]')
  lines = cpu_probe.table(cpu_probe.read(str(tmp_path)))
  assert lines[2:] == [
    "| `(top level)` | 1 | 4 s | 0 s | 3 s |",
    "| `ops` | 2 | 3 s | 2 s | 0 s |",
    "| all | 3 | 7 s | 3 s | 3 s |",
  ]
