"""The state of a causal op between calls: one sequence in pieces, exactly.

A causal op sums over t' <= t, so what a piece needs from everything before it is a summary,
the state (every sum an exact (m, num, den) triple of ``logsumexp``):

    AFT-simple   ``logsumexp.Acc``: the triple of every key so far, m, num, den ``[..., D]``.
    AFT-local    ``WindowState``: ``prefix``, the triple of every key older than the last s
    AFT-conv1d   (bias 0 for every later position); ``keys``, ``values``, a ring buffer of the
                 last s keys and values (slot p % s holds position p); ``index``, the number of
                 positions seen. s = window (AFT-local) or kernel_size (AFT-conv1d).

These are the states of the one-token steps (``step``) too, so a prompt encoded in one call
(``output_final_state=True``) is decoded on from its state, and a state from the steps feeds a
call. The state is float32 and carries gradients (num and den; m never does).

How a piece uses a state (``prepend``): the state is written as keys in front of the piece,
which the op then runs on as it is (XLA or kernel, the same maths): the prefix triple as one key
of logit m + log(den) and value num / den (exactly the weight and mean of all its terms), then
the ring's s keys in order. The prefix key sits s + 1 positions before the piece's first row,
outside every row's band or kernel, so its bias is 0, as the bias of the keys it stands for is;
the ring's keys are at their true distances. Positions that do not exist (the ring before s
positions were seen, an empty prefix) are keys that weigh nothing (logit ``NEG``, or -inf for
AFT-conv1d, whose leaves treat -inf as no term). The outputs of the prepended rows are dropped.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from aft_jax.ops import logsumexp as lse

_sg = jax.lax.stop_gradient
_f32 = lambda x: jnp.asarray(x, jnp.float32)


class WindowState(NamedTuple):
  """AFT-local's and AFT-conv1d's state: ``prefix``, the triple of every key older than the
  last s positions; keys ``[..., s, D]`` (AFT-conv1d ``[..., s, H]``) and values of the same
  shape (AFT-conv1d ``[..., s, H, C]``), a ring buffer of the last s (slot p % s holds position
  p; a slot of a position < 0 is empty, its contents ignored); ``index``, the positions seen
  (int32 [])."""

  prefix: lse.Acc
  keys: jax.Array
  values: jax.Array
  index: jax.Array


class FullState(NamedTuple):
  """AFT-full's decoding state: keys, values ``[..., L, D]`` (slot t' holds position t') and
  ``index``, the number of tokens seen (int32 [])."""

  keys: jax.Array
  values: jax.Array
  index: jax.Array


def window_init(k_shape, v_shape, size: int, index=0) -> WindowState:
  """The state before any position, for one position's k ``k_shape`` ``[..., H]`` and v
  ``v_shape`` (``[..., H]`` or ``[..., H, C]``) and a window of ``size``. With ``index`` (an
  int or a traced int) > 0: the state of ``index`` positions that hold no keys (a piece that
  starts there with nothing before it): the ring's keys are ``NEG``, terms that weigh nothing."""
  axis = len(k_shape) - 1  # the ring's axis: before the channels (H, or H and C)
  ring = lambda s: jnp.zeros(tuple(s[:axis]) + (size,) + tuple(s[axis:]), jnp.float32)
  keys = ring(k_shape) if isinstance(index, int) and index == 0 else ring(k_shape) + lse.NEG
  return WindowState(
    lse.empty(k_shape, v_shape), keys, ring(v_shape), jnp.asarray(index, jnp.int32)
  )


def reduce(k, v, axis: int, valid=None) -> lse.Acc:
  """The triple of the terms exp(k) v along ``axis`` (non-negative; kept out of the result),
  where ``valid`` (broadcast against k). k ``[..., T, ..., H]``; v k's shape or one more axis.

  The maximum carries no gradient (it cancels in num / den). A key of ``NEG`` is no term (the
  ring of ``window_init`` at an index > 0), even where it is the only one."""
  return lse.from_terms(k, v, (k != lse.NEG) & (True if valid is None else valid), axis)


def reduce_over(acc: lse.Acc, axis: int, valid) -> lse.Acc:
  """The union of the triples laid out along ``axis`` of ``acc`` where ``valid`` ``[n]``."""
  shape = [1] * acc.m.ndim
  shape[axis] = -1
  keep = jnp.reshape(valid, shape)
  m = jnp.where(keep, acc.m, lse.NEG)
  top = _sg(jnp.max(m, axis=axis, keepdims=True))
  scale = jnp.where(keep, jnp.exp(m - top), 0.0)
  return lse.Acc(
    jnp.squeeze(top, axis),
    jnp.sum(acc.num * lse.bcast(scale, acc.num), axis=axis),
    jnp.sum(acc.den * scale, axis=axis),
  )


