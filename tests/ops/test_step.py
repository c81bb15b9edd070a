"""The one-token steps of aft_jax.ops (aft_jax/ops/step.py): run over a whole sequence token by
token from their initial state, each gives its op with causal=True on that sequence, in
float32 at logits of std 1 and 40."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import ops

B, T, D, H, C = 2, 11, 3, 2, 3  # T past the window and kernel below: the prefix triple is used
WINDOW, KERNEL = 4, 3
RTOL, ATOL = 2e-4, 2e-5  # as the op tests (tests/ops/test_reference.py)


def _rand(seed, shape, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


def _scan(step, state, *xs):
  """Y [B, T, ...] from ``step(state, *x_t) -> (y_t, state)`` over axis 1 of each x."""

  def body(state, x_t):
    y_t, state = step(state, *x_t)
    return state, y_t

  _, ys = jax.lax.scan(body, state, [jnp.moveaxis(x, 1, 0) for x in xs])
  return jnp.moveaxis(ys, 0, 1)


def _channels(scale):
  q, v = _rand(0, (B, T, D)), _rand(1, (B, T, D))
  k, w = _rand(2, (B, T, D), scale), _rand(3, (T, T), scale)
  return q, k, v, w


def _steps(name, scale):
  """(the steps' output, the op's) for op ``name``."""
  if name == "aft_conv1d":
    q, v = _rand(0, (B, T, H, C)), _rand(1, (B, T, H, C))
    k, kernel = _rand(2, (B, T, H), scale), _rand(3, (H, KERNEL), scale)
    state = ops.aft_conv1d_init((B, H), (B, H, C), KERNEL)
    step = lambda s, q_t, k_t, v_t: ops.aft_conv1d_step(s, q_t, k_t, v_t, kernel)
    return _scan(step, state, q, k, v), ops.aft_conv1d(q, k, v, kernel, causal=True, impl="xla")
  q, k, v, w = _channels(scale)
  t_idx = jnp.broadcast_to(jnp.arange(T), (B, T))  # each step takes row t of w
  if name == "aft_simple":
    got = _scan(ops.aft_simple_step, ops.aft_simple_init((B, D)), q, k, v)
    return got, ops.aft_simple(q, k, v, causal=True, impl="xla")
  if name == "aft_full":
    step = lambda s, q_t, k_t, v_t, t: ops.aft_full_step(s, q_t, k_t, v_t, w[t[0]])
    got = _scan(step, ops.aft_full_init((B, D), T), q, k, v, t_idx)
    return got, ops.aft_full(q, k, v, w, causal=True, impl="xla")
  step = lambda s, q_t, k_t, v_t, t: ops.aft_local_step(s, q_t, k_t, v_t, w[t[0]])
  got = _scan(step, ops.aft_local_init((B, D), WINDOW), q, k, v, t_idx)
  return got, ops.aft_local(q, k, v, w, window=WINDOW, causal=True, impl="xla")


NAMES = ["aft_simple", "aft_full", "aft_local", "aft_conv1d"]


@pytest.mark.parametrize("scale", [1.0, 40.0])
@pytest.mark.parametrize("name", NAMES)
def test_steps_over_a_sequence_are_the_causal_op(name, scale):
  got, want = _steps(name, scale)
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)


def test_steps_keep_the_inputs_dtype():
  q = jnp.zeros((B, D), jnp.bfloat16)
  y, state = ops.aft_simple_step(ops.aft_simple_init((B, D)), q, q, q)
  assert y.dtype == jnp.bfloat16 and state.m.dtype == jnp.float32
