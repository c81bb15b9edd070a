"""The causal ops' modes against one call or the float64 reference: pieces, AFT-local's offsets
and sub-pieces, packed rows, the one-token steps (axis_name: tests/support/mesh_worker.py)."""

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
from tests.support.op_cases import ATOL, RTOL, close, cotangent, output_and_grads

T = 8
CUTS = (3, 1, 4)  # uneven pieces, one of length 1
WINDOW = 3


def _inputs(op, scale, seed=0, t_len=T):
  """(q, k, v, bias) for ``op`` ("conv1d": 2 heads of 2 channels) with logits of std ``scale``."""
  rng = np.random.default_rng(seed)
  f = lambda *s, sc=1.0: np.asarray(rng.normal(size=s) * sc, np.float32)
  if op.endswith("conv1d"):
    return f(2, t_len, 2, 2), f(2, t_len, 2, sc=scale), f(2, t_len, 2, 2), f(2, WINDOW, sc=scale)
  return f(2, t_len, 3), f(2, t_len, 3, sc=scale), f(2, t_len, 3), f(t_len, t_len, sc=scale)


def _call(op, q, k, v, bias, **kw):
  """The causal op; AFT-simple without the bias, AFT-local with a window of ``WINDOW``."""
  if op == "simple":
    return ops.aft_simple(q, k, v, causal=True, **kw)
  window = {"window": WINDOW} if op == "local" else {}
  return getattr(ops, f"aft_{op}")(q, k, v, bias, causal=True, **window, **kw)


def _chained(op, q, k, v, bias):
  """The op on CUTS pieces of T, each handed the state of the one before."""
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
  """Values and gradients, logits of std 1 and 40 (one compiled program for both)."""
  one, chained = functools.partial(_call, op), lambda *a: _chained(op, *a)[0]
  run = jax.jit(lambda *a: (output_and_grads(one)(*a), output_and_grads(chained)(*a)))
  for scale in (1.0, 40.0):
    args = _inputs(op, scale)
    (y1, g1), (y2, g2) = run(*args, cotangent(args[0].shape))
    close(y2, y1, 1e-5)
    close(g2, g1, 1e-4)


@pytest.mark.parametrize("op", ["simple", "local", "conv1d"])
def test_final_state_is_the_decoding_state(op):
  """A call's final state continues with the one-token steps as the op does, and a piece after
  the steps' state gives the op's outputs: the ops and the steps share one state."""
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


# ----------------------------------------------------------------- AFT-local's pieces at an offset


def test_a_long_piece_in_sub_pieces_equals_one_call(monkeypatch):
  """w as its factors (u, v): a short first piece, then a long one in sub-pieces (here of 12
  positions), and a whole sequence in sub-pieces, each forming only its blocks of u v^T: the
  values and gradients (of u and v too) of one call on the dense w."""
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


def _local_pieces(start, first, **kw):
  """AFT-local on positions start.. of a sequence of T after the state of positions first..
  start - 1 (a piece at offset ``first``), with ``kw`` (offset); the float64 reference of the
  sub-sequence from ``first`` on, at the same positions; and the state."""
  q, k, v, w = _inputs("local", 5.0, seed=4)
  piece = lambda x: x[:, first:start]
  at = {"offset": first} if first else {}
  _, state = ops.aft_local(*(piece(x) for x in (q, k, v)), w, window=WINDOW, causal=True,
                           output_final_state=True, **at)  # fmt: skip
  rest = lambda x: x[:, start:]
  y = ops.aft_local(*(rest(x) for x in (q, k, v)), w, window=WINDOW, causal=True,
                    initial_state=state, **kw)  # fmt: skip
  sub = lambda x: x[:, first:]
  want = ref.aft_local(sub(q), sub(k), sub(v), w[first:, first:], WINDOW, causal=True)
  return y, want[:, start - first :], state


@pytest.mark.parametrize("state_from", [0, 2])
def test_the_offset_comes_from_the_state(state_from):
  """A piece after a state takes its offset from the state's index (the position of its first
  query in w), also where the state is that of a piece that started at an offset itself."""
  y, want, state = _local_pieces(5, state_from)
  assert int(state.index) == 5
  chex.assert_trees_all_close(y, want, rtol=1e-5, atol=1e-6)
  y, _, _ = _local_pieces(5, state_from, offset=5)  # the same offset given
  chex.assert_trees_all_close(y, want, rtol=1e-5, atol=1e-6)