def as_key(acc: lse.Acc, fill):
  """The triple as one term: (logit m + log den, value num / den), ``[..., D]`` (value
  ``[..., D, C]`` for AFT-conv1d); logit ``fill`` and value 0 where it has no terms."""
  has = acc.den > 0
  den = jnp.where(has, acc.den, 1.0)  # no log(0) or 0 / 0, not even in a gradient
  logit = jnp.where(has, _f32(acc.m) + jnp.log(den), fill)
  value = jnp.where(lse.bcast(has, acc.num), acc.num / lse.bcast(den, acc.num), 0.0)
  return logit, value


def _ordered(state: WindowState, axis: int):
  """The ring's keys, values in position order (oldest first) and which positions exist."""
  size = state.keys.shape[axis]
  order = (state.index + jnp.arange(size)) % size  # slot of position index - s + i
  valid = state.index - size + jnp.arange(size) >= 0
  take = lambda ring: jnp.take(ring, order, axis=axis)
  return take(state.keys), take(state.values), valid


def _along(valid, axis: int, ndim: int):
  """``valid`` [n] shaped to broadcast along ``axis`` of an ``ndim`` array."""
  return jnp.reshape(valid, (-1,) + (1,) * (ndim - axis - 1))


def prepend_simple(state: lse.Acc, k, v):
  """k, v ``[..., T, D]`` with AFT-simple's state as one key in front: ``[..., 1 + T, D]``."""
  logit, value = as_key(state, lse.NEG)
  cat = lambda x, x0: jnp.concatenate([x0[..., None, :], _f32(x)], axis=-2)
  return cat(k, logit), cat(v, value)


def prepend_window(state: WindowState, k, v, fill):
  """k, v (T on axis ``a`` = k.ndim - 2) with the state in front, ``1 + s + T`` positions:
  the prefix key, then the ring's s keys in order (``fill`` where a position does not exist)."""
  axis = k.ndim - 2
  logit, value = as_key(state.prefix, fill)
  rk, rv, valid = _ordered(state, axis)
  rk = jnp.where(_along(valid, axis, rk.ndim), rk, fill)
  rv = jnp.where(_along(valid, axis, rv.ndim), rv, 0.0)
  ext = lambda x0, ring, x: jnp.concatenate([jnp.expand_dims(x0, axis), ring, _f32(x)], axis)
  return ext(logit, rk, k), ext(value, rv, v)


def final_simple(state: lse.Acc | None, k, v) -> lse.Acc:
  """The state after k, v ``[..., T, D]``, from ``state`` (None: the empty one)."""
  acc = reduce(_f32(k), _f32(v), k.ndim - 2)
  return acc if state is None else lse.combine(state, acc)


def final_window(state: WindowState | None, k, v, size: int) -> WindowState:
  """The state after k, v (T on axis k.ndim - 2) from ``state`` (None: the empty one)."""
  axis = k.ndim - 2
  if state is None:
    state = window_init(
      k.shape[:axis] + k.shape[axis + 1 :], v.shape[:axis] + v.shape[axis + 1 :], size
    )
  t_len = k.shape[axis]
  rk, rv, valid = _ordered(state, axis)
  keys = jnp.concatenate([rk, _f32(k)], axis)  # [s + T] positions index - s ...
  values = jnp.concatenate([rv, _f32(v)], axis)
  valid = jnp.concatenate([valid, jnp.ones((t_len,), bool)])
  # The first T of them leave the window and join the prefix; the last s are the new ring.
  first = lambda x: jax.lax.slice_in_dim(x, 0, t_len, axis=axis)
  last = lambda x: jax.lax.slice_in_dim(x, t_len, t_len + size, axis=axis)
  leaving = reduce(first(keys), first(values), axis, _along(valid[:t_len], axis, keys.ndim))
  index = state.index + t_len
  keep_k = _along(valid[t_len:], axis, keys.ndim)
  keep_v = _along(valid[t_len:], axis, values.ndim)
  # Slot p % s holds position p: the ring's oldest position is index - s.
  roll = lambda x: jnp.roll(x, index % size, axis=axis)
  return WindowState(
    lse.combine(state.prefix, leaving),
    roll(jnp.where(keep_k, last(keys), 0.0)),
    roll(jnp.where(keep_v, last(values), 0.0)),
    index,
  )
