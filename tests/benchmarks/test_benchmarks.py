"""The benchmarks' quick modes and parts (no timing assertions); their lowerings for CUDA, TPU."""

import functools
import itertools
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn

from aft_jax import ops
from aft_jax.model import ModelConfig, TransformerLM
from aft_jax.ops import common as ops_common
from aft_jax.ops.pallas import triton
from benchmarks import accelerator_check, before_after, bench_model, bench_ops, common, kernel_form
from benchmarks import context_memory, quality
from tests.support.helpers import TRITON, export_for


def _finite(x):
  return isinstance(x, (int, float)) and math.isfinite(x)


def _quick_result(tmp_path, name):
  result = json.loads((tmp_path / f"{name}.json").read_text())
  for key in ("device_kind", "jax_version", "cpu_count", "platform"):
    assert result["machine"][key] not in (None, ""), key
  for suffix in ("md", "png"):
    assert os.path.getsize(tmp_path / f"{name}.{suffix}") > 0
  return result


def _check_record(rec, fields):
  if rec.get("status") == "skipped":
    assert rec.get("reason"), rec
    return
  assert rec.get("status") == "ok", rec
  for field in fields:
    assert _finite(rec.get(field)), (field, rec)


@pytest.mark.slow
def test_bench_ops_quick(tmp_path):
  bench_ops.main(["--quick", "--out", str(tmp_path)])
  result = _quick_result(tmp_path, "bench_ops")
  sizes = result["machine"]["sizes"]
  names = list(bench_ops.op_table(7))
  assert sorted(result["ops"]) == sorted(names)
  got = {(r["op"], r["mode"], r["T"]): r for r in result["records"]}
  for name, mode, t_len in itertools.product(names, bench_ops.MODES, sizes):
    if mode == "fwd" or name not in bench_ops.FWD_ONLY:
      _check_record(got[(name, mode, t_len)], bench_ops.FIELDS)
  assert len(result["checks"]) == 9


def test_before_after_quick_measures_each_tree_in_its_own_process(tmp_path):
  """This tree against itself: each row's subprocess imported aft_jax from its tree."""
  before_after.main(["--before", before_after.HERE, "--quick", "--out", str(tmp_path)])
  result = json.loads((tmp_path / "before_after.json").read_text())
  assert result["machine"]["trees"]["before"] == before_after.HERE
  for rec in result["records"]:
    for name in ("before", "after", before_after.PEER):
      _check_record(rec[name], ("time_s", "temp_bytes"))
    assert rec["before"]["aft_jax"] == os.path.join(before_after.HERE, "aft_jax")
  table = (tmp_path / "before_after.md").read_text()
  assert len(table.strip().splitlines()) == 2 + len(result["records"])


@pytest.mark.slow
def test_bench_model_quick(tmp_path):
  bench_model.main(["--quick", "--sizes", "32", "--out", str(tmp_path)])
  result = _quick_result(tmp_path, "bench_model")
  info = result["machine"]
  got = {(r["mixing"], r["T"]): r for r in result["records"]}
  assert set(result["mixings"]) == set(bench_model.MIXINGS)
  for key in itertools.product(bench_model.MIXINGS, info["sizes"]):
    _check_record(got[key], bench_model.FIELDS)
  ratios = result["ratios_to_softmax"][str(info["sizes"][0])]
  assert set(ratios) == set(bench_model.MIXINGS)
  assert all(_finite(v) for x in ratios.values() for v in x.values()), ratios


def test_flop_count_multiplies_loops_and_matches_xla_without_them():
  count = common.count_flops
  a, b = jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 4), jnp.float32)
  matmul = 2 * 8 * 16 * 4
  assert count(jnp.matmul, a, b) == matmul

  def loop(a, b):
    return jax.lax.scan(lambda c, _: (c + a @ b, None), jnp.zeros((8, 4)), None, length=10)[0]

  assert count(loop, a, b) == 10 * (matmul + 8 * 4)  # XLA would count one trip

  def branch(p, a, b):  # the first (false) branch is counted
    return jax.lax.cond(p, lambda: jnp.exp(a) @ b, lambda: a @ b)

  assert count(branch, True, a, b) == matmul

  # A loop's gradient over slices of w: a trip costs the slice, not the accumulator.
  def sliced(w):
    body = lambda c, b: (c + jnp.sum(jnp.sin(jax.lax.dynamic_slice(w, (8 * b, 0), (8, 16)))), None)
    return jax.lax.scan(body, 0.0, jnp.arange(8))[0]

  w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  assert count(jax.grad(sliced), w) < 8 * 8 * 16 * 8  # vs 8 * 64 * 64 counted naively

  # A loop-free program: XLA's count within 5%.
  x = jax.ShapeDtypeStruct((1, 256, 64), jnp.float32)
  fwd = bench_ops._softmax_einsum
  cost = jax.jit(fwd).lower(x, x, x).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert abs(count(fwd, x, x, x) / cost["flops"] - 1) < 0.05


