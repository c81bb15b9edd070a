"""aft_jax.ops against the float64 loop reference in numpy_reference.py."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.test_util import check_grads

from aft_jax import ops
from aft_jax.ops import banded, causal_mean
from tests.support import numpy_reference as ref
from tests.support.helpers import equations

# Output values are weighted averages of v ~ N(0, 1): 2e-4 relative, with a small absolute floor
# for outputs that happen to be near 0.
RTOL, ATOL = 2e-4, 2e-5


def _rand(seed, *shapes, scale=1.0):
  rng = np.random.default_rng(seed)
  return [np.asarray(rng.normal(size=s) * scale, np.float32) for s in shapes]


def _qkvw(seed, lead, t_len, d, scale):
  q, v = _rand(seed, lead + (t_len, d), lead + (t_len, d))
  k, w = _rand(seed + 1, lead + (t_len, d), (t_len, t_len), scale=scale)
  return q, k, v, w


class OpsMatchReference(chex.TestCase, parameterized.TestCase):
  """Every op, causal and not, several sizes and batch dims, with and without jit."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((False, 1, 1.0), (True, 9, 1.0), (False, 9, 40.0), (True, 9, 40.0))
  def test_full(self, causal, t_len, scale):
    q, k, v, w = _qkvw(0, (2,), t_len, 3, scale)
    fn = self.variant(functools.partial(ops.aft_full, causal=causal))
    chex.assert_trees_all_close(
      fn(q, k, v, w), ref.aft_full(q, k, v, w, causal), rtol=RTOL, atol=ATOL
    )

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(
    (False, 1, 1.0),
    (True, 1, 40.0),
    (False, 3, 40.0),
    (True, 3, 1.0),
    (True, 3, 40.0),
    (False, 12, 1.0),
    (True, 12, 40.0),
  )
  def test_local(self, causal, window, scale):
    q, k, v, w = _qkvw(1, (2, 1), 10, 3, scale)
    fn = self.variant(functools.partial(ops.aft_local, window=window, causal=causal))
    out = fn(q, k, v, w)
    chex.assert_tree_all_finite(out)
    chex.assert_trees_all_close(
      out, ref.aft_local(q, k, v, w, window, causal), rtol=RTOL, atol=ATOL
    )

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(causal=[False, True], scale=[1.0, 40.0])
  def test_simple(self, causal, scale):
    q, k, v, _ = _qkvw(2, (3,), 11, 4, scale)
    fn = self.variant(functools.partial(ops.aft_simple, causal=causal))
    chex.assert_trees_all_close(fn(q, k, v), ref.aft_simple(q, k, v, causal), rtol=RTOL, atol=ATOL)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(
    (False, 1, 1.0), (False, 3, 40.0), (False, 5, 1.0), (True, 2, 1.0), (True, 3, 40.0)
  )
  def test_conv1d(self, causal, size, scale):
    t_len, heads, ch = 9, 2, 3
    q, v = _rand(3, (2, t_len, heads, ch), (2, t_len, heads, ch))
    k, kernel = _rand(4, (2, t_len, heads), (heads, size), scale=scale)
    fn = self.variant(functools.partial(ops.aft_conv1d, causal=causal))
    chex.assert_trees_all_close(
      fn(q, k, v, kernel), ref.aft_conv1d(q, k, v, kernel, causal), rtol=RTOL, atol=ATOL
    )

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(((1, 1), 1.0), ((3, 3), 40.0), ((3, 5), 1.0))
  def test_conv2d(self, ksize, scale):
    ht, wd, heads, ch = 5, 6, 2, 2
    q, v = _rand(5, (1, ht, wd, heads, ch), (1, ht, wd, heads, ch))
    k, kernel = _rand(6, (1, ht, wd, heads), (heads,) + ksize, scale=scale)
    fn = self.variant(ops.aft_conv2d)
    chex.assert_trees_all_close(
      fn(q, k, v, kernel), ref.aft_conv2d(q, k, v, kernel), rtol=RTOL, atol=ATOL
    )


