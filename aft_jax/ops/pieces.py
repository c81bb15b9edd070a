"""The state mode: the causal ops on a piece of a sequence, ``initial_state`` in,
``(Y, final state)`` out (``run``; the arguments checked by ``arguments``).

Each function takes ``run``, the op itself on plain arguments (its resolved implementation,
causal, no state), and runs it on the piece with the state prepended as keys (``state``'s
module docstring: the prefix triple as one key, then the ring's s keys); the prepended rows'
outputs are dropped. So every implementation of the op (XLA or kernel) serves pieces, and
chained pieces equal one call up to float rounding, values and gradients (through the state
too: its num and den carry them).

A piece of T = 0 positions gives the empty output and the state it was given. AFT-local's
``offset`` is the piece's position in w; without a state the positions before it hold no keys,
and the final state is that of a sequence whose next token is at offset + T (its ``index``). An
offset that could not be checked at trace time (``arguments.Call.guard``) makes the piece's
output NaN where it is wrong, never a bias read at a clamped position.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from aft_jax.ops import logsumexp as lse
from aft_jax.ops import plain
from aft_jax.ops import state as st


class Factors(NamedTuple):
  """AFT-local's bias as its factors, w = u v^T with u, v ``[L, d']``: a piece (or a device's
  shard) forms only the block of w it reads, never the [L, L] whole."""

  u: jax.Array
  v: jax.Array

  @property
  def shape(self):
    return (self.u.shape[0], self.v.shape[0])

  @property
  def ndim(self):
    return 2

  def dense(self):
    """w = u v^T ``[L, L]`` (float32)."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return f32(self.u) @ f32(self.v).T


def run(call):
  """Y, or (Y, final state) with ``output_final_state``, of a piece (``arguments.Call``, mode
  "state") of causal AFT-simple, AFT-local or AFT-conv1d."""
  fn, q, k, v, w, size = call.fn, call.q, call.k, call.v, call.w, call.size
  state, final = call.initial_state, call.output_final_state
  if k.shape[k.ndim - 2] == 0:  # no positions: nothing to run, the state as it was
    return _nothing(call)
  if fn == "aft_simple":
    return simple(plain.causal(fn, call.impl), q, k, v, state, final)
  if fn == "aft_conv1d":
    return conv1d(plain.causal(fn, call.impl, kernel=w), q, k, v, w, state, final)
  run = plain.causal(fn, call.impl, window=size)
  out = local(run, q, k, v, w, size, call.offset, state, final)
  if call.guard is None:
    return out
  y, rest = (out[0], out[1:]) if final else (out, ())
  y = jnp.where(call.guard, y, jnp.nan).astype(y.dtype)  # an offset that cannot be right
  return (y, *rest) if final else y


def _nothing(call):
  """A piece of no positions: the empty output and the state it was given (or the one before
  any position)."""
  y = jnp.zeros(call.q.shape, jnp.result_type(call.q, call.k, call.v))
  if not call.output_final_state:
    return y
  state, k, v = call.initial_state, call.k, call.v
  axis = k.ndim - 2
  if state is None and call.fn == "aft_simple":
    state = lse.empty(k.shape[:axis] + k.shape[axis + 1 :])
  elif state is None:
    one = lambda x: x.shape[:axis] + x.shape[axis + 1 :]
    at = 0 if call.offset is None else call.offset  # (AFT-conv1d: None)
    state = st.window_init(one(k), one(v), call.size, at)
  return y, jax.tree.map(jnp.asarray, state)


def _drop(y, n: int, axis: int, dtype):
  return jax.lax.slice_in_dim(y, n, y.shape[axis], axis=axis).astype(dtype)


def _zeros_before(q, n: int, axis: int):
  shape = q.shape[:axis] + (n,) + q.shape[axis + 1 :]
  return jnp.concatenate([jnp.zeros(shape, jnp.float32), jnp.asarray(q, jnp.float32)], axis)


def simple(run, q, k, v, initial_state, output_final_state: bool):
  """Causal AFT-simple on q, k, v ``[..., T, D]`` after ``initial_state`` (``logsumexp.Acc``)."""
  dt = jnp.result_type(q, k, v)
  if initial_state is None:
    y = run(q, k, v)
  else:
    k1, v1 = st.prepend_simple(initial_state, k, v)
    y = _drop(run(_zeros_before(q, 1, q.ndim - 2), k1, v1), 1, q.ndim - 2, dt)
  return (y, st.final_simple(initial_state, k, v)) if output_final_state else y