def test_accelerator_check_times_both_kernel_forms_and_takes_the_faster_aft_local():
  """GPU rows per kernel form, the faster form per row; the LM targets' AFT-local and impl."""
  rows = accelerator_check.op_rows("pallas", "gpu")
  forms = accelerator_check.KERNEL_FORMS
  for op in accelerator_check.KERNEL_OPS:
    assert {f"{op}/pallas[{f}]" for f in forms} <= set(rows), sorted(rows)
  assert not any("[" in n for n in accelerator_check.op_rows("pallas_interpret", "cpu"))
  seg = lambda: triton.plan_for(1, 16384, 512).seg
  assert kernel_form.forced("sequential")(seg)() is None
  assert kernel_form.forced("chunked")(seg)() == seg() is not None  # auto: chunked here
  rec = lambda form, t, time_s: dict(op=f"aft_simple/pallas[{form}]", mode="fwd", T=t,
                                     status="ok", time_s=time_s)  # fmt: skip
  recs = [rec("sequential", 1024, 1.0), rec("chunked", 1024, 2.0), rec("chunked", 4096, 1.0)]
  recs.append(rec("sequential", 4096, 3.0))
  got = accelerator_check.kernel_forms(recs)
  assert [(r["T"], r["faster"]) for r in got] == [(1024, "sequential"), (4096, "chunked")]
  assert "| aft_simple | fwd | 4096 |" in "\n".join(accelerator_check._form_lines(recs))
  lm = lambda name, t, impl="auto": dict(model=name, status="ok", impl=impl, time_s=t,
                                         tokens_per_s=1000 / t, program_bytes=100 * t)  # fmt: skip
  models = [lm("lm/aft_local", 2.0), lm("lm/aft_local/xla", 1.0), lm("lm/softmax", 2.0, "cudnn")]
  checks = {c["check"]: c for c in accelerator_check.target_checks([], models)}
  speed = checks["LM tokens/s aft_local[xla] / softmax[cudnn]"]
  assert speed["value"] == pytest.approx(2.0) and speed["holds"]
  memory = checks["LM program memory (params + optimizer state + batch + activations) "
                  "aft_local[xla] / softmax[cudnn]"]  # fmt: skip
  assert memory["value"] == pytest.approx(0.5) and memory["holds"]


def _raise(*args, error=RuntimeError("injected failure"), **kwargs):
  raise error


def _is_injected(rec):
  assert rec["status"] == "error" and rec["reason"] == "RuntimeError: injected failure", rec
  return True


@pytest.mark.slow
def test_accelerator_check_quick_records_failures_and_goes_on(tmp_path, monkeypatch):
  """Injected failures: the cumsum row, the bfloat16 kernel check, the softmax LM's step."""
  op_rows, aft_simple = accelerator_check.op_rows, ops.aft_simple
  measure_step = bench_model.measure_step

  def failing_rows(*args):
    rows = op_rows(*args)
    rows["cumsum"] = (_raise,) + rows["cumsum"][1:]
    return rows

  def failing_bf16(q, *args, **kwargs):
    return (_raise if q.dtype == jnp.bfloat16 else aft_simple)(q, *args, **kwargs)

  def failing_softmax(cfg, *args):
    return (_raise if cfg.mixing == "softmax" else measure_step)(cfg, *args)

  monkeypatch.setattr(accelerator_check, "op_rows", failing_rows)
  monkeypatch.setattr(ops, "aft_simple", failing_bf16)
  monkeypatch.setattr(bench_model, "measure_step", failing_softmax)
  accelerator_check.main(["--quick", "--out", str(tmp_path)])
  result = json.loads((tmp_path / "accelerator_check.json").read_text())
  assert result["complete"] and not result["errors"]
  assert result["machine"]["kernel_impl"] == "pallas_interpret"  # CPU: the kernels interpreted
  ops_run = {r["op"] for r in result["records"]}
  assert {"aft_simple/xla", "aft_simple/pallas", "cumsum", "softmax_dpa"} <= ops_run
  for rec in result["records"]:
    if rec["op"] == "cumsum":
      _is_injected(rec)
    else:
      _check_record(rec, bench_ops.FIELDS + ("achieved_gbps",))
  models = {r["model"]: r for r in result["model"]}
  assert set(models) >= {"lm/aft_local", "lm/softmax", "wikitext103_small/aft_local"}
  for name, rec in models.items():
    if name == "lm/softmax":
      _is_injected(rec)
      continue
    _check_record(rec, bench_model.FIELDS)
    # donated parameters and optimizer state: not counted again
    assert rec["program_bytes"] < rec["argument_bytes"] + rec["temp_bytes"] + 1024, rec
  kchecks = {c["dtype"]: c for c in result["kernel_checks"]}
  assert kchecks["float32"]["holds"] and _is_injected(kchecks["bfloat16"])
  assert kchecks["bfloat16"]["holds"] is None and kchecks["bfloat16"]["max_rel_error"] is None
  assert len({c["check"].split(",")[0] for c in result["checks"]}) == 5
  for c in result["checks"]:
    needs_failed = "cumsum" in c["check"] or c["check"].startswith("LM")
    assert (c["value"] is None) == (needs_failed or "softmax_cudnn" in c["check"]), c
    if c["value"] is None:
      assert c["holds"] is None and c["note"] == "not measured"
  md = (tmp_path / "accelerator_check.md").read_text()
  assert "| cumsum | fwd | 32 | error: RuntimeError: injected failure |" in md
  assert "| lm/softmax | 32 | 1 | error: RuntimeError: injected failure |" in md
  assert "| aft_simple causal | bfloat16 | 1 | error: RuntimeError: injected failure |" in md
  assert "LM tokens/s aft_local / softmax: not measured" in md and "Partial" not in md
  assert os.path.getsize(tmp_path / "accelerator_check.png") > 0


