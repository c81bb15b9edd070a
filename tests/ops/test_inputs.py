"""Bad inputs are one-line ValueErrors; array-likes are arrays; empty inputs, empty outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import layers, ops

X = np.zeros((2, 6, 4), np.float32)
W = np.zeros((6, 6), np.float32)


def _calls(q, k, v, w):  # every causal op (AFT-conv: D heads of one channel) and w [T, T]
  ker = np.zeros((np.shape(q)[-1], 3), np.float32)
  heads = lambda x: np.asarray(x)[..., None]
  return {
    "aft_full": lambda: ops.aft_full(q, k, v, w, causal=True),
    "aft_local": lambda: ops.aft_local(q, k, v, w, window=2, causal=True),
    "aft_simple": lambda: ops.aft_simple(q, k, v, causal=True),
    "aft_simple_nc": lambda: ops.aft_simple(q, k, v),
    "aft_conv1d": lambda: ops.aft_conv1d(heads(q), k, heads(v), ker, causal=True),
  }


X16, W8 = np.zeros((2, 8, 16), np.float32), np.zeros((8, 8), np.float32)
SEG = np.array([[1] * 3 + [2] * 3] * 2, np.int32)  # [2, T]: two documents a row
STATE = ops.aft_simple_init((2, 4))
CQ, CK, CV = X[..., None], X, X[..., None]  # AFT-conv: 4 heads of 1 channel
F, S, L, C1 = ops.aft_full, ops.aft_simple, ops.aft_local, ops.aft_conv1d
ker = lambda *s, dt=np.float32: np.zeros(s, dt)
CAUSAL, LOCAL = dict(causal=True), dict(window=2, causal=True)
LSTATE, CSTATE = ops.aft_local_init((2, 4), 2), ops.aft_conv1d_init((2, 4), (2, 4, 1), 3)
ints = lambda state, dt=np.int32: jax.tree.map(lambda x: np.zeros(np.shape(x), dt), state)

# (op, args, kwargs, the message's regex): every op's checks of its own arguments.
ERRORS = [
  (F, (X.astype(np.int32), X, X, W), {}, "must be a real floating-point array; got q int32"),
  (S, (X, X.astype(bool), X), {}, "must be a real floating-point array; got k bool"),
  (C1, (CQ, CK, CV.astype(np.complex64), ker(4, 3)), {}, "floating-point array; got v complex64"),
  (S, (X, X, X), dict(causal="False"), "causal must be a bool .*got 'False'"),
  (L, (X, X, X, W), dict(window=2, causal=None), "causal must be a bool .*got None"),
  (F, (X, X[:, :5], X, W), {}, r"aft_full.*same shape.*k \(2, 5, 4\)"),
  (F, (X, X, X, ker(5, 5)), {}, r"w must be \[T, T\].*\(5, 5\)"),
  (F, (X, X, X, ker(6, 6, dt=np.int32)), {}, r"aft_full: w must be a real floating.*int32"),
  (S, (X[0, 0],) * 3, {}, r"q must be \[..., T, D\]"),
  (L, (X, X, X, W), dict(window=0), "window must be an int >= 1, got 0"),
  (L, (X, X, X, W), dict(window=2.5), "window must be an int >= 1, got 2.5"),
  (C1, (CQ, X[..., :3], CV, ker(4, 3)), {}, r"k \[..., T, H\].*k \(2, 6, 3\)"),
  (C1, (CQ, CK, CV, ker(4, 4)), {}, r"odd.*\(4, 4\)"),
  (C1, (CQ, CK, CV, ker(3, 3)), {}, r"H = 4 heads.*\(3, 3\)"),
  # A causal kernel of width 0 has no size to be odd: it is refused as empty.
  (C1, (CQ, CK, CV, ker(4, 0)), CAUSAL,
   r"aft_conv1d: kernel sizes must be >= 1; got kernel \(4, 0\)"),
  (C1, (CQ, CK, CV, ker(4, 3, dt=np.int32)), CAUSAL, "aft_conv1d: kernel must be a real floating"),
  (ops.aft_conv2d, (X[..., None, None], X[..., None], X[..., None, None], ker(1, 3, 2)), {},
   r"odd.*\(1, 3, 2\)"),
  # states: for the causal ops that have one, of these inputs
  (S, (X, X, X), dict(initial_state=STATE), "aft_simple: initial_state need causal=True"),
  (L, (X, X, X, W), dict(window=2, output_final_state=True), "aft_local: output_final_state need"),
  (F, (X, X, X, W), dict(CAUSAL, output_final_state=True), "aft_full: initial_state and output_"),
  (S, (X[:1],) * 3, dict(CAUSAL, initial_state=STATE), "aft_simple: initial_state must be the st"),
  (S, (X, X, X), dict(CAUSAL, initial_state=ints(STATE)), r"initial_state\.m must be floating"),
  (L, (X, X, X, W), dict(LOCAL, initial_state=ints(LSTATE, bool)), r"prefix\.m must be fl.*bool"),
  (L, (X, X, X, W), dict(LOCAL, initial_state=LSTATE._replace(index=np.float32(0))),
   r"initial_state\.index must be an int"),
  (C1, (CQ, CK, CV, ker(4, 3)), dict(CAUSAL, initial_state=CSTATE._replace(index=np.bool_(0))),
   r"initial_state\.index must be an int"),
  (L, (X, X, X, W), dict(LOCAL, offset=3, initial_state=LSTATE._replace(index=np.int32(5))),
   "offset 3 does not match initial_state.index 5"),
  (L, (X, X, X, W), dict(LOCAL, offset=4), r"L >= offset \+ T = 10 \(offset 4, T 6\)"),
  # packed rows
  (S, (X, X, X), dict(segment_ids=SEG), "aft_simple: segment_ids need causal=True"),
  (S, (X, X, X), dict(CAUSAL, segment_ids=SEG[:, :4]),
   r"segment_ids must be an int array \[..., T\] = \(2, 6\)"),
  (L, (X, X, X, W), dict(LOCAL, positions=SEG.astype(np.float32)), "positions must be an int arr"),
  (L, (X, X, X, W), dict(LOCAL, segment_ids=SEG, output_final_state=True),
   "do not take initial_state, output_final_state"),
  (F, (X, X, X, W), dict(impl="triton"), "impl must be one of"),
  # kernels that cannot run (on this CPU host; the reasons: test_common.py's test_resolve)
  (S, (X16,) * 3, dict(CAUSAL, impl="pallas"), "not for the 'cpu' platform"),
  (F, (X16, X16, X16, W8), dict(CAUSAL, impl="pallas"), "no Pallas kernel for this op"),
  (L, (X16, X16, X16, W8), dict(window=2000, causal=True, impl="pallas_interpret"),
   "the window 2000 is larger than the kernel's 1024"),
]  # fmt: skip


@pytest.mark.parametrize("fn, args, kwargs, message", ERRORS, ids=[e[-1][:32] for e in ERRORS])
def test_bad_arguments_are_one_line(fn, args, kwargs, message):
  with pytest.raises(ValueError, match=message) as e:
    fn(*args, **kwargs)
  assert "\n" not in str(e.value)


def test_even_causal_conv_kernels_are_fine():  # entry j: the bias of t' = t - j
  assert C1(CQ, CK, CV, ker(4, 4), causal=True).shape == CQ.shape


def test_a_numpy_integer_window_is_an_int():
  x = np.random.default_rng(0).normal(size=X.shape).astype(np.float32)
  w = np.random.default_rng(1).normal(size=W.shape).astype(np.float32)
  for window in (np.int64(2), np.int32(2)):
    want = ops.aft_local(x, x, x, w, window=2, causal=True)
    np.testing.assert_array_equal(ops.aft_local(x, x, x, w, window=window, causal=True), want)
    layer = lambda s: layers.AFTLocal(max_len=6, window=s, causal=True)
    params = layer(2).init(jax.random.key(0), x)
    np.testing.assert_array_equal(layer(window).apply(params, x), layer(2).apply(params, x))


def test_array_likes_are_arrays_and_bad_ones_one_line():
  """Nested lists as q, k, v: their arrays' output; a ragged one names the argument only."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=X.shape).astype(np.float32)
  for op in ("aft_simple", "aft_conv1d"):
    lists, arrays = _calls(x.tolist(), x.tolist(), x.tolist(), W)[op], _calls(x, x, x, W)[op]
    np.testing.assert_array_equal(lists(), arrays(), err_msg=op)
  ragged = [[[0.0] * 4] * 6, [[0.0] * 3] * 6]
  with pytest.raises(ValueError, match=r"^aft_simple: k must be an array; got list") as e:
    ops.aft_simple(X, ragged, X)
  assert "\n" not in str(e.value) and "0.0, 0.0" not in str(e.value)


