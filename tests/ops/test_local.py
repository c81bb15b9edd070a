"""AFT-local's banded sums (aft_jax/ops/local.py, AFT-full's too) against float64 references."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from aft_jax import ops
from aft_jax.ops import local
from aft_jax.ops.pallas import triton, triton_local
from tests.support import numpy_reference as ref
from tests.support.helpers import equations
from tests.support.op_cases import (
  ATOL, RTOL, dense_op, qkvw, rand,
)  # fmt: skip


@pytest.mark.parametrize(
  "causal,window,scale",
  [
    (True, 32, 1.0),
    (True, 100, 40.0),
    (False, 50, 40.0),
    (False, 20, 1.0),
    (True, None, 40.0),
    (False, None, 1.0),
  ],
)
def test_banded_long_sequence(causal, window, scale):
  """Several blocks (the last overlapping), row groups recomputed at 40: the dense formulas."""
  t_len = 300
  q, k, v, w = qkvw(20, (2,), t_len, 4, scale)
  if window is None:
    fn = functools.partial(ops.aft_full, causal=causal)
  else:
    fn = functools.partial(ops.aft_local, window=window, causal=causal)

  plan = local.make_plan(t_len, 2 * 4, window or t_len, causal)
  assert plan.nb > 1 and plan.nb * plan.c > t_len, plan  # several blocks, the last overlapping
  rows = lambda x: np.swapaxes(x, 0, 1).reshape(t_len, -1)
  recomputed = jax.jit(lambda k, v, w: local._forward(plan, k, v, w))(rows(k), rows(v), w)[2]
  assert bool(np.any(recomputed)) == (scale > 1.0), recomputed.sum()

  dense = dense_op(window, causal)  # exact: a per-(t, d) maximum
  ct, tk, tv = rand(21, q.shape, q.shape, q.shape)
  (tw,) = rand(22, w.shape)

  @jax.jit
  def run(q, k, v, w, ct, tk, tv, tw):  # the op's values; both modes of the op and of dense
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3))(q, k, v, w)
    jvp = lambda f: jax.jvp(lambda k, v, w: f(q, k, v, w), (k, v, w), (tk, tv, tw))[1]
    return fn(q, k, v, w), (grad(fn), grad(dense)), (jvp(fn), jvp(dense))

  out, (grad_fn, grad_dense), (jvp_fn, jvp_dense) = run(q, k, v, w, ct, tk, tv, tw)
  with jax.enable_x64(True):  # the dense formula in float64 (the loops are too slow here)
    expected = jax.jit(dense)(*(jnp.asarray(x, jnp.float64) for x in (q, k, v, w)))
  chex.assert_trees_all_close(out, expected, rtol=RTOL, atol=ATOL)
  chex.assert_trees_all_close(grad_fn, grad_dense, rtol=1e-3, atol=1e-4)
  np.testing.assert_allclose(jvp_fn, jvp_dense, rtol=1e-3, atol=1e-4 * np.abs(jvp_dense).max())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t_len,window", [(13, 1), (13, 3), (13, 6), (16, 2), (26, 40)])
def test_banded_small_blocks(causal, t_len, window):
  """Blocks of 4 rows: the loop reference, both modes against finite differences (a window over
  every key, causal: 7 blocks, the last overlapping, in two key ranges of 4 and 3 blocks)."""
  plan = local.make_plan(t_len, 3, window, causal, block=4)
  assert plan.nb == -(-t_len // 4)
  with jax.enable_x64(True):
    rng = np.random.default_rng(t_len * 100 + window)
    k, v = (jnp.asarray(rng.normal(size=(t_len, 3)) * 2) for _ in range(2))
    w = jnp.asarray(rng.normal(size=(t_len, t_len)))
    fn = jax.jit(functools.partial(local.banded_mean, plan))
    # The reference's output is sigma(q) * mean: q = +inf gives the mean itself.
    q = np.full((t_len, 3), np.inf)
    expected = ref.aft_local(q, np.asarray(k), np.asarray(v), np.asarray(w), window, causal)
    np.testing.assert_allclose(fn(k, v, w), expected, rtol=1e-10, atol=1e-12)
    check_grads(fn, (k, v, w), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("t_len", [1024, 2048])
def test_causal_full_blocks_read_the_keys_up_to_their_last_row(t_len):
  """AFT-full's causal blocks (4 and 8 of 256 rows) in two scans, each over the keys up to its
  last row, forward and backward; the keys a block's rows have seen: those before its first row
  reduced once, a running max over its c rows only."""
  plan = local.make_plan(t_len, 8, t_len, causal=True)
  x, w = jnp.zeros((t_len, 8)), jnp.zeros((t_len, t_len))
  jaxpr = jax.make_jaxpr(lambda k, v, w: local._forward(plan, k, v, w))(x, x, w).jaxpr
  rows = {e.invars[0].aval.shape[0] for e in equations(jaxpr, "cummax")}
  assert plan.width == t_len > plan.c == 256 and rows == {plan.c}
  loss = lambda k, v, w: jnp.sum(local.banded_mean(plan, k, v, w))
  for fn in (loss, jax.grad(loss, argnums=(0, 1, 2))):
    jaxpr = jax.make_jaxpr(fn)(x, x, w).jaxpr
    shapes = {v.aval.shape for e in equations(jaxpr, "dot_general") for v in e.invars}
    widths = {s[1] for s in shapes if s[0] == plan.c and s[1] >= plan.c}
    assert local.KEY_GROUPS == 2 and widths == {t_len // 2, t_len}, widths


def test_triton_kernel_dw_partials_do_not_grow_with_the_batch():
  """dw's partial sums: one [t_pad, W] per channel block, summed over the batch in the kernel."""
  t_len, d, window = 100, 128, 40  # t_pad 112, W = 16 (ceil(39 / 16) + 1) = 64
  w = jnp.zeros((t_len, t_len))
  for batch in (1, 8):
    k = jnp.zeros((batch, t_len, d))
    cfg = triton.config_for(d, batch)
    loss = lambda k, w: jnp.sum(triton_local.local_mean(k, k, w, window, cfg, True))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(k, w).jaxpr
    shapes = [v.aval.shape for e in equations(jaxpr, "pallas_call") for v in e.outvars]
    assert cfg.block_d == 16  # dk, dv: one program per (batch row, 16 channels)
    assert sorted(s for s in shapes if s[-1] == 64) == [(2, 112, 64)]
    assert shapes.count((batch, 64 - 16 + 112, d)) == 2  # dk, dv (keys' padded layout)


def test_a_symbolic_batch_exports():
  """A symbolic batch (one-row groups): the exported program's values at batch 3."""
  (b,) = jax.export.symbolic_shape("b")
  x, w = jax.ShapeDtypeStruct((b, 12, 3), jnp.float32), jax.ShapeDtypeStruct((12, 12), jnp.float32)
  q, k, v, bias = qkvw(30, (3,), 12, 3, 1.0)
  fn = lambda q, k, v, w: ops.aft_local(q, k, v, w, window=4, causal=True)
  exported = jax.export.export(jax.jit(fn))(x, x, x, w)
  want = ref.aft_local(q, k, v, bias, 4, causal=True)
  np.testing.assert_allclose(exported.call(q, k, v, bias), want, rtol=RTOL, atol=ATOL)
