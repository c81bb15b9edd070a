"""Where the suite's CPU goes, per test and per folder: a pytest plugin and its report.

    python3 -m pytest -q -n 2 -p tests.support.cpu_probe   # one JSON file per pytest process
    python3 -m tests.support.cpu_probe [--top N]             # the table of docs/development.md

Files in ``$AFT_CPU_PROBE_DIR`` (default: in the temp dir)."""

import argparse
import collections
import glob
import json
import os
import resource
import sys
import tempfile
import time

import pytest

FOLDER = os.environ.get("AFT_CPU_PROBE_DIR") or f"{tempfile.gettempdir()}/aft_jax_cpu_probe"
_rows = []  # [nodeid, wall s, self CPU s, children CPU s] of this process' tests


def _cpu() -> tuple[float, float]:
  from tests.support import prefork

  own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime + prefork.reaped_cpu


HOST_FILE = "host.stat"  # /proc/stat's cpu line at the session's start and end
_host_start = None


def host_times() -> list[int] | None:
  """/proc/stat's [user, nice, system, idle, iowait, irq, softirq, steal] ticks, or None."""
  try:
    with open("/proc/stat") as f:
      fields = f.readline().split()
  except OSError:
    return None
  return [int(x) for x in fields[1:9]] if fields[:1] == ["cpu"] else None


def pytest_configure(config):
  global _host_start
  if not hasattr(config, "workerinput"):  # the session's first process: last run's files go
    os.makedirs(FOLDER, exist_ok=True)
    for path in glob.glob(f"{FOLDER}/*.json") + glob.glob(f"{FOLDER}/{HOST_FILE}"):
      os.remove(path)
    _host_start = host_times()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  wall, (own, children) = time.monotonic(), _cpu()
  try:
    return (yield)
  finally:
    own_end, children_end = _cpu()
    _rows.append([item.nodeid, time.monotonic() - wall, own_end - own, children_end - children])


def pytest_unconfigure(config):
  end = host_times()
  if _host_start is not None and end is not None:
    with open(os.path.join(FOLDER, HOST_FILE), "w") as f:
      json.dump([_host_start, end], f)
  if _rows:
    name = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(FOLDER, f"{name}.json"), "w") as f:
      json.dump(_rows, f)


def table(rows) -> list[str]:
  """Markdown rows per folder, most CPU first, then the totals."""
  sums = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
  for nodeid, *times in rows:
    parts = nodeid.split("::")[0].split("/")  # tests/ops/test_x.py: "ops"
    s = sums[parts[1] if len(parts) > 2 else "(top level)"]
    s[:] = [s[0] + 1] + [a + b for a, b in zip(s[1:], times)]
  total = [sum(s[i] for s in sums.values()) for i in range(4)]
  lines = [
    "| folder | tests | sum of test times | CPU in pytest's processes | CPU in subprocesses |",
    "|---|---:|---:|---:|---:|",
  ]
  by_cpu = sorted(sums.items(), key=lambda kv: -kv[1][2] - kv[1][3])
  for name, (n, wall, own, children) in by_cpu + [("all", total)]:
    name = name if name == "all" else f"`{name}`"
    lines.append(f"| {name} | {n} | {wall:.0f} s | {own:.0f} s | {children:.0f} s |")
  return lines


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dir", default=FOLDER, help="the plugin's folder (default: %(default)s)")
  p.add_argument("--top", type=int, default=0, help="also the N tests that took the most CPU")
  args = p.parse_args(argv)
  rows = []
  for path in sorted(glob.glob(os.path.join(args.dir, "*.json"))):
    with open(path) as f:
      rows += json.load(f)
  if not rows:
    print(f"no measurements in {args.dir}: run pytest with -p tests.support.cpu_probe first")
    return 1
  print("\n".join(table(rows)))
  for nodeid, wall, own, children in sorted(rows, key=lambda r: -r[2] - r[3])[: args.top]:
    print(f"{own + children:7.1f} CPU-s ({own:.1f} + {children:.1f} in subprocesses) {nodeid}")
  host = os.path.join(args.dir, HOST_FILE)
  if os.path.exists(host):
    with open(host) as f:
      d = [b - a for a, b in zip(*json.load(f))]  # the session's end minus its start
    pct = lambda *i: f"{100 * sum(d[k] for k in i) / (sum(d) or 1):.1f}%"
    busy, idle, stolen = pct(0, 1, 2, 5, 6), pct(3, 4), pct(7)
    print(f"host over the session: busy {busy}, idle {idle}, stolen {stolen} of the cores' time")
  return 0


if __name__ == "__main__":
  sys.exit(main())
