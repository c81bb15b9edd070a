"""Every op against the float64 loop reference; derivatives against finite differences."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from aft_jax import ops
from aft_jax.ops import conv
from tests.support.op_cases import ATOL, RTOL, qkvw, rand, reference


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


@pytest.mark.parametrize(
  "name, kw, args", VALUES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(VALUES)]
)
def test_values(name, kw, args):  # eagerly: one program (tests/ops/test_common.py)
  out = getattr(ops, name)(*args, **kw)
  chex.assert_tree_all_finite(out)
  chex.assert_trees_all_close(out, reference(name, args, kw), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n, scale, causal", [(2, 1.0, True), (5, 40.0, True), (5, 1.0, False)])
def test_conv1d_band_over_several_chunks(n, scale, causal, monkeypatch):
  """AFT-conv1d's in-kernel sum as band products over chunks (causal: T > ``DENSE_MAX_T``, a
  model's long rows) against the reference, and its derivatives against finite differences."""
  monkeypatch.setattr(conv, "DENSE_MAX_T", 4)  # read when traced: a program of its own below
  monkeypatch.setattr(conv, "BAND_CHUNK", 4)  # T = 11 and 7: three and two chunks
  fn = jax.jit(lambda q, k, v, kern: ops.aft_conv1d(q, k, v, kern, causal=causal))
  args = _conv(4, (2,), (11,), (n,), scale)
  chex.assert_trees_all_close(fn(*args), reference("aft_conv1d", args, dict(causal=causal)),
                              rtol=RTOL, atol=ATOL)  # fmt: skip
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(x, jnp.float64) for x in _conv(5, (), (7,), (n,), 2.0, ch=2))
    check_grads(fn, args, order=1, modes=("fwd", "rev"), atol=1e-5, rtol=1e-5)


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


def _args(argnames, seed, k_std, w_std, dtype):
  rng = np.random.default_rng(seed)
  vals = {"q": rng.normal(size=(6, 4)), "k": rng.normal(size=(6, 4)) * k_std}
  vals.update(v=rng.normal(size=(6, 4)), w=rng.normal(size=(6, 6)) * w_std)
  return tuple(jnp.asarray(vals[a], dtype) for a in argnames)


@pytest.mark.parametrize("name", GRADS)
def test_gradients_match_finite_differences(name):
  """Both modes against float64 finite differences; reverse mode finite at logits of std 40."""
  fn, argnames = GRADS[name]
  with jax.enable_x64(True):
    args = _args(argnames, 17, 2.0, 1.0, jnp.float64)
    check_grads(jax.jit(fn), args, order=1, modes=("fwd", "rev"), atol=1e-5, rtol=1e-5)
  args = _args(argnames, 18, 40.0, 40.0, jnp.float32)
  loss = lambda *a: jnp.sum(fn(*a) ** 2)
  grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
