"""AFT-conv (aft_jax/ops/conv.py): the kernel's taps that reach past the input cost nothing."""

import functools

import chex
import jax
import numpy as np
import pytest

from aft_jax import ops
from tests.support import numpy_reference as ref
from tests.support.op_cases import ATOL, RTOL, cotangent, output_and_grads, rand


@pytest.mark.parametrize("causal", [False, True])
def test_taps_that_reach_past_the_sequence_cost_nothing(causal):
  """100,001 taps over T = 5: the cut kernel's output, gradients (0 past T) and flops."""
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