@pytest.mark.parametrize("shape", [(2, 0, 4), (2, 6, 0), (0, 6, 4)])
def test_empty_inputs_give_empty_outputs(shape):
  x = np.zeros(shape, np.float32)
  t = shape[1]
  for op, call in _calls(x, x, x, np.zeros((t, t), np.float32)).items():
    out = call()
    assert out.size == 0 and out.dtype == jnp.float32, op
    assert out.shape[: len(shape)] == shape, op


def test_factor_dim_below_zero_is_refused():
  x = jnp.zeros((1, 4, 8))
  with pytest.raises(ValueError, match=r"AFTFull: factor_dim must be an int >= 0.*got -1"):
    layers.AFTFull(max_len=8, factor_dim=-1).init(jax.random.key(0), x)
  for f in (0, None):  # a full bias
    layers.AFTFull(max_len=8, factor_dim=f).init(jax.random.key(0), x)


@pytest.mark.parametrize("cls", [layers.AFTFull, layers.AFTLocal])
def test_decoding_past_max_len_gives_nan(cls):
  module = cls(max_len=3, causal=True)
  x = jax.random.normal(jax.random.key(1), (1, 1, 8))
  init = jax.jit(module.init, static_argnames="decode")  # one program each, not per primitive
  variables = {"params": init(jax.random.key(0), jnp.tile(x, (1, 3, 1)))["params"]}
  cache = init(jax.random.key(0), x, decode=True)["cache"]
  step = jax.jit(
    lambda c, x: module.apply({**variables, "cache": c}, x, decode=True, mutable="cache")
  )
  outs = []
  for _ in range(5):
    y, upd = step(cache, x)
    cache = upd["cache"]
    outs.append(np.asarray(y))
  assert all(np.isfinite(y).all() for y in outs[:3])
  assert all(np.isnan(y).all() for y in outs[3:])
