"""A later NaN or infinity leaves every earlier causal output bit-identical; huge logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from aft_jax import ops
from aft_jax.ops import conv, local
from tests.support import numpy_reference as ref
from tests.support.op_cases import dense_op, rand, tpu_simple

T, D, POS = 40, 16, (6, 39)
BAD = (np.nan, np.inf, -np.inf)


Q, K, V = rand(0, (2, T, D), (2, T, D), (2, T, D))
(W,) = rand(1, (T, T))
QC, VC = rand(2, (2, T, 2, 8), (2, T, 2, 8))
KC, KER = rand(3, (2, T, 2), (2, 3))
LAM, BONUS = (np.abs(x) for x in rand(4, (D,), (D,)))  # aft_decay's decay (its "w") and bonus


# name -> (op(q, k, v, w), inputs, float64 reference, names of the inputs)
OPS = {
  "aft_full": (lambda impl: lambda q, k, v, w: ops.aft_full(q, k, v, w, causal=True, impl=impl),
               (Q, K, V, W), lambda q, k, v, w: ref.aft_full(q, k, v, w, True)),
  "aft_local": (lambda impl: lambda q, k, v, w: ops.aft_local(q, k, v, w, window=5, causal=True,
                                                               impl=impl),
                (Q, K, V, W), lambda q, k, v, w: ref.aft_local(q, k, v, w, 5, True)),
  "aft_simple": (lambda impl: lambda q, k, v, w: ops.aft_simple(q, k, v, causal=True, impl=impl),
                 (Q, K, V, W), lambda q, k, v, w: ref.aft_simple(q, k, v, True)),
  "aft_conv1d": (lambda impl: lambda q, k, v, w: ops.aft_conv1d(q, k, v, w, causal=True, impl=impl),
                 (QC, KC, VC, KER), lambda q, k, v, w: ref.aft_conv1d(q, k, v, w, True)),
  "aft_decay": (lambda impl: lambda q, k, v, w: ops.aft_decay(q, k, v, w, BONUS, impl=impl),
                (Q, K, V, LAM), lambda q, k, v, w: ref.aft_decay(q, k, v, w, BONUS)),
}  # fmt: skip
CASES = [("aft_full", "xla"), ("aft_local", "xla"), ("aft_local", "pallas_interpret"),
         ("aft_simple", "xla"), ("aft_simple", "pallas_interpret"),
         ("aft_simple", "tpu_interpret"), ("aft_conv1d", "xla"), ("aft_conv1d", "xla-band"),
         ("aft_decay", "xla"), ("aft_decay", "pallas_interpret")]  # fmt: skip


QT, KT, VT = rand(5, (1, T, 128), (1, T, 128), (1, T, 128))  # the TPU kernel's 128 lanes


@functools.lru_cache(maxsize=None)
def _op(name, impl):  # the jitted op (shared by this worker's tests), inputs, float64 reference
  make, inputs, reference = OPS[name]
  if impl == "tpu_interpret":
    return jax.jit(lambda q, k, v, w: tpu_simple(q, k, v)), (QT, KT, VT, W), reference
  return jax.jit(make(impl)), inputs, reference


def _with(inputs, arg, pos, value):
  xs = [x.copy() for x in inputs]
  if arg == 3:  # w: a later query's row (the kernel of AFT-conv has no positions)
    xs[3][pos, :] = value
  else:
    xs[arg][:, pos, ...] = value
  return xs


@pytest.mark.parametrize("name,impl", CASES)
def test_later_non_finite_leaves_earlier_outputs_bit_identical(name, impl, monkeypatch):
  """... and exactly the outputs that see a NaN are NaN, those of the float64 reference."""
  fn, inputs, reference = _case_op(name, impl, monkeypatch)
  clean = np.asarray(fn(*inputs))
  args = (0, 1, 2) + ((3,) if name in ("aft_full", "aft_local") else ())
  for arg in args:
    for value in BAD:
      for pos in POS:
        xs = _with(inputs, arg, pos, value)
        out = np.asarray(fn(*xs))
        np.testing.assert_array_equal(out[:, :pos], clean[:, :pos], err_msg=f"{arg} {value} {pos}")
        assert not np.array_equal(out[:, pos:], clean[:, pos:], equal_nan=True), (arg, value, pos)
        if np.isnan(value) or arg == 1:
          with np.errstate(invalid="ignore"):  # float64 too: inf - inf where a key is inf
            want = reference(*xs)
        if np.isnan(value):  # exactly the outputs that see a NaN are NaN, as in float64
          np.testing.assert_array_equal(np.isnan(out), np.isnan(want), err_msg=f"{arg} {pos}")
        elif arg == 1:  # infinite keys: finite wherever float64 is
          fin = np.isfinite(want)
          assert np.isfinite(out[fin]).all(), (value, pos)
          np.testing.assert_allclose(out[fin], want[fin], rtol=2e-4, atol=2e-5)


# The banded op in 5 blocks of 8 rows too (the sums outside the band take part).
GRAD_CASES = CASES + [("aft_full", "xla-blocks"), ("aft_local", "xla-blocks")]


def _case_op(name, impl, monkeypatch):  # _op; "xla-blocks", "xla-band": 5 chunks of 8 rows
  if impl not in ("xla-blocks", "xla-band"):
    return _op(name, impl)
  monkeypatch.setattr(local, "_default_block", lambda s, t_len: 8)
  monkeypatch.setattr(conv, "DENSE_MAX_T", 4)  # AFT-conv1d's band past it
  monkeypatch.setattr(conv, "BAND_CHUNK", 8)
  return _op.__wrapped__(name, "xla")  # read when traced: a program of its own (not cached)


@pytest.mark.parametrize("name,impl", GRAD_CASES)
def test_gradients_of_earlier_outputs_stay_finite(name, impl, monkeypatch):
  """The gradients of the outputs before a later NaN or infinity: finite, the clean ones."""
  fn, inputs, _ = _case_op(name, impl, monkeypatch)
  pos, bias = 29, name in ("aft_full", "aft_local")
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)[:, :pos] ** 2), argnums=(0, 1, 2, 3)))
  clean = grads(*inputs)
  for arg in (0, 1, 2) + ((3,) if bias else ()):
    for value in BAD:
      got = grads(*_with(inputs, arg, pos + 2, value))
      for i, (g, c) in enumerate(zip(got, clean)):
        g, c = np.asarray(g), np.asarray(c)
        g, c = (
          (g[:pos], c[:pos]) if i == 3 and bias else (g, c) if i == 3 else (g[:, :pos], c[:, :pos])
        )
        assert np.isfinite(g).all(), (arg, value, "qkvw"[i])
        np.testing.assert_allclose(g, c, 1e-4, 1e-6, err_msg=f"{arg} {value} {'qkvw'[i]}")


@pytest.mark.parametrize("name,impl", [c for c in CASES if c[1] != "tpu_interpret"])
def test_logits_around_the_sentinel(name, impl, monkeypatch):
  """Keys and biases of std 1e30 (the old sentinel's size) and 1e35: the float64 reference's."""
  fn, inputs, reference = _case_op(name, impl, monkeypatch)
  for scale in (1e30, 1e35):
    q, k, v, w = inputs
    k = k * np.float32(scale)
    w = w * np.float32(scale if name not in ("aft_conv1d", "aft_decay") else 1.0)  # parameters
    out = np.asarray(fn(q, k, v, w))
    np.testing.assert_allclose(
      out, reference(q, k, v, w), rtol=2e-4, atol=2e-5, err_msg=f"scale {scale}"
    )


@pytest.mark.parametrize("name,impl", [c for c in GRAD_CASES if c[0] in ("aft_full", "aft_local")])
def test_a_bias_of_minus_infinity_is_no_term(name, impl, monkeypatch):
  """w = -inf drops its term: the float64 reference's values and derivatives; a row with no term
  left is NaN, as the reference's, and no later key reaches it."""
  fn, (q, k, v, w), reference = _case_op(name, impl, monkeypatch)
  w = w.copy()
  w[20, 17:21] = -np.inf  # some of row 20's terms
  none = w.copy()
  none[2, :3] = -np.inf  # every term of row 2 (AFT-local's window, 5, holds them all)
  out = np.asarray(fn(q, k, v, none))
  with np.errstate(invalid="ignore"):
    want = reference(q, k, v, none)
  assert np.isnan(want[:, 2]).all() and np.array_equal(np.isnan(out), np.isnan(want))
  np.testing.assert_allclose(out[:, 3:], want[:, 3:], rtol=2e-4, atol=2e-5)
  later = k.copy()
  later[:, 5] += 5.0
  np.testing.assert_array_equal(np.asarray(fn(q, later, v, none))[:, :3], out[:, :3])

  window = 5 if name == "aft_local" else None
  loss = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3))
  got = jax.jit(loss(fn))(q, k, v, w)
  with jax.enable_x64(True):
    want = loss(dense_op(window, True))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v, w)))
  for g, e, x in zip(got, want, "qkvw"):
    fin = np.isfinite(w) if x == "w" else np.ones(g.shape, bool)
    np.testing.assert_allclose(np.asarray(g)[fin], np.asarray(e)[fin], 1e-4, 1e-5, err_msg=x)


