"""The accelerator check's code paths lower for CUDA (the TPU kernel's for TPU) with
``jax.export``: a lowering error shows here, not on the device."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn

from aft_jax.model import ModelConfig, TransformerLM
from aft_jax import ops
from aft_jax.ops import common
from benchmarks import accelerator_check, bench_model, bench_ops
from tests.support.helpers import TRITON, export_for

CUDNN = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


@pytest.fixture
def cudnn_h200(monkeypatch):
  """jax's cuDNN attention asks cuDNN and the GPU for their versions while tracing: answered
  as an H200 would (compute capability 9.0, cuDNN 9.10), jax's own checks included."""
  from jax._src.cudnn import fused_attention_stablehlo as fa

  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  version = lambda c: tuple(int(x) for x in c.split("."))
  monkeypatch.setattr(fa, "check_compute_capability", lambda c: version(c) <= (9, 0))
  monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda c: version(c) == (9, 0))


def test_cudnn_softmax_row_lowers_for_cuda(cudnn_h200):
  """The check's softmax_cudnn row (bf16, B 8, T 1024, d 512), forward and backward."""
  x = jax.ShapeDtypeStruct((8, 1024, 512), jnp.bfloat16)
  fwd = export_for(accelerator_check._cudnn, x, x, x, calls=CUDNN)
  assert CUDNN[0] in fwd.mlir_module()
  bwd = export_for(bench_ops.fwd_bwd(accelerator_check._cudnn), x, x, x, x, calls=CUDNN)
  assert CUDNN[1] in bwd.mlir_module()


LOWERINGS = [("aft_local", "pallas", "cuda"), ("aft_simple", "pallas", "cuda"),
             ("softmax", "cudnn", "cuda"), ("aft_simple", "pallas", "tpu")]  # fmt: skip


@pytest.mark.parametrize("mixing, impl, platform", LOWERINGS)
def test_lm_train_step_lowers(mixing, impl, platform, monkeypatch, cudnn_h200):
  """The check's model rows' AdamW step (bench_model's) of a tiny bf16 LM with the
  accelerator's implementation of its mixing layer."""
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
  for module in (ops, common):  # (the layers' cuDNN check, the ops' choice)
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
  """The check's rows of each GPU kernel form lower in that form: sequential grids (batch,
  channel blocks, 1), chunked ones with the segments as their third axis."""
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
