"""The packed mode: the causal ops on packed rows, ``segment_ids`` (documents that do not see
each other) and ``positions`` (each document's own rows and columns of the bias).

A row packs several documents: ``segment_ids`` ``[..., T]`` (ints), a new segment starting
wherever the id changes (so a padding run after a document is a segment of its own). Position
t sums over the keys t' <= t of its own segment only, and with ``positions`` ``[..., T]`` (the
index of each position into the bias, restarting at 0 per document as packing gives; default
t) the bias of a key at lag j = t - t' is

    AFT-local   w[positions[t], positions[t']] for j < window, 0 for older keys
    AFT-full    w[positions[t], positions[t']] for every key
    AFT-conv1d  kernel[:, j] for j < s, 0 for older keys
    AFT-simple  0

so each document gets what the op gives on it alone. Computed exactly, in XLA, with plain
autodiff: the biased lags one at a time (a scan over j < size, each an (m, num, den) leaf
combined into the row's sum), and the bias-0 keys older than that as a segmented prefix scan of
the same log-sum-exp monoid that resets at each segment's first position (an associative scan),
read size positions back. O(T size D) time; the backward pass keeps the scan's carries,
O(T size D) memory for AFT-full (size = T): a path for packed training rows, not long ones.
A position of ``positions`` outside w (negative, or >= L) gives NaN in every output that reads
its bias (a traced index cannot raise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aft_jax.ops import logsumexp as lse

_sg = jax.lax.stop_gradient


def _starts(segment_ids):
  """Per position, the index of its segment's first position, ``[..., T]``."""
  t_len = segment_ids.shape[-1]
  idx = jnp.arange(t_len)
  prev = jnp.concatenate([segment_ids[..., :1], segment_ids[..., :-1]], axis=-1)
  first = (idx == 0) | (segment_ids != prev)
  return jax.lax.cummax(jnp.where(first, idx, 0), axis=segment_ids.ndim - 1)


def _leaf(logit, value, valid) -> lse.Acc:
  """One term per position (exp(logit) value) where ``valid``: m carries no gradient."""
  m = _sg(logit)
  e = jnp.exp(logit - m)  # 1, with the logit's gradient
  return lse.Acc(
    jnp.where(valid, m, lse.NEG),
    jnp.where(lse.bcast(valid, value), value * lse.bcast(e, value), 0.0),
    jnp.where(valid, e, 0.0),
  )


def _shift(x, j, axis: int, fill):
  """x[..., t - j, ...] along ``axis`` (``fill`` for t < j); j may be traced."""
  rolled = jnp.roll(x, j, axis=axis)
  t = jnp.arange(x.shape[axis]).reshape((-1,) + (1,) * (x.ndim - axis - 1))
  return jnp.where(t >= j, rolled, fill)


def _prefix(leaf: lse.Acc, first, axis: int) -> lse.Acc:
  """Inclusive prefix sums along ``axis`` that restart where ``first`` (broadcast to m)."""

  def op(a, b):
    (fa, acc_a), (fb, acc_b) = a, b
    both = lse.combine(lse.Acc(*acc_a), lse.Acc(*acc_b))
    pick = lambda x, y: jnp.where(lse.bcast(fb, x), y, x)
    return fa | fb, tuple(pick(x, y) for x, y in zip(both, acc_b))

  flags = jnp.broadcast_to(first, leaf.m.shape)
  _, out = jax.lax.associative_scan(op, (flags, tuple(leaf)), axis=axis)
  return lse.Acc(*out)


