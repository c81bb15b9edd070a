"""The causal ops' modes: pieces, offsets, sub-pieces, packed rows, the one-token steps."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import ops
from aft_jax.ops import local
from tests.support import numpy_reference as ref
from tests.support.helpers import equations
from tests.support.op_cases import close, cotangent, output_and_grads

T = 8
CUTS = (3, 1, 4)  # uneven pieces, one of length 1
WINDOW = 3


def _inputs(op, scale, seed=0, t_len=T):  # (q, k, v, bias), logits of std ``scale``
  rng = np.random.default_rng(seed)
  f = lambda *s, sc=1.0: np.asarray(rng.normal(size=s) * sc, np.float32)
  if op.endswith("conv1d"):
    return f(2, t_len, 2, 2), f(2, t_len, 2, sc=scale), f(2, t_len, 2, 2), f(2, WINDOW, sc=scale)
  return f(2, t_len, 3), f(2, t_len, 3, sc=scale), f(2, t_len, 3), f(t_len, t_len, sc=scale)


def _call(op, q, k, v, bias, **kw):  # the causal op (AFT-local: window WINDOW)
  if op == "simple":
    return ops.aft_simple(q, k, v, causal=True, **kw)
  window = {"window": WINDOW} if op == "local" else {}
  return getattr(ops, f"aft_{op}")(q, k, v, bias, causal=True, **window, **kw)


def _chained(op, q, k, v, bias):  # CUTS pieces, each after the state of the one before
  ys, state, start = [], None, 0
  for n in CUTS:
    piece = lambda x: x[:, start : start + n]
    kw = {"offset": start} if op == "local" else {}
    y, state = _call(op, piece(q), piece(k), piece(v), bias, initial_state=state,
                     output_final_state=True, **kw)  # fmt: skip
    ys.append(y)
    start += n
  return jnp.concatenate(ys, axis=1), state


@pytest.mark.parametrize("op", ["simple", "local", "conv1d"])
def test_pieces_equal_one_call(op):
  one, chained = functools.partial(_call, op), lambda *a: _chained(op, *a)[0]
  run = jax.jit(lambda *a: (output_and_grads(one)(*a), output_and_grads(chained)(*a)))
  for scale in (1.0, 40.0):
    args = _inputs(op, scale)
    (y1, g1), (y2, g2) = run(*args, cotangent(args[0].shape))
    close(y2, y1, 1e-5)
    close(g2, g1, 1e-4)


@pytest.mark.parametrize("op", ["simple", "local", "conv1d"])
def test_final_state_is_the_decoding_state(op):  # ops and steps share one state
  n = 5

  @jax.jit
  def run(q, k, v, bias):
    if op == "simple":
      step = ops.aft_simple_step
    elif op == "local":
      step = lambda s, *a: ops.aft_local_step(s, *a, bias[s.index])
    else:
      step = lambda s, *a: ops.aft_conv1d_step(s, *a, bias)
    _, state = _call(op, q[:, :n], k[:, :n], v[:, :n], bias, output_final_state=True)
    y_n, state = step(state, q[:, n], k[:, n], v[:, n])
    kw = {"offset": n + 1} if op == "local" else {}
    rest = lambda x: x[:, n + 1 :]
    y_rest = _call(op, rest(q), rest(k), rest(v), bias, initial_state=state, **kw)
    return _call(op, q, k, v, bias), y_n, y_rest

  q, k, v, bias = _inputs(op, 5.0, seed=3)
  whole, y_n, y_rest = run(q, k, v, bias)
  np.testing.assert_allclose(y_n, whole[:, n], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(y_rest, whole[:, n + 1 :], rtol=1e-5, atol=1e-6)


def test_a_long_piece_in_sub_pieces_equals_one_call(monkeypatch):
  """w as factors (u, v): a piece, then one in sub-pieces, a whole sequence: the dense w's."""
  monkeypatch.setattr(local, "SUB_PIECE", 3)
  rng = np.random.default_rng(6)
  f = lambda *s, sc=1.0: np.asarray(rng.normal(size=s) * sc, np.float32)
  t_len, n = 40, 3  # a first piece of 3, then 37 = 3 sub-pieces of 12 and 1
  q, k, v = f(2, t_len, 3), f(2, t_len, 3, sc=40.0), f(2, t_len, 3)
  bias = (f(t_len, 2, sc=6.0), f(t_len, 2, sc=6.0))  # w = u v^T, given as its factors

  def chained(q, k, v, bias):
    w = tuple(bias)
    call = functools.partial(ops.aft_local, window=WINDOW, causal=True)
    y1, state = call(q[:, :n], k[:, :n], v[:, :n], w, output_final_state=True)
    y2 = call(q[:, n:], k[:, n:], v[:, n:], w, offset=n, initial_state=state)
    return jnp.concatenate([y1, y2], axis=1)

  dense = lambda q, k, v, b: ops.aft_local(q, k, v, b[0] @ b[1].T, window=WINDOW, causal=True)
  # One call on the whole sequence given the factors: in sub-pieces too.
  whole = lambda q, k, v, b: ops.aft_local(q, k, v, tuple(b), window=WINDOW, causal=True)
  run = jax.jit(lambda *a: [output_and_grads(f)(*a) for f in (dense, chained, whole)])
  (y1, g1), (y2, g2), (y3, g3) = run(q, k, v, bias, cotangent(q.shape))
  close(y2, y1, 1e-5)
  close(g2, g1, 1e-4)
  close(y3, y1, 1e-5)
  close(g3, g1, 1e-4)


