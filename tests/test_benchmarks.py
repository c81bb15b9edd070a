"""The benchmarks' quick modes run and write complete results (no timing assertions)."""

import json
import math
import os


from benchmarks import accelerator_check, bench_model, bench_ops


def _finite(x):
  return isinstance(x, (int, float)) and math.isfinite(x)


def _check_record(rec, fields):
  if rec.get("status") == "skipped":
    assert rec.get("reason"), rec
    return
  assert rec.get("status") == "ok", rec
  for field in fields:
    assert _finite(rec.get(field)), (field, rec)


def test_bench_ops_quick(tmp_path):
  bench_ops.main(["--quick", "--out", str(tmp_path)])
  result = json.loads((tmp_path / "bench_ops.json").read_text())
  info = result["machine"]
  for key in ("device_kind", "jax_version", "cpu_count", "platform"):
    assert info[key] not in (None, ""), key
  sizes = info["sizes"]
  names = list(bench_ops.op_table(7))
  assert sorted(result["ops"]) == sorted(names)
  got = {(r["op"], r["mode"], r["T"]): r for r in result["records"]}
  for name in names:
    for mode in bench_ops.MODES:
      if name == "cumsum" and mode == "fwd_bwd":
        continue
      for t_len in sizes:
        _check_record(got[(name, mode, t_len)], bench_ops.FIELDS)
  assert len(result["checks"]) == 7
  for name in ("bench_ops.md", "bench_ops.png"):
    assert os.path.getsize(tmp_path / name) > 0


def test_bench_model_quick(tmp_path):
  bench_model.main(["--quick", "--sizes", "32", "--out", str(tmp_path)])
  result = json.loads((tmp_path / "bench_model.json").read_text())
  info = result["machine"]
  for key in ("device_kind", "jax_version", "cpu_count", "platform"):
    assert info[key] not in (None, ""), key
  got = {(r["mixing"], r["T"]): r for r in result["records"]}
  assert set(result["mixings"]) == set(bench_model.MIXINGS)
  for mixing in bench_model.MIXINGS:
    for t_len in info["sizes"]:
      _check_record(got[(mixing, t_len)], bench_model.FIELDS)
  ratios = result["ratios_to_softmax"][str(info["sizes"][0])]
  assert set(ratios) == set(bench_model.MIXINGS)
  for x in ratios.values():
    assert all(_finite(v) for v in x.values()), x
  for name in ("bench_model.md", "bench_model.png"):
    assert os.path.getsize(tmp_path / name) > 0


def test_flop_count_multiplies_loops_and_matches_xla_without_them():
  import jax
  import jax.numpy as jnp
  from benchmarks import flops

  a = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  b = jax.ShapeDtypeStruct((16, 4), jnp.float32)
  matmul = 2 * 8 * 16 * 4
  assert flops.count(jnp.matmul, a, b) == matmul

  def loop(a, b):
    return jax.lax.scan(lambda c, _: (c + a @ b, None), jnp.zeros((8, 4)), None, length=10)[0]

  assert flops.count(loop, a, b) == 10 * (matmul + 8 * 4)  # XLA would count one trip

  def branch(p, a, b):  # the first (false) branch is counted
    return jax.lax.cond(p, lambda: jnp.exp(a) @ b, lambda: a @ b)

  assert flops.count(branch, True, a, b) == matmul

  # The gradient of a loop over slices of w accumulates each slice's cotangent in place: a
  # trip costs the slice (8 x 16), not the accumulator (64 x 64).
  def sliced(w):
    body = lambda c, b: (c + jnp.sum(jnp.sin(jax.lax.dynamic_slice(w, (8 * b, 0), (8, 16)))), None)
    return jax.lax.scan(body, 0.0, jnp.arange(8))[0]

  w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  assert flops.count(jax.grad(sliced), w) < 8 * 8 * 16 * 8  # vs 8 * 64 * 64 counted naively

  # A loop-free program: the same count as XLA's cost analysis (within 5%).
  x = jax.ShapeDtypeStruct((1, 256, 64), jnp.float32)
  fwd = bench_ops._softmax_einsum
  cost = jax.jit(fwd).lower(x, x, x).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert abs(flops.count(fwd, x, x, x) / cost["flops"] - 1) < 0.05


def test_accelerator_check_quick(tmp_path):
  accelerator_check.main(["--quick", "--out", str(tmp_path)])
  result = json.loads((tmp_path / "accelerator_check.json").read_text())
  assert result["machine"]["kernel_impl"] == "pallas_interpret"  # CPU: the kernels interpreted
  ops = {r["op"] for r in result["records"]}
  assert {"aft_simple/xla", "aft_simple/pallas", "cumsum"} <= ops
  for rec in result["records"]:
    _check_record(rec, bench_ops.FIELDS + ("achieved_gbps",))
  assert {r["model"] for r in result["model"]} >= {"lm/aft_local", "wikitext103_small/aft_local"}
  for rec in result["model"]:
    _check_record(rec, bench_model.FIELDS)
  assert result["kernel_checks"] and all(c["holds"] for c in result["kernel_checks"])
  assert len(result["checks"]) == 5
  for name in ("accelerator_check.md", "accelerator_check.png"):
    assert os.path.getsize(tmp_path / name) > 0