def test_accelerator_check_writes_partial_results(tmp_path, monkeypatch):
  """Stopped in the model rows (as a kill at a time limit): what it measured, incomplete."""
  kchecks = [{"kernel": "k", "dtype": "float32", "logit_std": 1.0, "tolerance": 1e-4}]
  kchecks[0].update(status="ok", max_rel_error=0.0, holds=True)
  monkeypatch.setattr(accelerator_check, "kernel_checks", lambda *args: kchecks)
  table = bench_ops.op_table(7, "xla")
  monkeypatch.setattr(accelerator_check, "op_rows", lambda *args: {"cumsum": table["cumsum"]})
  interrupt = functools.partial(_raise, error=KeyboardInterrupt())
  monkeypatch.setattr(bench_model, "measure_step", interrupt)
  with pytest.raises(KeyboardInterrupt):
    accelerator_check.main(["--quick", "--out", str(tmp_path)])
  result = json.loads((tmp_path / "accelerator_check.json").read_text())
  assert result["complete"] is False and result["model"] == []
  assert result["kernel_checks"] == kchecks
  assert [(r["op"], r["status"]) for r in result["records"]] == [("cumsum", "ok")]
  assert "Partial" in (tmp_path / "accelerator_check.md").read_text()
  assert not (tmp_path / "accelerator_check.png").exists()
  assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # atomic writes: no leftovers


def test_bench_ops_records_a_failing_size_and_stops_growing_t():
  table = {"fails": (_raise, None, "linear", "raises"), "cumsum": bench_ops.op_table(7)["cumsum"]}
  kw = dict(batch=1, d=8, conv_kernel=7, repeats=1, min_seconds=0.0, max_call_s=1.0)
  kw.update(names=["fails", "cumsum"], max_temp_gib=1.0, table=table, log=lambda s: None)
  recs = bench_ops.run([8, 16], **kw)
  got = {(r["op"], r["mode"], r["T"]): r for r in recs}
  for mode in bench_ops.MODES:
    assert _is_injected(got[("fails", mode, 8)])
    want = dict(op="fails", mode=mode, T=16, batch=1, d=8, status="skipped", reason="error at T=8")
    assert got[("fails", mode, 16)] == want
  assert got[("cumsum", "fwd", 16)]["status"] == "ok"  # the next op is measured
  md = bench_ops.markdown(recs, [8, 16], ["fails", "cumsum"], {"batch": 1, "d": 8})
  assert "| fails | error | skipped |" in md


def test_context_memory_step_runs_two_steps_and_reports_time_and_memory():
  r = context_memory.step("aft_simple", 64)
  assert r["T"] == 64 and r["finite"] and math.isfinite(r["loss"])
  assert r["step_s"] > 0 and r["first_step_s"] >= r["step_s"] and r["peak_rss_gib"] > 0


