"""The (max, numerator, denominator) triple every op sums with, and the ops' modes built on it:
states, a device's shard, packed rows (docs/kernels.md, "How each module computes")."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# An empty sum's max, an excluded logit: finite (exp(NEG - NEG) = 1, no inf - inf), the lowest.
NEG = float(np.finfo(np.float32).min)
# A block's shift is what its first row sees; a later term above this is set aside (rows redone).
EXP_MAX = 1e26
# A fast denominator below this may have lost its largest terms to underflow: recomputed.
DEN_OK = 1e-25
HIGHEST = jax.lax.Precision.HIGHEST  # products of exact sums: no TF32/bf16 passes
_sg = jax.lax.stop_gradient
_f32 = lambda x: jnp.asarray(x, jnp.float32)


def finite(x):  # whether x is finite, from a comparison (which every Pallas lowering has)
  return jnp.abs(x) <= float(np.finfo(np.float32).max)


def tame(x):  # x where finite, else 0: a causal derivative's factor (no 0 * NaN)
  return jnp.where(finite(x), x, 0.0)


def tame_bias(w):  # w where finite or -inf (no term), else 0: a bias inside a derivative
  return jnp.where(finite(w) | (w == -jnp.inf), w, 0.0)


def keep(a, lse):  # where a causal row has a derivative: its output a and normaliser L are finite
  return finite(a) & finite(lse)


def set_aside(e, v):  # (ok, e, v): ok where e <= EXP_MAX and v finite; e, v zeroed elsewhere
  ok = (e <= EXP_MAX) & finite(v)
  return ok, jnp.where(ok, e, 0.0), jnp.where(ok, v, 0.0)


def matmul(spec: str, a, b, low: bool):  # einsum at HIGHEST; low: bfloat16 factors, float32 sums
  if low:
    bf = jnp.bfloat16
    return jnp.einsum(spec, a.astype(bf), b.astype(bf), preferred_element_type=jnp.float32)
  return jnp.einsum(spec, a, b, precision=HIGHEST)


class Acc(NamedTuple):
  """A partial softmax-weighted sum: m, den ``[..., D]``; num ``[..., D]`` or ``[..., D, C]``."""

  m: jax.Array
  num: jax.Array
  den: jax.Array


def empty(shape, num_shape=None) -> Acc:  # the float32 triple of no terms (m = NEG, num = den = 0)
  zeros = lambda s: jnp.zeros(s, jnp.float32)
  return Acc(zeros(shape) + NEG, zeros(shape if num_shape is None else num_shape), zeros(shape))


def bcast(scale, num):  # ``scale`` [..., D] broadcast against ``num`` [..., D] or [..., D, C]
  return scale[..., None] if num.ndim > scale.ndim else scale


def combine(a: Acc, b: Acc) -> Acc:  # the triple of the union of two disjoint sets of terms
  x = jnp.exp(-jnp.abs(a.m - b.m))
  a_big = a.m >= b.m
  sa, sb = jnp.where(a_big, 1.0, x), jnp.where(a_big, x, 1.0)
  num = a.num * bcast(sa, a.num) + b.num * bcast(sb, b.num)
  return Acc(jnp.maximum(a.m, b.m), num, a.den * sa + b.den * sb)


def leaf(logit, value, valid=True) -> Acc:  # a term where valid, logit not -inf (den 1)
  none = ~jnp.asarray(valid) | (logit == -jnp.inf)
  m = jnp.where(none, NEG, _sg(logit))
  e = jnp.where(none, 0.0, jnp.exp(jnp.where(none, 0.0, logit - m)))
  return Acc(m, jnp.where(bcast(none, value), 0.0, value) * bcast(e, value), e)


def reduce(logits, values, axis: int, valid=True) -> Acc:  # along axis, where valid (not -inf)
  valid = jnp.broadcast_to(valid, logits.shape) & (logits != NEG) & (logits != -jnp.inf)
  logits = jnp.where(valid, logits, NEG)
  m = _sg(jnp.max(logits, axis=axis))
  p = jnp.where(valid, jnp.exp(logits - jnp.expand_dims(m, axis)), 0.0)
  values = jnp.where(bcast(valid, values), values, 0.0)
  return Acc(m, jnp.sum(bcast(p, values) * values, axis=axis), jnp.sum(p, axis=axis))


def reduce_over(acc: Acc, axis: int, valid) -> Acc:  # union of the triples along axis, valid [n]
  valid = jnp.reshape(valid, [-1 if i == axis else 1 for i in range(acc.m.ndim)])
  m = jnp.where(valid, acc.m, NEG)
  top = _sg(jnp.max(m, axis=axis, keepdims=True))
  scale = jnp.where(valid, jnp.exp(m - top), 0.0)
  num = jnp.sum(acc.num * bcast(scale, acc.num), axis=axis)
  return Acc(jnp.squeeze(top, axis), num, jnp.sum(acc.den * scale, axis=axis))


@jax.custom_jvp
def gate(q, mean):  # Y = sigma(q) * mean; its derivative's factors ``tame``
  return jax.nn.sigmoid(q) * mean


@gate.defjvp
def _gate_jvp(primals, tangents):
  (q, mean), (dq, dmean) = primals, tangents
  s = jax.nn.sigmoid(q)
  return s * mean, tame(s * (1.0 - s) * mean) * dq + tame(s) * dmean


def output(q, acc: Acc):  # sigma(q) * num / den
  return gate(q, acc.num / bcast(acc.den, acc.num))


@jax.custom_batching.custom_vmap
def _shared(flag):
  return flag


@_shared.def_vmap
def _shared_vmap(axis_size, in_batched, flag):
  return (_shared(jnp.any(flag, axis=0)) if in_batched[0] else flag), False


def cond(flag, true_fn, false_fn):  # lax.cond, flag OR-ed over any vmap axis (no select of both)
  return jax.lax.cond(_shared(jnp.asarray(flag)), true_fn, false_fn)


class WindowState(NamedTuple):
  """AFT-local's and AFT-conv1d's state: ``prefix``, the triple of keys older than the last s;
  ``keys``, ``values``: a ring of the last s (slot p % s: position p); ``index``: positions seen."""

  prefix: Acc
  keys: jax.Array
  values: jax.Array
  index: jax.Array


def window_init(k_shape, v_shape, size: int, index=0) -> WindowState:
  axis = len(k_shape) - 1
  ring = lambda s: jnp.zeros(tuple(s[:axis]) + (size,) + tuple(s[axis:]), jnp.float32)
  keys = ring(k_shape) + (0.0 if isinstance(index, int) and index == 0 else NEG)
  return WindowState(empty(k_shape, v_shape), keys, ring(v_shape), jnp.asarray(index, jnp.int32))


def _ordered(state: WindowState, axis: int):
  size = state.keys.shape[axis]
  order = (state.index + jnp.arange(size)) % size
  valid = state.index - size + jnp.arange(size) >= 0
  return jnp.take(state.keys, order, axis), jnp.take(state.values, order, axis), valid


def _along(valid, axis: int, ndim: int):
  return jnp.reshape(valid, (-1,) + (1,) * (ndim - axis - 1))


def nothing(q, k, v, state, final: bool, init):  # no positions: empty output [, state or init()]
  y = jnp.zeros(q.shape, jnp.result_type(q, k, v))
  return (y, jax.tree.map(jnp.asarray, init() if state is None else state)) if final else y


def after_state(run, q, k, v, state, fill=NEG):  # run(q, k, v), state written in front as keys
  dt, axis = jnp.result_type(q, k, v), k.ndim - 2
  if state is None:
    return run(q, k, v).astype(dt)
  prefix = state.prefix if isinstance(state, WindowState) else state
  has = prefix.den > 0
  den = jnp.where(has, prefix.den, 1.0)  # no log(0) or 0 / 0, not even in a gradient
  ks = [jnp.where(has, _f32(prefix.m) + jnp.log(den), fill)]
  vs = [jnp.where(bcast(has, prefix.num), prefix.num / bcast(den, prefix.num), 0.0)]
  ks, vs = [jnp.expand_dims(ks[0], axis)], [jnp.expand_dims(vs[0], axis)]
  if isinstance(state, WindowState):
    rk, rv, valid = _ordered(state, axis)
    ks.append(jnp.where(_along(valid, axis, rk.ndim), rk, fill))
    vs.append(jnp.where(_along(valid, axis, rv.ndim), rv, 0.0))
  k1, v1 = jnp.concatenate([*ks, _f32(k)], axis), jnp.concatenate([*vs, _f32(v)], axis)
  n = k1.shape[axis] - k.shape[axis]
  zeros = jnp.zeros(q.shape[:axis] + (n,) + q.shape[axis + 1 :], jnp.float32)
  y = run(jnp.concatenate([zeros, _f32(q)], axis), k1, v1)
  return jax.lax.slice_in_dim(y, n, y.shape[axis], axis=axis).astype(dt)


def final(state, k, v, size: int | None = None):  # after k, v: an Acc (size None) or a WindowState
  axis, t_len = k.ndim - 2, k.shape[k.ndim - 2]
  if size is None:
    acc = reduce(_f32(k), _f32(v), axis)
    return acc if state is None else combine(state, acc)
  one = lambda x: x.shape[:axis] + x.shape[axis + 1 :]
  state = window_init(one(k), one(v), size) if state is None else state
  rk, rv, valid = _ordered(state, axis)
  keys, values = jnp.concatenate([rk, _f32(k)], axis), jnp.concatenate([rv, _f32(v)], axis)
  valid = jnp.concatenate([valid, jnp.ones((t_len,), bool)])
  # The first T leave the window and join the prefix; the last s are the new ring.
  first = lambda x: jax.lax.slice_in_dim(x, 0, t_len, axis=axis)
  last = lambda x: jax.lax.slice_in_dim(x, t_len, t_len + size, axis=axis)
  leaving = reduce(first(keys), first(values), axis, _along(valid[:t_len], axis, keys.ndim))
  index = state.index + t_len
  keep_last = lambda x: jnp.where(_along(valid[t_len:], axis, x.ndim), last(x), 0.0)
  ring = lambda x: jnp.roll(keep_last(x), index % size, axis)
  return WindowState(combine(state.prefix, leaving), ring(keys), ring(values), index)


def window_step(state: WindowState, q_t, k_t, v_t, bias):  # bias(pos, age): the ring slots' biases
  axis = state.keys.ndim - 2
  size, t = state.keys.shape[axis], state.index
  slot = t % size
  # The key leaving the window (position t - s) joins the bias-free prefix.
  old = lambda ring: jax.lax.dynamic_index_in_dim(ring, slot, axis, keepdims=False)
  prefix = combine(state.prefix, leaf(old(state.keys), old(state.values), t >= size))
  put = lambda ring, x: jax.lax.dynamic_update_index_in_dim(ring, _f32(x), slot, axis)
  keys, values = put(state.keys, k_t), put(state.values, v_t)
  age = (slot - jnp.arange(size)) % size
  band = reduce(keys + bias(t - age, age), values, axis, (t - age >= 0)[:, None])
  y = output(_f32(q_t), combine(prefix, band)).astype(jnp.result_type(q_t, k_t, v_t))
  return y, WindowState(prefix, keys, values, t + 1)


def shard_state(k, v, size: int | None, axis_name):  # in shard_map: the state before this shard
  axis, n = k.ndim - 2, k.shape[k.ndim - 2]
  k, v = _f32(k), _f32(v)
  i, devices = jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)
  j = jnp.arange(devices)
  if size is None:
    return reduce_over(jax.lax.all_gather(reduce(k, v, axis), axis_name), 0, j < i)
  back = -(-size // n)  # the shards the last s keys come from
  prev = lambda x, b: jax.lax.ppermute(x, axis_name, [(d, d + b) for d in range(devices - b)])
  span = lambda x: jnp.concatenate([prev(x, b) for b in range(back, 0, -1)], axis)
  last = lambda x: jax.lax.slice_in_dim(span(x), back * n - size, back * n, axis=axis)
  # Shard i - back's keys before the ring (none: an empty triple, not an all-false mask's sum).
  edge_n = back * n - size
  zero = lambda x: jnp.zeros_like(jax.lax.index_in_dim(x, 0, axis, keepdims=False))  # x's type
  head = Acc(zero(k) + NEG, zero(v), zero(k))
  if edge_n:
    head = reduce(k, v, axis, _along(jnp.arange(n) < edge_n, axis, k.ndim))
  parts = (reduce(k, v, axis), head)
  gathered = jax.lax.all_gather(Acc(*(jnp.stack(x) for x in zip(*parts))), axis_name)
  before = reduce_over(Acc(*(x[:, 0] for x in gathered)), 0, j < i - back)
  edge = reduce_over(Acc(*(x[:, 1] for x in gathered)), 0, j == i - back)
  index = (i * n).astype(jnp.int32)
  roll = lambda x: jnp.roll(x, index % size, axis=axis)  # slot p % s holds position p
  return WindowState(combine(before, edge), roll(last(k)), roll(last(v)), index)


def _starts(segment_ids):  # per position, its segment's first (new where the id changes)
  idx = jnp.arange(segment_ids.shape[-1])
  prev = jnp.concatenate([segment_ids[..., :1], segment_ids[..., :-1]], axis=-1)
  first = (idx == 0) | (segment_ids != prev)
  return jax.lax.cummax(jnp.where(first, idx, 0), axis=segment_ids.ndim - 1)


def segment_positions(segment_ids, mask=None, shape=None):
  """(segment ids, positions) ``[..., T]`` of packed rows and a padding mask (True: a token): a
  segment wherever the id or the mask changes (pads: a segment no token sees), positions from 0
  per segment. ``shape``: ``[..., T]`` where both are None."""
  seg = jnp.zeros(shape, jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
  if mask is not None:
    seg = seg * 2 + jnp.asarray(mask, jnp.int32)
  return seg, jnp.arange(seg.shape[-1]) - _starts(seg)


def same_segment(segment_ids):
  """``[..., T, T]`` bool: t and t' in one segment (softmax attention's packed mask)."""
  start = _starts(jnp.asarray(segment_ids))
  return start[..., :, None] == start[..., None, :]


def shift(x, j, axis: int, fill):  # x[t - j] along axis >= 0, fill outside; j may be traced
  n = x.shape[axis]
  if isinstance(j, int):
    x = jnp.pad(x, [(max(j, 0), max(-j, 0)) if i == axis else (0, 0) for i in range(x.ndim)],
                constant_values=fill)  # fmt: skip
    return jax.lax.slice_in_dim(x, max(-j, 0), max(-j, 0) + n, axis=axis)
  t = jnp.arange(n).reshape((-1,) + (1,) * (x.ndim - axis - 1))
  return jnp.where((t >= j) & (t - j < n), jnp.roll(x, j, axis=axis), fill)


def packed(q, k, v, segment_ids, size: int, lag_bias):
  """Per segment: a scan over lags j < ``size`` (bias ``lag_bias(j)``), a prefix scan (bias 0)."""
  dt = jnp.result_type(q, k, v)
  k, v = _f32(k), _f32(v)
  axis, t_len = k.ndim - 2, k.shape[-2]
  seg = jnp.broadcast_to(0 if segment_ids is None else segment_ids, k.shape[:-1])
  start, t = _starts(seg)[..., None], jnp.arange(t_len)[:, None]  # [..., T, 1], [T, 1]
  size = min(size, t_len)

  def lag(acc, j):
    logit = shift(k, j, axis, 0.0) + lag_bias(j)
    return combine(acc, leaf(logit, shift(v, j, axis, 0.0), t - j >= start)), None

  acc = jax.lax.scan(lag, empty(k.shape, v.shape), jnp.arange(size))[0] if size else None

  def op(a, b):  # prefix sums that restart where b starts a segment
    both = combine(Acc(*a[1]), Acc(*b[1]))
    return a[0] | b[0], tuple(jnp.where(bcast(b[0], y), y, x) for x, y in zip(both, b[1]))

  flags = jnp.broadcast_to(start == t, k.shape)
  run = jax.lax.associative_scan(op, (flags, tuple(leaf(k, v))), axis=axis)[1]
  old = t - size >= start  # the bias-0 keys: the segment's prefix sums, size back
  fills = (NEG, 0.0, 0.0)
  old = Acc(*(jnp.where(bcast(old, x), shift(x, size, axis, f), f) for x, f in zip(run, fills)))
  acc = old if acc is None else combine(acc, old)
  return (jax.nn.sigmoid(_f32(q)) * acc.num / bcast(acc.den, acc.num)).astype(dt)