class Identities(parameterized.TestCase):
  @parameterized.parameters(False, True)
  def test_local_with_wide_window_is_full(self, causal):
    q, k, v, w = _qkvw(7, (2,), 12, 5, 3.0)
    chex.assert_trees_all_close(
      ops.aft_local(q, k, v, w, window=12, causal=causal),
      ops.aft_full(q, k, v, w, causal=causal),
      rtol=1e-5,
      atol=1e-6,
    )
    chex.assert_trees_all_close(
      ops.aft_local(q, k, v, w, window=50, causal=causal),
      ops.aft_full(q, k, v, w, causal=causal),
      rtol=1e-5,
      atol=1e-6,
    )

  @parameterized.parameters(False, True)
  def test_local_with_zero_bias_is_simple(self, causal):
    q, k, v, _ = _qkvw(8, (2,), 12, 5, 3.0)
    w = np.zeros((12, 12), np.float32)
    chex.assert_trees_all_close(
      ops.aft_local(q, k, v, w, window=3, causal=causal),
      ops.aft_simple(q, k, v, causal=causal),
      rtol=1e-5,
      atol=1e-6,
    )

  @parameterized.parameters(False, True)
  def test_conv1d_with_zero_kernel_is_simple_per_head(self, causal):
    q, v = _rand(9, (2, 8, 2, 3), (2, 8, 2, 3))
    (k,) = _rand(10, (2, 8, 2), scale=3.0)
    out = ops.aft_conv1d(q, k, v, np.zeros((2, 3), np.float32), causal=causal)
    k_full = np.broadcast_to(k[..., None], q.shape)
    flat = lambda x: x.reshape(2, 8, 6)
    chex.assert_trees_all_close(
      out,
      ops.aft_simple(flat(q), flat(k_full), flat(v), causal=causal).reshape(q.shape),
      rtol=1e-5,
      atol=1e-6,
    )

  def test_vmap_equals_batched_call(self):
    q, k, v, w = _qkvw(11, (3,), 8, 4, 2.0)
    qc, vc = _rand(12, (3, 8, 2, 2), (3, 8, 2, 2))
    kc, kern = _rand(13, (3, 8, 2), (2, 3))
    q2, v2 = _rand(14, (3, 4, 5, 2, 2), (3, 4, 5, 2, 2))
    k2, kern2 = _rand(15, (3, 4, 5, 2), (2, 3, 3))
    cases = [
      (lambda q, k, v: ops.aft_full(q, k, v, w, causal=True), (q, k, v)),
      (lambda q, k, v: ops.aft_local(q, k, v, w, window=2), (q, k, v)),
      (lambda q, k, v: ops.aft_simple(q, k, v, causal=True), (q, k, v)),
      (lambda q, k, v: ops.aft_conv1d(q, k, v, kern), (qc, kc, vc)),
      (lambda q, k, v: ops.aft_conv2d(q, k, v, kern2), (q2, k2, v2)),
    ]
    for fn, args in cases:
      chex.assert_trees_all_close(
        jax.jit(jax.vmap(fn))(*args), jax.jit(fn)(*args), rtol=1e-6, atol=1e-6
      )