def test_quality_quick_writes_the_table_and_curves(tmp_path):
  # Two mixings: each costs a compile, and all train in tests/e2e/test_recipes.py.
  mixings = ["softmax", "aft_simple"]
  quality.main(["--quick", "--out", str(tmp_path), "--mixings", *mixings])
  result = json.loads((tmp_path / "quality.json").read_text())
  assert [r["mixing"] for r in result["records"]] == mixings
  for r in result["records"]:
    for key in ("valid_bpb", "test_bpb", "tokens_per_s", "wall_s"):
      assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
    assert r["num_params"] > 0 and r["steps"] == result["settings"]["num_train_steps"]
    assert r["curve"][-1] == [r["steps"], r["valid_bpb"]]  # the curve ends at the final number
  md = (tmp_path / "quality.md").read_text()
  assert all(f"| {m} |" in md for m in mixings) and "| +0.0000 |" in md  # softmax: the base
  assert os.path.getsize(tmp_path / "quality.png") > 0


# ---------------------------------------------------- lowered for the accelerators, on this CPU

CUDNN = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


@pytest.fixture
def cudnn_h200(monkeypatch):
  """cuDNN attention's version questions answered as an H200's (9.0, cuDNN 9.10)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa

  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  version = lambda c: tuple(int(x) for x in c.split("."))
  monkeypatch.setattr(fa, "check_compute_capability", lambda c: version(c) <= (9, 0))
  monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda c: version(c) == (9, 0))


def test_cudnn_softmax_row_lowers_for_cuda(cudnn_h200):
  """The check's softmax_cudnn row (bf16, B 8, T 1024, d 512), forward and backward."""
  x = jax.ShapeDtypeStruct((8, 1024, 512), jnp.bfloat16)
  bwd = export_for(bench_ops.fwd_bwd(accelerator_check._cudnn), x, x, x, x, calls=CUDNN)
  assert all(call in bwd.mlir_module() for call in CUDNN)


LOWERINGS = [("aft_local", "pallas", "cuda"), ("aft_simple", "pallas", "cuda"),
             ("softmax", "cudnn", "cuda"), ("aft_simple", "pallas", "tpu")]  # fmt: skip


@pytest.mark.parametrize("mixing, impl, platform", LOWERINGS)
def test_lm_train_step_lowers(mixing, impl, platform, monkeypatch, cudnn_h200):
  """The model rows' AdamW step of a tiny bf16 LM, the accelerator's mixing implementation."""
  cfg = dict(vocab_size=64, num_layers=1, d_model=128, num_heads=4, mlp_dim=128, max_len=64)
  cfg.update(window=8, mixing=mixing, dropout_rate=0.0, dtype=jnp.bfloat16, scan_layers=True)
  tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
  # The parameters do not depend on impl: their shapes from the XLA model, on this CPU.
  init = TransformerLM(ModelConfig(**cfg, impl="xla").validate()).init
  params = nn.meta.unbox(jax.eval_shape(init, jax.random.PRNGKey(0), tokens)["params"])
  tx = optax.adamw(1e-4, weight_decay=0.1)
  step = bench_model.make_step(TransformerLM(ModelConfig(**cfg, impl=impl).validate()), tx)
  # Traced as if on the target (cuDNN attention refuses an abstract device that would say so).
  device = {"cuda": ops.DeviceFacts("gpu", "NVIDIA H200", (9, 0)),
            "tpu": ops.DeviceFacts("tpu", "TPU v5 lite")}[platform]  # fmt: skip
  for module in (ops, ops_common):  # (the layers' cuDNN check, the ops' choice)
    monkeypatch.setattr(module, "device_facts", lambda: device)
  opt_state = jax.eval_shape(tx.init, params)
  calls = {"cuda": CUDNN if impl == "cudnn" else (TRITON,), "tpu": ()}[platform]
  args = (params, opt_state, tokens, tokens)
  exported = export_for(step, *args, platform=platform, calls=calls, donate_argnums=(0, 1))
  module = exported.mlir_module()
  kernel = {"cudnn": None, "pallas": TRITON if platform == "cuda" else "tpu_custom_call"}[impl]
  if kernel:
    assert module.count(f"custom_call @{kernel}(") >= 2  # forward, backward
  else:
    assert all(t in module for t in CUDNN)


@pytest.mark.parametrize("op", accelerator_check.KERNEL_OPS[::2])
def test_kernel_form_rows_lower_for_cuda(op):
  """Each GPU kernel form's rows: sequential grids (b, d blocks, 1), chunked (b, d, segments)."""
  rows = accelerator_check.op_rows("pallas", "gpu")
  x = jax.ShapeDtypeStruct((8, 1024, 512), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
  args = (x, x, x) if rows[f"{op}/pallas"][1] is None else (x, x, x, w)
  z = {}
  for form in accelerator_check.KERNEL_FORMS:
    fn = bench_ops.fwd_bwd(rows[f"{op}/pallas[{form}]"][0])
    module = export_for(fn, *args, x).mlir_module()
    z[form] = sorted({int(g) for g in re.findall(r"grid_z = (\d+)", module)})
  assert z["sequential"] == [1], z
  assert max(z["chunked"]) > 1, z