def test_a_traced_offset_that_contradicts_the_state_gives_nan():
  """Inside jit the piece's output is NaN, never a bias read at other positions."""
  q, k, v, w = _inputs("local", 5.0, seed=4)
  _, state = ops.aft_local(q[:, :5], k[:, :5], v[:, :5], w, window=WINDOW, causal=True,
                           output_final_state=True)  # fmt: skip
  call = lambda s, at: ops.aft_local(q[:, 5:], k[:, 5:], v[:, 5:], w, window=WINDOW,
                                     causal=True, offset=at, initial_state=s)  # fmt: skip
  want = ref.aft_local(q, k, v, w, WINDOW, causal=True)[:, 5:]
  chex.assert_trees_all_close(jax.jit(call)(state, 5), want, rtol=1e-5, atol=1e-6)
  assert np.all(np.isnan(jax.jit(call)(state, 3)))
  # The state traced, the offset known: the same.
  assert np.all(np.isnan(jax.jit(lambda s: call(s, 3))(state)))


def test_a_traced_offset_outside_w_gives_nan():
  """T = 4 at a traced offset into w [8, 8]: -1 and 5 NaN (a dynamic slice would clamp)."""
  q, k, v, w = _inputs("local", 5.0, seed=5)
  first = lambda x: x[:, :4]
  run = jax.jit(lambda at: ops.aft_local(first(q), first(k), first(v), w, window=WINDOW,
                                         causal=True, offset=at))  # fmt: skip
  for at in (-1, 0, 4, 5):
    y = run(at)
    if 0 <= at <= 4:
      want = ref.aft_local(first(q), first(k), first(v), w[at:, at:][:4, :4], WINDOW, causal=True)
      chex.assert_trees_all_close(y, want, rtol=1e-5, atol=1e-6, custom_message=f"offset {at}")
    else:
      assert np.all(np.isnan(y)), at


@pytest.mark.parametrize("op", ["simple", "local", "conv1d"])
def test_a_piece_of_no_positions_keeps_the_state(op):
  q, k, v, bias = _inputs(op, 1.0)
  state = _call(op, q[:, :3], k[:, :3], v[:, :3], bias, output_final_state=True)[1]
  none = lambda x: x[:, 3:3]
  y, after = _call(op, none(q), none(k), none(v), bias, initial_state=state,
                   output_final_state=True)  # fmt: skip
  assert y.shape == none(q).shape and y.dtype == jnp.float32
  chex.assert_trees_all_equal(after, state)
  # Without a state: the state before any position (AFT-local: at its offset).
  at = {"offset": 3} if op == "local" else {}
  _, empty = _call(op, none(q), none(k), none(v), bias, output_final_state=True, **at)
  chex.assert_trees_all_equal_shapes_and_dtypes(empty, state)
  if op == "local":
    assert int(empty.index) == 3


TP = 9  # packed rows of two documents each
SPLITS = (5, 4)  # row 0: [doc of 5 | doc of 4]; row 1: [doc of 4 | doc of 5]


def _layout():  # segment_ids and positions [2, TP], each document's positions from 0
  seg = np.array([[1] * n + [2] * (TP - n) for n in SPLITS], np.int32)
  pos = np.array([list(range(n)) + list(range(TP - n)) for n in SPLITS], np.int32)
  return seg, pos