def test_an_offset_that_contradicts_the_state_is_refused_or_nan():
  """Known when traced: a ValueError naming both positions; inside jit (the offset traced): the
  piece's output is NaN, never a bias read at other positions."""
  with pytest.raises(ValueError, match=r"offset 3 does not match initial_state.index 5"):
    _local_pieces(5, 0, offset=3)
  q, k, v, w = _inputs("local", 5.0, seed=4)
  _, state = ops.aft_local(q[:, :5], k[:, :5], v[:, :5], w, window=WINDOW, causal=True,
                           output_final_state=True)  # fmt: skip
  call = lambda s, at: ops.aft_local(q[:, 5:], k[:, 5:], v[:, 5:], w, window=WINDOW,
                                     causal=True, offset=at, initial_state=s)  # fmt: skip
  _, want, _ = _local_pieces(5, 0)
  chex.assert_trees_all_close(jax.jit(call)(state, 5), want, rtol=1e-5, atol=1e-6)
  assert np.all(np.isnan(jax.jit(call)(state, 3)))
  # The state traced, the offset known: the same.
  assert np.all(np.isnan(jax.jit(lambda s: call(s, 3))(state)))


def test_a_traced_offset_outside_w_gives_nan():
  """T = 4 positions at a traced offset into w [8, 8] (one program for every offset): offsets
  0..4 fit; -1 and 5 do not, and a dynamic slice would clamp them to another block of w: NaN
  instead."""
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