def causal_mean(k, v, segment_ids, size: int, lag_bias):
  """sum_{t' <= t, same segment} exp(k[t'] + b) v[t'] / sum (the same without v).

  k ``[..., T, H]``, v ``[..., T, H]`` or ``[..., T, H, C]`` (float32); segment_ids
  ``[..., T]``; ``lag_bias(j)``: the bias of the key at lag j < ``size`` for each row,
  broadcast against k (older keys: bias 0). Returns the mean, v's shape.
  """
  axis, t_len = k.ndim - 2, k.shape[-2]
  start = _starts(jnp.broadcast_to(segment_ids, k.shape[:-1]))[..., None]  # [..., T, 1]
  t = jnp.arange(t_len)[:, None]
  size = min(size, t_len)

  def lag(acc, j):
    logit = _shift(k, j, axis, 0.0) + lag_bias(j)
    value = _shift(v, j, axis, 0.0)
    return lse.combine(acc, _leaf(logit, value, t - j >= start)), None

  acc = lse.empty(k.shape, v.shape)
  if size:
    acc, _ = jax.lax.scan(lag, acc, jnp.arange(size))
  # The bias-0 keys: the segment's prefix sums, read ``size`` positions back.
  run = _prefix(_leaf(k, v, jnp.ones(k.shape, bool)), start == t, axis)
  old = lse.Acc(*(_shift(x, size, axis, f) for x, f in zip(run, (lse.NEG, 0.0, 0.0))))
  keep = t - size >= start
  old = lse.Acc(
    jnp.where(keep, old.m, lse.NEG),
    jnp.where(lse.bcast(keep, old.num), old.num, 0.0),
    jnp.where(keep, old.den, 0.0),
  )
  acc = lse.combine(acc, old)
  return acc.num / lse.bcast(acc.den, acc.num)


def check(fn, q_shape, segment_ids, positions):
  """ValueError unless segment_ids and positions are int ``[..., T]`` arrays of q's leading
  shape (``q_shape``: ``[..., T, D]``; AFT-conv1d ``[..., T, H, C]`` is passed as
  ``[..., T, H]``)."""
  lead = tuple(q_shape[:-1])
  for name, x in (("segment_ids", segment_ids), ("positions", positions)):
    if x is None:
      continue
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer) or jnp.shape(x) != lead:
      raise ValueError(
        f"{fn}: {name} must be an int array [..., T] = {lead} for q {tuple(q_shape)}; got "
        f"{name} {jnp.result_type(x).name} {jnp.shape(x)}"
      )


def band_bias(w, positions, t_len: int):
  """``lag_bias`` for AFT-local/full: w[positions[t], positions[t - j]] ``[..., T, 1]``."""
  w = jnp.asarray(w, jnp.float32)
  pos = jnp.arange(t_len) if positions is None else jnp.asarray(positions)

  def bias(j):
    key = _shift(pos, j, pos.ndim - 1, 0)
    got = w.at[pos, key].get(mode="fill", fill_value=jnp.nan)
    # A negative index would count from the end of w (NumPy's rule), not fall outside it.
    return jnp.where((pos >= 0) & (key >= 0), got, jnp.nan)[..., None]

  return bias


def gated(q, k, v, segment_ids, size: int, lag_bias):
  """sigma(q) * ``causal_mean``, in the dtype of the inputs (computed in float32)."""
  dt = jnp.result_type(q, k, v)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  seg = jnp.zeros(k.shape[:-1], jnp.int32) if segment_ids is None else segment_ids
  mean = causal_mean(f32(k), f32(v), seg, size, lag_bias)
  return (jax.nn.sigmoid(f32(q)) * mean).astype(dt)


def run(call):
  """Y of causal AFT-full, AFT-local, AFT-simple or AFT-conv1d on packed rows
  (``arguments.Call``, mode "packed"; ``size``: the window, AFT-full's T, the kernel's s)."""
  q, k, v, w, seg = call.q, call.k, call.v, call.w, call.segment_ids
  if call.fn == "aft_simple":
    return gated(q, k, v, seg, 0, None)
  if call.fn == "aft_conv1d":
    kernel_t = jnp.asarray(w, jnp.float32).T  # [s, H]: row j the bias at lag j
    return gated(q, k, v, seg, call.size, lambda j: kernel_t[j])
  return gated(q, k, v, seg, call.size, band_bias(w, call.positions, q.shape[-2]))


def same_segment(segment_ids):
  """``[..., T, T]`` bool: entry [t, t'] is True where t and t' are in one segment (a segment
  starts wherever the id changes, as in every packed op): softmax attention's packed mask."""
  start = _starts(jnp.asarray(segment_ids))
  return start[..., :, None] == start[..., None, :]


def from_mask(segment_ids, mask, shape):
  """(segment ids, positions) ``[..., T]`` for packed rows and a padding mask (True: a token;
  ``shape`` ``[..., T]`` when both are None): a new segment wherever the id or the mask
  changes, so a run of pads is a segment of its own that no token sees, and each segment's
  positions from 0."""
  seg = jnp.zeros(shape, jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
  if mask is not None:
    seg = seg * 2 + jnp.asarray(mask, jnp.int32)
  return seg, jnp.arange(seg.shape[-1]) - _starts(seg)