def _packed_op(op, q, k, v, bias, seg=None, pos=None):  # packed when seg is given
  if seg is None:
    t_len = q.shape[-3] if op == "conv1d" else q.shape[-2]
    return _call(op, q, k, v, bias if op == "conv1d" else bias[:t_len, :t_len])
  packed = {} if op in ("simple", "conv1d") else {"positions": pos}
  return _call(op, q, k, v, bias, segment_ids=seg, **packed)


# Std 40 where the bias-0 prefix scan and the band meet (AFT-full's band is every key).
@pytest.mark.parametrize(
  "op, scale", [("simple", 40.0), ("local", 40.0), ("full", 1.0), ("conv1d", 40.0)]
)
def test_each_document_as_if_alone(op, scale):
  seg, pos = _layout()
  ct = np.random.default_rng(2).normal(size=_inputs(op, 1.0, 1, TP)[0].shape).astype(np.float32)

  def packed(q, k, v, bias):
    y = _packed_op(op, q, k, v, bias, seg, pos)
    return jnp.sum(y * ct), y

  def alone(q, k, v, bias):  # the documents of 5 as one batch, of 4 as another, put back
    docs = lambda x: (jnp.stack([x[0, :5], x[1, 4:]]), jnp.stack([x[0, 5:], x[1, :4]]))
    (q5, q4), (k5, k4), (v5, v4), (c5, c4) = (docs(x) for x in (q, k, v, ct))
    y5, y4 = _packed_op(op, q5, k5, v5, bias), _packed_op(op, q4, k4, v4, bias)
    y = jnp.stack([jnp.concatenate([y5[0], y4[0]]), jnp.concatenate([y4[1], y5[1]])])
    return jnp.sum(y5 * c5) + jnp.sum(y4 * c4), y

  grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)
  ((_, y1), g1), ((_, y2), g2) = jax.jit(lambda *a: (grad(packed)(*a), grad(alone)(*a)))(
    *_inputs(op, scale, 1, TP)
  )
  np.testing.assert_allclose(y1, y2, rtol=0, atol=1e-5 * float(np.max(np.abs(y2))))
  for a, b in zip(g1, g2):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * float(np.max(np.abs(b))) + 1e-30)


@pytest.mark.parametrize("op", ["local", "full"])
def test_a_position_outside_w_gives_nan(op):
  """A position -1 (NumPy would read the last row) or T: the outputs reading it NaN, no other."""
  q, k, v, w = _inputs(op, 1.0, 1, TP)
  run = jax.jit(functools.partial(_packed_op, op))
  n = SPLITS[0]
  bias = ref.local_bias(w, WINDOW) if op == "local" else w
  want = ref.aft_full(q[0, :n], k[0, :n], v[0, :n], bias[:n, :n], causal=True)
  for bad in (-1, TP):
    seg, pos = _layout()
    pos[0, SPLITS[0] + 1] = bad  # the second position of row 0's second document
    y = np.asarray(run(q, k, v, w, seg, pos))
    reads = SPLITS[0] + 1 + np.arange(WINDOW if op == "local" else TP)  # the rows that see it
    reads = reads[reads < TP]
    assert np.all(np.isnan(y[0, reads])), bad
    fine = np.setdiff1d(np.arange(TP), reads)
    assert np.all(np.isfinite(y[0, fine])) and np.all(np.isfinite(y[1])), bad
    np.testing.assert_allclose(y[0, :n], want, rtol=1e-5, atol=1e-6, err_msg=f"position {bad}")


def test_steps_keep_the_inputs_dtype():
  q = jnp.zeros((2, 3), jnp.bfloat16)
  y, state = ops.aft_simple_step(ops.aft_simple_init((2, 3)), q, q, q)
  assert y.dtype == jnp.bfloat16 and state.m.dtype == jnp.float32


def test_a_window_of_whole_shards_sums_no_empty_mask():
  """No sum over an all-false mask (XLA constant-folds it, slowly): one ``reduce_max`` fewer."""
  from jax.sharding import Mesh, PartitionSpec as P

  from aft_jax.ops import logsumexp as lse

  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  x = jax.ShapeDtypeStruct((2, 4, 3), jnp.float32)  # 4 positions per device

  def reduces(window):
    state = lambda k, v: lse.shard_state(k, v, window, "seq")
    specs = dict(in_specs=(P(None, "seq"),) * 2, out_specs=P(), check_vma=False)
    f = jax.shard_map(state, mesh=mesh, **specs)
    jaxpr = jax.make_jaxpr(f)(x, x).jaxpr
    return len(list(equations(jaxpr, "reduce_max")))

  assert reduces(4) == reduces(3) - 1 and reduces(8) == reduces(6) - 1