@pytest.mark.parametrize("at", [1, 4])
def test_a_piece_without_state_at_an_offset_hands_on_its_position(at):
  """Without a state the positions before ``offset`` hold no keys; the final state's index is
  offset + T, so the next piece continues from it (the float64 reference on the sub-sequence)."""
  q, k, v, w = _inputs("local", 5.0, seed=6)
  call = functools.partial(ops.aft_local, window=WINDOW, causal=True)
  y1, state = call(q[:, at : at + 2], k[:, at : at + 2], v[:, at : at + 2], w, offset=at,
                   output_final_state=True)  # fmt: skip
  assert int(state.index) == at + 2
  y2 = call(q[:, at + 2 :], k[:, at + 2 :], v[:, at + 2 :], w, initial_state=state)
  want = ref.aft_local(q[:, at:], k[:, at:], v[:, at:], w[at:, at:], WINDOW, causal=True)
  chex.assert_trees_all_close(jnp.concatenate([y1, y2], axis=1), want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- states themselves


def _state_of(op, q, k, v, bias, n):
  return _call(op, q[:, :n], k[:, :n], v[:, :n], bias, output_final_state=True)[1]


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
@pytest.mark.parametrize("op", ["simple", "local", "conv1d"])
def test_a_state_of_ints_or_bools_is_refused(op, dtype):
  q, k, v, bias = _inputs(op, 1.0)
  state = _state_of(op, q, k, v, bias, 3)
  bad = jax.tree.map(lambda x: np.zeros(np.shape(x), dtype), state)
  name = np.dtype(dtype).name
  with pytest.raises(
    ValueError, match=rf"initial_state\.\w+(\.m)? must be floating-point .*got {name}"
  ):
    _call(op, q[:, 3:], k[:, 3:], v[:, 3:], bias, initial_state=bad)
  if op != "simple":  # the index is a count of positions: an int, not a float or a bool
    for index in (np.float32(3), np.bool_(True)):
      with pytest.raises(ValueError, match=r"initial_state\.index must be an int"):
        _call(op, q[:, 3:], k[:, 3:], v[:, 3:], bias, initial_state=state._replace(index=index))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("op", ["simple", "local", "conv1d"])
def test_a_piece_of_no_positions_keeps_the_state(op, jit):
  q, k, v, bias = _inputs(op, 1.0)
  state = _state_of(op, q, k, v, bias, 3)
  none = lambda x: x[:, 3:3]
  call = lambda s: _call(op, none(q), none(k), none(v), bias, initial_state=s,
                         output_final_state=True)  # fmt: skip
  y, after = (jax.jit(call) if jit else call)(state)
  assert y.shape == none(q).shape and y.dtype == jnp.float32
  chex.assert_trees_all_equal(after, state)
  # Without a state: the state before any position (AFT-local: at its offset).
  at = {"offset": 3} if op == "local" else {}
  _, empty = _call(op, none(q), none(k), none(v), bias, output_final_state=True, **at)
  chex.assert_trees_all_equal_shapes_and_dtypes(empty, state)
  if op == "local":
    assert int(empty.index) == 3


# --------------------------------------------------------------------------- packed rows

TP = 9  # packed rows of two documents each
SPLITS = (5, 4)  # row 0: [doc of 5 | doc of 4]; row 1: [doc of 4 | doc of 5]


def _layout():
  """segment_ids and positions [2, TP], each document's positions from 0."""
  seg = np.array([[1] * n + [2] * (TP - n) for n in SPLITS], np.int32)
  pos = np.array([list(range(n)) + list(range(TP - n)) for n in SPLITS], np.int32)
  return seg, pos


def _packed_op(op, q, k, v, bias, seg=None, pos=None):
  """The op on q, k, v [..., TP, ...]; packed when seg is given; w's top-left block alone."""
  if seg is None:
    t_len = q.shape[-3] if op == "conv1d" else q.shape[-2]
    return _call(op, q, k, v, bias if op == "conv1d" else bias[:t_len, :t_len])
  packed = {} if op in ("simple", "conv1d") else {"positions": pos}
  return _call(op, q, k, v, bias, segment_ids=seg, **packed)


# Logits of std 40 where the bias-0 prefix scan and the band meet at large logits; AFT-full's
# band is every key.
@pytest.mark.parametrize(
  "op, scale", [("simple", 40.0), ("local", 40.0), ("full", 1.0), ("conv1d", 40.0)]
)
def test_each_document_as_if_alone(op, scale):
  seg, pos = _layout()
  ct = np.random.default_rng(2).normal(size=_inputs(op, 1.0, 1, TP)[0].shape).astype(np.float32)

  def packed(q, k, v, bias):
    y = _packed_op(op, q, k, v, bias, seg, pos)
    return jnp.sum(y * ct), y

  def alone(q, k, v, bias):
    """Each document on its own (the two of length 5 as one batch, the two of 4 as another),
    put back in place."""
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
  """A position outside w (-1, which NumPy would read as the last row, or T): every output that
  reads its bias is NaN; the other documents are what each gives alone (float64 reference)."""
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


# --------------------------------------------------------------------------- the one-token steps

TS, STEP_WINDOW = 11, 4  # TS past the window and kernel: the prefix triple is used


def _scan(step, state, *xs):
  """Y [B, TS, ...] from ``step(state, *x_t) -> (y_t, state)`` over axis 1 of each x."""

  def body(state, x_t):
    y_t, state = step(state, *x_t)
    return state, y_t

  _, ys = jax.lax.scan(body, state, [jnp.moveaxis(x, 1, 0) for x in xs])
  return jnp.moveaxis(ys, 0, 1)


def _steps(name, q, k, v, w):
  """(the steps' output, the op's) for op ``name``."""
  one = lambda x: x.shape[:1] + x.shape[2:]  # one position's shape
  if name == "aft_conv1d":
    state = ops.aft_conv1d_init(one(k), one(v), WINDOW)
    step = lambda s, q_t, k_t, v_t: ops.aft_conv1d_step(s, q_t, k_t, v_t, w)
    return _scan(step, state, q, k, v), ops.aft_conv1d(q, k, v, w, causal=True, impl="xla")
  t_idx = jnp.broadcast_to(jnp.arange(TS), q.shape[:2])  # each step takes row t of w
  if name == "aft_simple":
    got = _scan(ops.aft_simple_step, ops.aft_simple_init(one(q)), q, k, v)
    return got, ops.aft_simple(q, k, v, causal=True, impl="xla")
  if name == "aft_full":
    step = lambda s, q_t, k_t, v_t, t: ops.aft_full_step(s, q_t, k_t, v_t, w[t[0]])
    got = _scan(step, ops.aft_full_init(one(q), TS), q, k, v, t_idx)
    return got, ops.aft_full(q, k, v, w, causal=True, impl="xla")
  step = lambda s, q_t, k_t, v_t, t: ops.aft_local_step(s, q_t, k_t, v_t, w[t[0]])
  got = _scan(step, ops.aft_local_init(one(q), STEP_WINDOW), q, k, v, t_idx)
  return got, ops.aft_local(q, k, v, w, window=STEP_WINDOW, causal=True, impl="xla")


NAMES = ["aft_simple", "aft_full", "aft_local", "aft_conv1d"]


@pytest.mark.parametrize("name", NAMES)
def test_steps_over_a_sequence_are_the_causal_op(name):
  """Logits of std 1 and 40, one compiled program for both."""
  run = jax.jit(functools.partial(_steps, name))
  for scale in (1.0, 40.0):
    got, want = run(*map(jnp.asarray, _inputs(name, scale, 0, TS)))
    chex.assert_tree_all_finite(got)
    chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL, custom_message=f"std {scale}")


def test_steps_keep_the_inputs_dtype():
  q = jnp.zeros((2, 3), jnp.bfloat16)
  y, state = ops.aft_simple_step(ops.aft_simple_init((2, 3)), q, q, q)
  assert y.dtype == jnp.bfloat16 and state.m.dtype == jnp.float32


def test_a_window_of_whole_shards_sums_no_empty_mask():
  """A window of whole shards builds no sum over an all-false mask in the state before a
  device's shard (XLA would constant-fold it, slowly): one ``reduce_max`` fewer."""
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
