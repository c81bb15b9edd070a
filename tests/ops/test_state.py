"""The causal ops' state API: a sequence in pieces equals one call, values and gradients."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import ops
from aft_jax.ops import pieces
from tests.support import numpy_reference as ref

T = 8
CUTS = (3, 1, 4)  # uneven pieces, one of length 1
WINDOW = 3


def _inputs(op, scale, seed=0):
  """(q, k, v, bias) for ``op`` with logits of std ``scale``; T on axis 1."""
  rng = np.random.default_rng(seed)
  f = lambda *s, sc=1.0: np.asarray(rng.normal(size=s) * sc, np.float32)
  if op == "conv1d":
    return f(2, T, 2, 2), f(2, T, 2, sc=scale), f(2, T, 2, 2), f(2, WINDOW, sc=scale)
  return f(2, T, 3), f(2, T, 3, sc=scale), f(2, T, 3), f(T, T, sc=scale)


def _call(op, q, k, v, bias, **kw):
  if op == "simple":
    return ops.aft_simple(q, k, v, causal=True, **kw)
  if op == "local":
    return ops.aft_local(q, k, v, bias, window=WINDOW, causal=True, **kw)
  return ops.aft_conv1d(q, k, v, bias, causal=True, **kw)


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


def _values_and_grads(fn, q, k, v, bias):
  """fn's output and the gradients of <fn, ct> (ct fixed, random) w.r.t. every input."""
  ct = np.random.default_rng(9).normal(size=q.shape).astype(np.float32)
  loss = lambda *a: jnp.sum(fn(*a) * ct)
  return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(q, k, v, bias)


def _close(got, want, rel):
  """Within ``rel`` of the largest magnitude of ``want`` (leaf by leaf)."""
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    chex.assert_tree_all_finite(g)
    np.testing.assert_allclose(g, w, rtol=0, atol=rel * float(np.max(np.abs(w))) + 1e-30)


@pytest.mark.parametrize("scale", [1.0, 40.0])
@pytest.mark.parametrize("op", ["simple", "local", "conv1d"])
def test_pieces_equal_one_call(op, scale):
  args = _inputs(op, scale)
  y1, g1 = _values_and_grads(functools.partial(_call, op), *args)
  y2, g2 = _values_and_grads(lambda *a: _chained(op, *a)[0], *args)
  _close(y2, y1, 1e-5)
  _close(g2, g1, 1e-4)


def test_a_long_piece_in_sub_pieces_equals_one_call(monkeypatch):
  """AFT-local with w given as its factors (u, v), w = u v^T. A piece longer than two
  sub-pieces (``pieces.SUB_PIECE``, here 3 with a window of 3: sub-pieces of 12 positions) runs
  as sub-pieces with the state carried, each forming only its block of w; so does a whole
  sequence given the factors; a short first piece forms its block too: the same values and
  gradients (of u and v too) as one call on the dense w."""
  monkeypatch.setattr(pieces, "SUB_PIECE", 3)
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
  y1, g1 = _values_and_grads(dense, q, k, v, bias)
  y2, g2 = _values_and_grads(chained, q, k, v, bias)
  _close(y2, y1, 1e-5)
  _close(g2, g1, 1e-4)
  # One call on the whole sequence given the factors: in sub-pieces too.
  whole = lambda q, k, v, b: ops.aft_local(q, k, v, tuple(b), window=WINDOW, causal=True)
  y3, g3 = _values_and_grads(whole, q, k, v, bias)
  _close(y3, y1, 1e-5)
  _close(g3, g1, 1e-4)


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


def test_state_arguments_are_refused_where_there_is_no_state():
  q, k, v, w = _inputs("local", 1.0)
  _, state = ops.aft_simple(q, k, v, causal=True, output_final_state=True)
  with pytest.raises(ValueError, match=r"aft_simple: initial_state need causal=True"):
    ops.aft_simple(q, k, v, initial_state=state)
  with pytest.raises(ValueError, match=r"aft_local: output_final_state need causal=True"):
    ops.aft_local(q, k, v, w, window=2, output_final_state=True)
  with pytest.raises(ValueError, match=r"aft_full: initial_state and output_final_state"):
    ops.aft_full(q, k, v, w, causal=True, output_final_state=True)
  with pytest.raises(ValueError, match=r"aft_simple: initial_state must be the state"):
    ops.aft_simple(q[:1], k[:1], v[:1], causal=True, initial_state=state)
  with pytest.raises(ValueError, match=r"L >= offset \+ T = 12 \(offset 4, T 8\)"):
    ops.aft_local(q, k, v, w, window=2, causal=True, offset=4)


# --------------------------------------------------------------------------- AFT-local's offset


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
  run = jax.jit(lambda s, at: ops.aft_local(q[:, 5:], k[:, 5:], v[:, 5:], w, window=WINDOW,
                                            causal=True, offset=at, initial_state=s))  # fmt: skip
  _, want, _ = _local_pieces(5, 0)
  chex.assert_trees_all_close(run(state, 5), want, rtol=1e-5, atol=1e-6)
  assert np.all(np.isnan(run(state, 3)))
  # The state traced, the offset known: the same.
  assert np.all(np.isnan(jax.jit(lambda s: _local_call_at(q, k, v, w, s, 3))(state)))


def _local_call_at(q, k, v, w, state, at):
  return ops.aft_local(q[:, 5:], k[:, 5:], v[:, 5:], w, window=WINDOW, causal=True, offset=at,
                       initial_state=state)  # fmt: skip


@pytest.mark.parametrize("at", [-1, 0, 4, 5])
def test_a_traced_offset_outside_w_gives_nan(at):
  """T = 4 positions at a traced offset into w [8, 8]: offsets 0..4 fit; -1 and 5 do not, and
  a dynamic slice would clamp them to another block of w: NaN instead."""
  q, k, v, w = _inputs("local", 5.0, seed=5)
  first = lambda x: x[:, :4]
  run = jax.jit(lambda at: ops.aft_local(first(q), first(k), first(v), w, window=WINDOW,
                                         causal=True, offset=at))  # fmt: skip
  y = run(at)
  if 0 <= at <= 4:
    want = ref.aft_local(first(q), first(k), first(v), w[at:, at:][:4, :4], WINDOW, causal=True)
    chex.assert_trees_all_close(y, want, rtol=1e-5, atol=1e-6)
  else:
    assert np.all(np.isnan(y))


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