@pytest.mark.parametrize("dense_max_t", [conv.DENSE_MAX_T, 4])  # T = 20: dense, the band
def test_a_kernel_tap_of_minus_infinity_is_no_term(dense_max_t, monkeypatch):
  """Causal AFT-conv1d with taps of -inf: the reference's values (rows with no term left: NaN),
  derivatives against finite differences."""
  monkeypatch.setattr(conv, "DENSE_MAX_T", dense_max_t)  # read when traced: programs of their own
  monkeypatch.setattr(conv, "BAND_CHUNK", 8)  # the band over three chunks
  fn = jax.jit(lambda q, k, v, kern: ops.aft_conv1d(q, k, v, kern, causal=True))
  q, k, v = (x[:, :20] for x in (QC, KC, VC))
  kern = KER.copy()
  kern[0, :], kern[1, 1] = -np.inf, -np.inf  # head 0: rows 0-2 have no term
  out = np.asarray(fn(q, k, v, kern))
  with np.errstate(invalid="ignore"):
    want = ref.aft_conv1d(q, k, v, kern, True)
  assert np.isnan(want[:, :3, 0]).all() and np.array_equal(np.isnan(out), np.isnan(want))
  fin = ~np.isnan(want)
  np.testing.assert_allclose(out[fin], want[fin], rtol=2e-4, atol=2e-5)
  kern = KER.copy()
  kern[0, 1], kern[1, 2] = -np.inf, -np.inf  # every row keeps a term
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(x[0, :10], jnp.float64) for x in (q, k, v))
    kern = jnp.asarray(kern, jnp.float64)
    check_grads(lambda *a: fn(*a, kern), args, 1, modes=("fwd", "rev"), atol=1e-5, rtol=1e-5)


