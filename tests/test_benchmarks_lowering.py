"""The accelerator check's GPU code paths lower for CUDA (``jax.export``, no GPU needed), so a
lowering error shows here rather than in the check's run on the device."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn

from aft_jax.model import ModelConfig, TransformerLM
from benchmarks import accelerator_check, bench_model, bench_ops

TRITON = "__gpu$xla.gpu.triton"
CUDNN = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


def _export_cuda(fn, *args, targets=(TRITON,), donate_argnums=()):
  return jax.export.export(
    jax.jit(fn, donate_argnums=donate_argnums),
    platforms=["cuda"],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t) for t in targets],
  )(*args)


def test_cudnn_softmax_row_lowers_for_cuda():
  """The check's softmax_cudnn row (bf16, B 8, T 1024, d 512 in its heads), forward and
  forward+backward. jax asks the installed cuDNN for its version while tracing, so without one
  (a CPU-only jaxlib) it cannot be lowered at all: skipped there, checked where cuDNN is."""
  x = jax.ShapeDtypeStruct((8, 1024, 512), jnp.bfloat16)
  try:
    fwd = _export_cuda(accelerator_check._cudnn, x, x, x, targets=CUDNN)
  except RuntimeError as e:
    if "cuDNN is not detected" in str(e):
      pytest.skip("jax cannot trace cuDNN attention without cuDNN installed")
    raise
  assert CUDNN[0] in fwd.mlir_module()
  bwd = _export_cuda(bench_ops.fwd_bwd(accelerator_check._cudnn), x, x, x, x, targets=CUDNN)
  assert CUDNN[1] in bwd.mlir_module()


@pytest.mark.parametrize("mixing", ["aft_local", "aft_simple"])
def test_lm_train_step_with_kernels_lowers_for_cuda(mixing, monkeypatch):
  """One AdamW step (bench_model.measure_step's, as the check's model rows run it) of a tiny
  bf16 LM with impl="pallas": the kernels inside the model, forward and backward."""
  cfg = dict(vocab_size=64, num_layers=1, d_model=64, num_heads=4, mlp_dim=128, max_len=64)
  cfg.update(window=8, mixing=mixing, dropout_rate=0.0, dtype=jnp.bfloat16, scan_layers=True)
  tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
  # The parameters do not depend on impl: their shapes from the XLA model, on this CPU.
  init = TransformerLM(ModelConfig(**cfg, impl="xla").validate()).init
  params = nn.meta.unbox(jax.eval_shape(init, jax.random.PRNGKey(0), tokens)["params"])
  tx = optax.adamw(1e-4, weight_decay=0.1)
  step = bench_model.make_step(TransformerLM(ModelConfig(**cfg, impl="pallas").validate()), tx)
  # aft_jax.ops refuses impl="pallas" off a GPU backend: trace as if on one.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  opt_state = jax.eval_shape(tx.init, params)
  # Parameters and optimizer state donated, as measure_step compiles it.
  exported = _export_cuda(step, params, opt_state, tokens, tokens, donate_argnums=(0, 1))
  assert exported.mlir_module().count(f"custom_call @{TRITON}(") >= 2  # forward, backward