def local(run, q, k, v, w, window: int, offset, initial_state, output_final_state: bool):
  """Causal AFT-local on q, k, v ``[..., T, D]`` at positions offset .. offset + T - 1 of w
  ``[L, L]`` after ``initial_state`` (``state.WindowState``, index = offset)."""
  dt = jnp.result_type(q, k, v)
  t_len, axis = q.shape[-2], q.ndim - 2
  n = 0 if initial_state is None else 1 + window  # prepended positions
  if not isinstance(w, Factors):
    w = jnp.asarray(w, jnp.float32)
  whole = isinstance(offset, int) and offset == 0 and n == 0 and w.shape[0] == t_len
  # A whole sequence given its factors also goes in sub-pieces: never the [T, T] product.
  if (not whole or isinstance(w, Factors)) and in_sub_pieces(t_len, window):
    return _local_in_sub_pieces(run, q, k, v, w, window, offset, initial_state, output_final_state)
  if whole:
    piece_w = w.dense() if isinstance(w, Factors) else w
  else:  # the rows and columns of positions offset - n .. offset + T - 1
    piece_w = _block(w, offset, n, t_len)
  if n == 0:
    y = run(q, k, v, piece_w).astype(dt)
  else:
    k1, v1 = st.prepend_window(initial_state, k, v, lse.NEG)
    y = _drop(run(_zeros_before(q, n, axis), k1, v1, piece_w), n, axis, dt)
  if not output_final_state:
    return y
  if initial_state is None:  # nothing before the piece: the state of its first position
    initial_state = _empty_at(q, window, offset)
  return y, st.final_window(initial_state, k, v, window)


def _empty_at(q, window: int, offset) -> st.WindowState:
  lead = q.shape[: q.ndim - 2]
  return st.window_init(lead + q.shape[-1:], lead + q.shape[-1:], window, offset)


# A long piece reads its bias in sub-pieces of this many positions (at least 4 windows), one
# after another with the state between: the banded op takes a square block of w per call, and
# blocks of [SUB_PIECE + s + 1]^2 keep the bias's memory linear in T (a [T, T] block per device
# would grow as the square of the shard).
SUB_PIECE = 2048


def _sub_piece(window: int) -> int:
  return max(SUB_PIECE, 4 * window)


def in_sub_pieces(t_len: int, window: int) -> bool:
  """Whether ``local`` runs a piece of T positions not given its whole [T, T] bias in
  sub-pieces: T is more than two of them."""
  return t_len > 2 * _sub_piece(window)


def _local_in_sub_pieces(run, q, k, v, w, window, offset, initial_state, output_final_state):
  """``local`` on T = m c + r positions as m sub-pieces of c (a ``lax.scan``, the state
  carried) and the r left over; the same result as one call."""
  t_len, axis = q.shape[-2], q.ndim - 2
  c = _sub_piece(window)
  m = t_len // c
  lead = q.shape[:axis]
  if initial_state is None:
    initial_state = _empty_at(q, window, offset)
  split = lambda x: jnp.moveaxis(
    jax.lax.slice_in_dim(x, 0, m * c, axis=axis).reshape(lead + (m, c) + x.shape[-1:]), axis, 0
  )

  # The offset into w is carried beside the state (whose index is the same position; without
  # an initial state, the empty state at ``offset``, whose positions hold no keys).
  def step(carry, qkv):
    state, at = carry
    y, state = local(run, *qkv, w, window, at, state, True)
    return (state, at + c), y

  start = (initial_state, jnp.asarray(offset, jnp.int32))
  (state, at), ys = jax.lax.scan(step, start, tuple(split(x) for x in (q, k, v)))
  ys = jnp.moveaxis(ys, 0, axis).reshape(lead + (m * c,) + q.shape[-1:])
  rest = lambda x: jax.lax.slice_in_dim(x, m * c, t_len, axis=axis)
  if m * c < t_len:
    y, state = local(run, rest(q), rest(k), rest(v), w, window, at, state, True)
    ys = jnp.concatenate([ys, y], axis)
  return (ys, state) if output_final_state else ys


def _block(w, offset, n: int, t_len: int):
  """w's rows and columns of positions offset - n .. offset + T - 1, ``[n + T, n + T]``; those
  of positions before 0 (prepended rows, keys that do not exist: their values are never used)
  are 0. A slice of w where offset >= n, else of w's top-left block padded by n: no copy of w,
  whose [L, L] can be the whole sequence's (context parallelism)."""
  size = n + t_len
  if isinstance(w, Factors):  # that block of u v^T alone
    pos = jnp.clip(offset - n + jnp.arange(size), 0, w.shape[0] - 1)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return f32(w.u)[pos] @ f32(w.v)[pos].T
  corner = jnp.pad(w[:size, :size], ((n, 0), (n, 0)))
  early = jax.lax.dynamic_slice(corner, (offset, offset), (size, size))
  if size > w.shape[0]:  # then offset + T <= L means offset < n: always early
    return early
  late = jax.lax.dynamic_slice(w, (offset - n, offset - n), (size, size))
  if isinstance(offset, int):
    return late if offset >= n else early
  return jnp.where(offset >= n, late, early)


def conv1d(run, q, k, v, kernel, initial_state, output_final_state: bool):
  """Causal AFT-conv1d on q, v ``[..., T, H, C]``, k ``[..., T, H]`` after ``initial_state``
  (``state.WindowState`` of the kernel's size s)."""
  dt = jnp.result_type(q, k, v)
  size, axis = kernel.shape[-1], k.ndim - 2
  if initial_state is None:
    y = run(q, k, v)
  else:
    # -inf: AFT-conv's leaves take a key of -inf as no term (``conv._leaf``).
    k1, v1 = st.prepend_window(initial_state, k, v, -jnp.inf)
    y = _drop(run(_zeros_before(q, 1 + size, axis), k1, v1), 1 + size, axis, dt)
  return (y, st.final_window(initial_state, k, v, size)) if output_final_state else y