def test_one_token_steps_with_biases_of_minus_infinity():
  """The steps decoding uses, with biases of -inf: the float64 reference's values, NaN rows
  alike (a window whose every bias is -inf keeps the older keys' terms)."""
  w = W.copy()
  w[2, :3], w[20, 16:21] = -np.inf, -np.inf  # row 2: no term; row 20: its window's 5 masked
  kern = KER.copy()
  kern[0, :] = -np.inf  # head 0: rows 0-2 have no term
  runs = [
    (ops.aft_local_step, ops.aft_local_init(Q.shape[:1] + Q.shape[2:], 5), (Q, K, V), w,
     lambda: ref.aft_local(Q, K, V, w, 5, True)),
    (functools.partial(ops.aft_conv1d_step, kernel=kern),
     ops.aft_conv1d_init(KC.shape[:1] + KC.shape[2:], VC.shape[:1] + VC.shape[2:], 3),
     (QC, KC, VC), None, lambda: ref.aft_conv1d(QC, KC, VC, kern, True)),
  ]  # fmt: skip
  for step, state, (q, k, v), bias, reference in runs:
    step, ys = jax.jit(step), []
    for t in range(T):
      y, state = step(state, q[:, t], k[:, t], v[:, t], *(() if bias is None else (bias[t],)))
      ys.append(np.asarray(y))
    out = np.stack(ys, axis=1)
    with np.errstate(invalid="ignore"):
      want = reference()
    assert np.isnan(want).any() and np.array_equal(np.isnan(out), np.isnan(want))
    fin = ~np.isnan(want)
    np.testing.assert_allclose(out[fin], want[fin], rtol=2e-4, atol=2e-5)
