"""AFT-conv (aft_jax/ops/conv.py), 1-D and 2-D, against the float64 loop reference, forward and
backward (it has no kernel: XLA only)."""

import functools

import chex
import jax
import numpy as np
import pytest
from absl.testing import parameterized

from aft_jax import ops
from tests.support import numpy_reference as ref
from tests.support.op_cases import (
  ATOL,
  RTOL,
  cotangent,
  grads_check,
  grads_finite_at_large_logits,
  output_and_grads,
  rand,
)


class MatchesReference(chex.TestCase, parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(
    (False, 1, 1.0), (False, 3, 40.0), (False, 5, 1.0), (True, 2, 1.0), (True, 3, 40.0)
  )
  def test_conv1d(self, causal, size, scale):
    t_len, heads, ch = 9, 2, 3
    q, v = rand(3, (2, t_len, heads, ch), (2, t_len, heads, ch))
    k, kernel = rand(4, (2, t_len, heads), (heads, size), scale=scale)
    fn = self.variant(functools.partial(ops.aft_conv1d, causal=causal))
    chex.assert_trees_all_close(
      fn(q, k, v, kernel), ref.aft_conv1d(q, k, v, kernel, causal), rtol=RTOL, atol=ATOL
    )

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(((1, 1), 1.0), ((3, 3), 40.0), ((3, 5), 1.0))
  def test_conv2d(self, ksize, scale):
    ht, wd, heads, ch = 5, 6, 2, 2
    q, v = rand(5, (1, ht, wd, heads, ch), (1, ht, wd, heads, ch))
    k, kernel = rand(6, (1, ht, wd, heads), (heads,) + ksize, scale=scale)
    fn = self.variant(ops.aft_conv2d)
    chex.assert_trees_all_close(
      fn(q, k, v, kernel), ref.aft_conv2d(q, k, v, kernel), rtol=RTOL, atol=ATOL
    )


GRAD_CASES = {
  "conv1d": lambda q, k, v, w: ops.aft_conv1d(
    q.reshape(6, 2, 2), k[:, :2], v.reshape(6, 2, 2), w[:2, :3]
  ),
  "conv1d_causal": lambda q, k, v, w: ops.aft_conv1d(
    q.reshape(6, 2, 2), k[:, :2], v.reshape(6, 2, 2), w[:2, :2], causal=True
  ),
  "conv2d": lambda q, k, v, w: ops.aft_conv2d(
    q.reshape(2, 3, 2, 2),
    k[:, :2].reshape(2, 3, 2),
    v.reshape(2, 3, 2, 2),
    w[:2, :3].reshape(2, 1, 3),
  ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_gradients_match_finite_differences(name):
  grads_check(GRAD_CASES[name], "qkvw")
  grads_finite_at_large_logits(GRAD_CASES[name], "qkvw")


@pytest.mark.parametrize("causal", [False, True])
def test_taps_that_reach_past_the_sequence_cost_nothing(causal):
  """A kernel of 100,001 taps over T = 5: those that reach no position multiply no key, so the
  output and gradients are those of the kernel cut to the taps that can (the first T causal,
  the centre +- (T - 1) otherwise), the others' gradients 0, and the compiled program does the
  cut kernel's flops."""
  t_len, heads, ch, wide = 5, 2, 3, 100_001
  q, v = rand(3, (2, t_len, heads, ch), (2, t_len, heads, ch))
  k, kernel = rand(4, (2, t_len, heads), (heads, wide))
  cut = slice(0, t_len) if causal else slice(wide // 2 - t_len + 1, wide // 2 + t_len)
  run = jax.jit(output_and_grads(functools.partial(ops.aft_conv1d, causal=causal)))
  ct = cotangent(q.shape)
  whole, part = (run.lower(q, k, v, w, ct).compile() for w in (kernel, kernel[:, cut]))
  assert whole.cost_analysis()["flops"] == part.cost_analysis()["flops"]
  out, grads = whole(q, k, v, kernel, ct)
  out_cut, grads_cut = part(q, k, v, kernel[:, cut], ct)
  chex.assert_trees_all_equal((out, grads[:3]), (out_cut, grads_cut[:3]))
  want = np.zeros_like(kernel)
  want[:, cut] = grads_cut[3]
  np.testing.assert_array_equal(grads[3], want)
  chex.assert_trees_all_close(out, ref.aft_conv1d(q, k, v, kernel, causal), rtol=RTOL, atol=ATOL)