def _causal_ops(t_len: int, d: int, window: int) -> dict:
  """Each causal op as a function of q, k, v [2, t_len, d] and w [t_len, t_len] (AFT-conv1d:
  2 heads of d / 2 channels, a 3-tap kernel from w)."""

  def conv1d(q, k, v, w):
    heads = lambda x: x.reshape(2, t_len, 2, d // 2)
    out = ops.aft_conv1d(heads(q), heads(k)[..., 0], heads(v), w[:2, :3], causal=True)
    return out.reshape(2, t_len, d)

  return {
    "full": lambda q, k, v, w: ops.aft_full(q, k, v, w, causal=True),
    "local": lambda q, k, v, w: ops.aft_local(q, k, v, w, window=window, causal=True),
    "simple": lambda q, k, v, w: ops.aft_simple(q, k, v, causal=True),
    "conv1d": conv1d,
  }


CAUSAL_OPS = _causal_ops(10, 4, window=3)


@pytest.mark.parametrize("name", sorted(CAUSAL_OPS))
def test_causal_ops_ignore_the_future(name):
  fn = jax.jit(CAUSAL_OPS[name])
  q, k, v, w = _qkvw(16, (2,), 10, 4, 5.0)
  base = fn(q, k, v, w)
  t0 = 4
  q2, k2, v2, w2 = (x.copy() for x in (q, k, v, w))
  for x in (q2, k2, v2):
    x[:, t0 + 1 :] += 100.0
  w2[:, t0 + 1 :] += 100.0
  out = fn(q2, k2, v2, w2)
  chex.assert_trees_all_close(out[:, : t0 + 1], base[:, : t0 + 1], rtol=1e-6, atol=1e-6)
  assert not np.allclose(out[:, t0 + 1 :], base[:, t0 + 1 :])


GRAD_CASES = {
  "full": (lambda q, k, v, w: ops.aft_full(q, k, v, w), "qkvw"),
  "full_causal": (lambda q, k, v, w: ops.aft_full(q, k, v, w, causal=True), "qkvw"),
  "local": (lambda q, k, v, w: ops.aft_local(q, k, v, w, window=2), "qkvw"),
  "local_causal": (lambda q, k, v, w: ops.aft_local(q, k, v, w, window=2, causal=True), "qkvw"),
  "simple": (lambda q, k, v: ops.aft_simple(q, k, v), "qkv"),
  "simple_causal": (lambda q, k, v: ops.aft_simple(q, k, v, causal=True), "qkv"),
  "conv1d": (
    lambda q, k, v, w: ops.aft_conv1d(q.reshape(6, 2, 2), k[:, :2], v.reshape(6, 2, 2), w[:2, :3]),
    "qkvw",
  ),
  "conv1d_causal": (
    lambda q, k, v, w: ops.aft_conv1d(
      q.reshape(6, 2, 2), k[:, :2], v.reshape(6, 2, 2), w[:2, :2], causal=True
    ),
    "qkvw",
  ),
  "conv2d": (
    lambda q, k, v, w: ops.aft_conv2d(
      q.reshape(2, 3, 2, 2),
      k[:, :2].reshape(2, 3, 2),
      v.reshape(2, 3, 2, 2),
      w[:2, :3].reshape(2, 1, 3),
    ),
    "qkvw",
  ),
}


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_gradients_match_finite_differences(name):
  fn, argnames = GRAD_CASES[name]
  with jax.enable_x64(True):
    rng = np.random.default_rng(17)
    vals = {
      "q": rng.normal(size=(6, 4)),
      "k": rng.normal(size=(6, 4)) * 2,
      "v": rng.normal(size=(6, 4)),
      "w": rng.normal(size=(6, 6)),
    }
    args = tuple(jnp.asarray(vals[a], jnp.float64) for a in argnames)
    check_grads(jax.jit(fn), args, order=1, modes=("fwd", "rev"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_gradients_finite_at_large_logits(name):
  fn, argnames = GRAD_CASES[name]
  rng = np.random.default_rng(18)
  vals = {
    "q": rng.normal(size=(6, 4)),
    "k": rng.normal(size=(6, 4)) * 40,
    "v": rng.normal(size=(6, 4)),
    "w": rng.normal(size=(6, 6)) * 40,
  }
  args = tuple(jnp.asarray(vals[a], jnp.float32) for a in argnames)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=tuple(range(len(args)))))(*args)
  chex.assert_tree_all_finite(grads)


@pytest.mark.parametrize("name", ["full", "local", "simple", "conv1d"])
def test_bfloat16_close_to_float32(name):
  q, k, v, w = _qkvw(19, (2,), 16, 8, 1.0)
  fn = _causal_ops(16, 8, window=4)[name]
  fn = jax.jit(fn)
  out32 = fn(q, k, v, w)
  bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  out16 = fn(*bf, jnp.asarray(w, jnp.bfloat16))
  assert out16.dtype == jnp.bfloat16
  # bf16 has an 8-bit mantissa: inputs carry ~0.4% rounding; outputs are O(1).
  chex.assert_trees_all_close(out16.astype(jnp.float32), out32, atol=3e-2, rtol=3e-2)


class BadInput(parameterized.TestCase):
  def test_messages(self):
    x = np.zeros((2, 6, 4), np.float32)
    w = np.zeros((6, 6), np.float32)
    cases = [
      (lambda: ops.aft_full(x, x[:, :5], x, w), "aft_full.*same shape.*k \\(2, 5, 4\\)"),
      (lambda: ops.aft_full(x, x, x, np.zeros((5, 5))), "w must be \\[T, T\\].*\\(5, 5\\)"),
      (lambda: ops.aft_simple(x[0, 0], x[0, 0], x[0, 0]), "q must be \\[..., T, D\\]"),
      (lambda: ops.aft_local(x, x, x, w, window=0), "window must be an int >= 1, got 0"),
      (lambda: ops.aft_local(x, x, x, w, window=2.5), "window"),
      (
        lambda: ops.aft_conv1d(x[..., None], x[..., :3], x[..., None], np.zeros((4, 3))),
        "k \\[..., T, H\\].*k \\(2, 6, 3\\)",
      ),
      (lambda: ops.aft_conv1d(x[..., None], x, x[..., None], np.zeros((4, 4))), "odd.*\\(4, 4\\)"),
      (
        lambda: ops.aft_conv1d(x[..., None], x, x[..., None], np.zeros((3, 3))),
        "H = 4 heads.*\\(3, 3\\)",
      ),
      (
        lambda: ops.aft_conv2d(
          x[..., None, None], x[..., None], x[..., None, None], np.zeros((1, 3, 2))
        ),
        "odd.*\\(1, 3, 2\\)",
      ),
    ]
    for fn, pattern in cases:
      with self.assertRaisesRegex(ValueError, pattern):
        fn()
    # Even kernels are fine when causal: entry j is the bias of t' = t - j.
    ops.aft_conv1d(x[..., None], x, x[..., None], np.zeros((4, 4)), causal=True)


def _dense_reference(q, k, v, w, causal):
  """Vectorised float64 version of the loop reference (for sizes the loops are too slow for)."""
  q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
  t_len = w.shape[0]
  logits = k[..., None, :, :] + w[:, :, None]  # [..., t, t', D]
  if causal:
    logits = np.where(np.tril(np.ones((t_len, t_len), bool))[:, :, None], logits, -np.inf)
  p = np.exp(logits - logits.max(axis=-2, keepdims=True))
  y = (p * v[..., None, :, :]).sum(-2) / p.sum(-2)
  return y / (1.0 + np.exp(-q))


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
  """T well above the block size: several query blocks (the last one overlapping), the running
  sums outside the window, and at scale 40 the exact recomputation of row groups. Values,
  reverse-mode and forward-mode derivatives (the custom JVP itself) against dense formulas.
  ``window=None``: AFT-full."""
  t_len = 300
  q, k, v, w = _qkvw(20, (2,), t_len, 4, scale)
  if window is None:
    fn = jax.jit(functools.partial(ops.aft_full, causal=causal))
    bias = w
  else:
    fn = jax.jit(functools.partial(ops.aft_local, window=window, causal=causal))
    bias = ref.local_bias(w, window)
  expected = _dense_reference(q, k, v, bias, causal)
  chex.assert_trees_all_close(fn(q, k, v, w), expected, rtol=RTOL, atol=ATOL)

  plan = banded.make_plan(t_len, 2 * 4, window or t_len, causal)
  assert plan.nb > 1 and plan.nb * plan.c > t_len, plan  # several blocks, the last overlapping
  rows = lambda x: np.swapaxes(x, 0, 1).reshape(t_len, -1)
  recomputed = banded._forward(plan, rows(k), rows(v), w).bad
  assert bool(np.any(recomputed)) == (scale > 1.0), recomputed.sum()

  def dense(q, k, v, w):  # exact: a per-(t, d) maximum
    idx = np.arange(t_len)
    keep = np.abs(idx[:, None] - idx[None, :]) < (window or t_len)
    logits = k[..., None, :, :] + jnp.where(keep, w, 0.0)[:, :, None]
    if causal:
      logits = jnp.where((idx[:, None] >= idx[None, :])[:, :, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-2)
    return jax.nn.sigmoid(q) * jnp.sum(p * v[..., None, :, :], axis=-2)

  ct, tk, tv = _rand(21, q.shape, q.shape, q.shape)
  (tw,) = _rand(22, w.shape)
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3)))
  chex.assert_trees_all_close(grad(fn)(q, k, v, w), grad(dense)(q, k, v, w), rtol=1e-3, atol=1e-4)
  jvp = lambda f: jax.jit(lambda *a: jax.jvp(lambda k, v, w: f(q, k, v, w), a[:3], a[3:])[1])
  want = jvp(dense)(k, v, w, tk, tv, tw)
  np.testing.assert_allclose(
    jvp(fn)(k, v, w, tk, tv, tw), want, rtol=1e-3, atol=1e-4 * np.abs(want).max()
  )


