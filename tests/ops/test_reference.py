"""Every op against the float64 loop reference (tests/support/numpy_reference.py), called eagerly
and jitted, and its derivatives (both modes) against finite differences, finite at logits of
std 40. Each op's own paths (blocks, chunks, kernels) are tested in tests/ops/test_<op>.py."""

import functools

import chex
import jax
import pytest

from aft_jax import ops
from tests.support.op_cases import (
  ATOL,
  RTOL,
  grads_check,
  grads_finite_at_large_logits,
  qkvw,
  rand,
  reference,
)


def _conv(seed, lead, spatial, kernel, scale, heads=2, ch=3):
  q, v = rand(seed, lead + spatial + (heads, ch), lead + spatial + (heads, ch))
  k, kern = rand(seed + 1, lead + spatial + (heads,), (heads,) + kernel, scale=scale)
  return q, k, v, kern


# (op, its keyword arguments, its inputs)
VALUES = [
  *[("aft_full", dict(causal=c), qkvw(0, (2,), t, 3, s))
    for c, t, s in ((False, 1, 1.0), (True, 9, 1.0), (False, 9, 40.0), (True, 9, 40.0))],
  *[("aft_local", dict(window=n, causal=c), qkvw(1, (2, 1), 10, 3, s))
    for c, n, s in ((False, 1, 1.0), (True, 1, 40.0), (False, 3, 40.0), (True, 3, 1.0),
                    (True, 3, 40.0), (False, 12, 1.0), (True, 12, 40.0))],
  *[("aft_simple", dict(causal=c), qkvw(2, (3,), 11, 4, s)[:3])
    for c in (False, True) for s in (1.0, 40.0)],
  *[("aft_conv1d", dict(causal=c), _conv(3, (2,), (9,), (n,), s))
    for c, n, s in ((False, 1, 1.0), (False, 3, 40.0), (False, 5, 1.0), (True, 2, 1.0),
                    (True, 3, 40.0))],
  *[("aft_conv2d", {}, _conv(5, (1,), (5, 6), n, s, ch=2))
    for n, s in (((1, 1), 1.0), ((3, 3), 40.0), ((3, 5), 1.0))],
]  # fmt: skip


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
  "name, kw, args", VALUES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(VALUES)]
)
def test_values(name, kw, args, jit):
  fn = functools.partial(getattr(ops, name), **kw)
  out = (jax.jit(fn) if jit else fn)(*args)
  chex.assert_tree_all_finite(out)
  chex.assert_trees_all_close(out, reference(name, args, kw), rtol=RTOL, atol=ATOL)


# name -> (fn of [6, 4] q, k, v and [6, 6] w, the arguments it is differentiated in)
GRADS = {
  **{f"full-{c}": (lambda q, k, v, w, c=c: ops.aft_full(q, k, v, w, causal=c), "qkvw")
     for c in (False, True)},
  **{f"local-{c}": (lambda q, k, v, w, c=c: ops.aft_local(q, k, v, w, window=2, causal=c), "qkvw")
     for c in (False, True)},
  **{f"simple-{c}": (lambda q, k, v, c=c: ops.aft_simple(q, k, v, causal=c), "qkv")
     for c in (False, True)},
  "conv1d": (lambda q, k, v, w: ops.aft_conv1d(
    q.reshape(6, 2, 2), k[:, :2], v.reshape(6, 2, 2), w[:2, :3]), "qkvw"),
  "conv1d-causal": (lambda q, k, v, w: ops.aft_conv1d(
    q.reshape(6, 2, 2), k[:, :2], v.reshape(6, 2, 2), w[:2, :2], causal=True), "qkvw"),
  "conv2d": (lambda q, k, v, w: ops.aft_conv2d(
    q.reshape(2, 3, 2, 2), k[:, :2].reshape(2, 3, 2), v.reshape(2, 3, 2, 2),
    w[:2, :3].reshape(2, 1, 3)), "qkvw"),
}  # fmt: skip


@pytest.mark.parametrize("name", GRADS)
def test_gradients_match_finite_differences(name):
  fn, argnames = GRADS[name]
  grads_check(fn, argnames)
  grads_finite_at_large_logits(fn, argnames)
