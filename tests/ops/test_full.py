"""AFT-full (aft_jax/ops/full.py) against the float64 loop reference, forward and backward. It
runs AFT-local's banded sums with a band of every key (tests/ops/test_local.py tests them at
T = 300, AFT-full among them); it has no kernel."""

import functools

import chex
import pytest
from absl.testing import parameterized

from aft_jax import ops
from tests.support import numpy_reference as ref
from tests.support.op_cases import ATOL, RTOL, grads_check, grads_finite_at_large_logits, qkvw


class MatchesReference(chex.TestCase, parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((False, 1, 1.0), (True, 9, 1.0), (False, 9, 40.0), (True, 9, 40.0))
  def test_xla(self, causal, t_len, scale):
    q, k, v, w = qkvw(0, (2,), t_len, 3, scale)
    fn = self.variant(functools.partial(ops.aft_full, causal=causal))
    chex.assert_trees_all_close(
      fn(q, k, v, w), ref.aft_full(q, k, v, w, causal), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_finite_differences(causal):
  fn = lambda q, k, v, w: ops.aft_full(q, k, v, w, causal=causal)
  grads_check(fn, "qkvw")
  grads_finite_at_large_logits(fn, "qkvw")