@pytest.mark.parametrize("t_len,scale", [(1, 40.0), (37, 40.0), (300, 40.0), (256, 1.0)])
def test_simple_causal_derivatives_exact_at_large_logits(t_len, scale):
  """Causal AFT-simple's custom JVP (and the reverse mode transposed from it): float32
  against a dense float64 softmax, at logits of std 40 (where chunks are recomputed with a
  running maximum), over several chunks (T = 37, 300: a padded last chunk)."""
  q, k, v, _ = _qkvw(22, (2,), t_len, 3, scale)
  ct, tk, tv = _rand(23, q.shape, q.shape, q.shape)
  fn = jax.jit(functools.partial(ops.aft_simple, causal=True))

  def dense(q, k, v):
    idx = np.arange(t_len)
    logits = jnp.where((idx[:, None] >= idx[None, :])[:, :, None], k[..., None, :, :], -jnp.inf)
    p = jax.nn.softmax(logits, axis=-2)
    return jax.nn.sigmoid(q) * jnp.sum(p * v[..., None, :, :], axis=-2)

  with jax.enable_x64(True):
    q64, k64, v64, ct64, tk64, tv64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v, ct, tk, tv))
    want_rev = jax.grad(lambda *a: jnp.sum(dense(*a) * ct64), argnums=(0, 1, 2))(q64, k64, v64)
    want_fwd = jax.jvp(lambda k, v: dense(q64, k, v), (k64, v64), (tk64, tv64))[1]
    want_rev, want_fwd = jax.tree.map(np.asarray, (want_rev, want_fwd))
  rows = lambda x: np.swapaxes(x, 0, 1).reshape(t_len, -1)
  c = min(causal_mean.CHUNK, t_len)
  chunks = lambda x: causal_mean._chunked(rows(x), c, -1e30)
  recomputed = causal_mean._forward(chunks(k), chunks(v), False)[3]
  assert bool(np.any(recomputed)) == (scale > 1.0 and t_len > 1), recomputed
  got_rev = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2)))(q, k, v)
  got_fwd = jax.jvp(lambda k, v: fn(q, k, v), (k, v), (tk, tv))[1]
  for got, want in zip(got_rev + (got_fwd,), want_rev + (want_fwd,)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t_len,window", [(13, 1), (13, 3), (13, 6), (16, 2), (16, 40)])
def test_banded_small_blocks(causal, t_len, window):
  """Blocks of 4 rows (the last one overlapping when 4 does not divide T): every layout case
  of ``banded`` (windows narrower and wider than a block, clamped key ranges at both ends,
  running sums on both sides) against the float64 loop reference, and its derivatives in
  both modes against finite differences."""
  plan = banded.make_plan(t_len, 3, window, causal, block=4)
  assert plan.nb == -(-t_len // 4)
  with jax.enable_x64(True):
    rng = np.random.default_rng(t_len * 100 + window)
    k, v = (jnp.asarray(rng.normal(size=(t_len, 3)) * 2) for _ in range(2))
    w = jnp.asarray(rng.normal(size=(t_len, t_len)))
    fn = jax.jit(functools.partial(banded.banded_mean, plan))
    # The reference's output is sigma(q) * mean: q = +inf gives the mean itself.
    q = np.full((t_len, 3), np.inf)
    expected = ref.aft_local(q, np.asarray(k), np.asarray(v), np.asarray(w), window, causal)
    np.testing.assert_allclose(fn(k, v, w), expected, rtol=1e-10, atol=1e-12)
    check_grads(fn, (k, v, w), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("t_len", [1, 13, 16])
def test_causal_mean_small_chunks(t_len):
  """Chunks of 4 positions (the last one padded when 4 does not divide T), at ordinary and at
  huge logit sizes (where chunks are recomputed sequentially): values against the float64
  loop reference, derivatives in both modes against finite differences."""
  with jax.enable_x64(True):
    for scale in (1.0, 100.0):
      rng = np.random.default_rng(t_len)
      k = jnp.asarray(rng.normal(size=(t_len, 3)) * scale)
      v = jnp.asarray(rng.normal(size=(t_len, 3)))
      fn = jax.jit(functools.partial(causal_mean.causal_mean, chunk=4))
      q = np.full((t_len, 3), np.inf)  # sigma(q) = 1: the reference gives the mean itself
      expected = ref.aft_simple(q, np.asarray(k), np.asarray(v), True)
      np.testing.assert_allclose(fn(k, v), expected, rtol=1e-10, atol=1e-12)
      check_grads(fn, (k, v), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["aft_simple", "aft_local"])
def test_precision_policy(name):
  """bf16 inputs: matrix products of bf16 factors accumulated in float32; float32 inputs:
  float32 products at HIGHEST precision (no TF32/bf16 passes on accelerators)."""
  fns = {
    "aft_simple": lambda q, k, v: ops.aft_simple(q, k, v, causal=True, impl="xla"),
    "aft_local": lambda q, k, v: ops.aft_local(
      q, k, v, jnp.zeros((64, 64), q.dtype), window=8, causal=True, impl="xla"
    ),
  }
  x = jnp.ones((2, 64, 16))
  for dtype in (jnp.bfloat16, jnp.float32):
    loss = lambda x: jnp.sum(fns[name](x, x, x).astype(jnp.float32))
    dots = list(equations(jax.make_jaxpr(jax.grad(loss))(x.astype(dtype)).jaxpr, "dot_general"))
    assert len(dots) >= 2  # forward and tangent products
    for eqn in dots:
      in_types = {v.aval.dtype for v in eqn.invars}
      if dtype == jnp.bfloat16:
        # The exact-recomputation branch (rare rows) stays float32.
        if in_types == {jnp.dtype(jnp.bfloat16)}:
          assert eqn.params["preferred_element_type"] == jnp.float32
      else:
        assert in_types == {jnp.dtype(jnp.float32)}
        assert eqn.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2, eqn
    if dtype == jnp.bfloat16:
      assert any({v.aval.dtype for v in e.invars} == {jnp.dtype(jnp.bfloat16)} for e in dots)
