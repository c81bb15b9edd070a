"""The AFT operations (Zhai et al., 2021, arXiv 2105.14103) as pure jax.numpy functions.

Notation: ``q, k, v`` are ``[..., T, D]`` (any leading batch dims); ``sigma`` is the sigmoid.
Every op computes, for each position ``t`` and channel ``d``,

    Y[t, d] = sigma(q[t, d]) * sum_t' exp(k[t', d] + w[t, t']) v[t', d]
                              / sum_t' exp(k[t', d] + w[t, t'])

and the variants differ only in the position bias ``w`` and in which ``t'`` are summed
(``causal=True``: ``t' <= t``).

Numerical stability. ``exp`` overflows float32 above ~88, and with logits ``k + w`` of large
magnitude a single shift per row of ``w`` and per channel of ``k`` is not enough: the largest
``w`` and the largest ``k`` usually sit at different ``t'``, and every shifted term underflows.
So every sum here is an exact log-sum-exp: partial sums are carried as triples
``(m, num, den)`` = (max logit, sum exp(logit - m) v, sum exp(logit - m)), combined like a stable
log-sum-exp, and prefix sums use an associative scan with a carried maximum. Results are finite
and accurate in float32 for logits of any size. bfloat16 inputs are computed in float32 and
returned in bfloat16.

Cost. Positions where ``w == 0`` (everything outside AFT-local's window or AFT-conv's kernel,
and all of AFT-simple) are summed with prefix/suffix scans in O(T D); only positions with a
bias are summed explicitly, in query blocks, so AFT-local costs O(T s D) and never builds a
T x T array when s << T, and AFT-full never builds a [T, T, D] array.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["aft_full", "aft_simple", "aft_local", "aft_conv1d", "aft_conv2d"]

# The max of an empty sum. Finite (not -inf) so that exp(NEG - NEG) = 1 multiplies zeros and no
# inf - inf = NaN can reach a gradient.
_NEG = -1e30
# Elements of the [..., block, keys, D] logits tensor materialised per query block.
_BLOCK_ELEMENTS = 1 << 22


class _Acc(NamedTuple):
  """A partial softmax-weighted sum: m, den ``[..., D]``; num ``[..., D]`` or ``[..., D, C]``."""

  m: jax.Array
  num: jax.Array
  den: jax.Array


def _bcast(scale, num):
  return scale[..., None] if num.ndim > scale.ndim else scale


def _combine(a: _Acc, b: _Acc) -> _Acc:
  """(m, num, den) of the union of two disjoint sets of terms (stable log-sum-exp)."""
  m = jnp.maximum(a.m, b.m)
  sa, sb = jnp.exp(a.m - m), jnp.exp(b.m - m)
  return _Acc(m, a.num * _bcast(sa, a.num) + b.num * _bcast(sb, b.num), a.den * sa + b.den * sb)


def _leaf(k, v) -> _Acc:
  """One term per position: logit k, value v."""
  return _Acc(k, v, jnp.ones_like(k))


def _shift(x, offset: int, axis: int, fill):
  """y[..., i, ...] = x[..., i + offset, ...] along ``axis``; ``fill`` where out of range."""
  n = x.shape[axis]
  if abs(offset) >= n:
    return jnp.full_like(x, fill)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (max(-offset, 0), max(offset, 0))
  x = jnp.pad(x, pad, constant_values=fill)
  return jax.lax.slice_in_dim(x, max(offset, 0), max(offset, 0) + n, axis=axis)


def _acc_shift(acc: _Acc, offset: int, axis: int) -> _Acc:
  return _Acc(_shift(acc.m, offset, axis, _NEG), _shift(acc.num, offset, axis, 0.0),
              _shift(acc.den, offset, axis, 0.0))


def _acc_scan(acc: _Acc, axis: int, reverse: bool = False) -> _Acc:
  """Inclusive prefix (or suffix) sums along ``axis`` with a carried maximum."""
  return jax.lax.associative_scan(_combine, acc, reverse=reverse, axis=axis)


def _acc_reduce(acc: _Acc, axis: int) -> _Acc:
  """The whole sum along ``axis`` (the axis is kept, with size 1)."""
  m = jnp.max(acc.m, axis=axis, keepdims=True)
  s = jnp.exp(acc.m - m)  # positive axes index num and m alike
  return _Acc(m, jnp.sum(acc.num * _bcast(s, acc.num), axis=axis, keepdims=True),
              jnp.sum(acc.den * s, axis=axis, keepdims=True))


def _outside(leaf: _Acc, axis: int, before: int | None, after: int | None) -> _Acc | None:
  """Sum of the terms at t' <= t - before and t' >= t + after (w = 0 there); None if none."""
  parts = []
  if before is not None:
    parts.append(_acc_shift(_acc_scan(leaf, axis), -before, axis))
  if after is not None:
    parts.append(_acc_shift(_acc_scan(leaf, axis, reverse=True), after, axis))
  if not parts:
    return None
  return parts[0] if len(parts) == 1 else _combine(*parts)


def _finish(q, acc: _Acc, dtype):
  return (jax.nn.sigmoid(q) * (acc.num / _bcast(acc.den, acc.num))).astype(dtype)


def _block_size(t_len: int, per_pair: int, extra_keys: int) -> int:
  """Largest query block c with c * (c + extra_keys) * per_pair <= _BLOCK_ELEMENTS."""
  budget = _BLOCK_ELEMENTS / max(1, per_pair)
  c = int((-extra_keys + math.sqrt(extra_keys * extra_keys + 4 * budget)) / 2)
  return max(1, min(t_len, c))


def _band(k, v, w, lo: int, hi: int) -> _Acc:
  """Exact sum over t' in [t + lo, t + hi] (clipped to [0, T)) with logits k[t'] + w[t, t'].

  k, v: [..., T, D] float32; w: [T, T]. Computed in blocks of c queries against the
  c + hi - lo keys they can see, so the largest array is [..., c, c + hi - lo, D]; the
  entries of w are gathered per block, so no copy of w (nor any other T x T array) is made.
  """
  t_len, d = k.shape[-2], k.shape[-1]
  per_pair = math.prod(k.shape[:-2]) * d
  c = _block_size(t_len, per_pair, hi - lo)
  nb = -(-t_len // c)
  t_pad = nb * c
  all_keys = c + hi - lo >= t_len
  if all_keys:  # every block sees every key: no key slicing needed
    width, kp, vp = t_len, k, v
  else:
    width = c + hi - lo
    pads = ((0, 0),) * (k.ndim - 2) + ((-lo, t_pad - t_len + hi), (0, 0))
    kp, vp = jnp.pad(k, pads), jnp.pad(v, pads)

  def block(i):
    start = i * c
    if all_keys:
      kb, vb, key0 = kp, vp, 0
    else:  # padded index start <-> original index start + lo
      kb = jax.lax.dynamic_slice_in_dim(kp, start, width, axis=-2)
      vb = jax.lax.dynamic_slice_in_dim(vp, start, width, axis=-2)
      key0 = start + lo
    t = start + jnp.arange(c)[:, None]
    tk = key0 + jnp.arange(width)[None, :]
    mask = (tk >= t + lo) & (tk <= t + hi) & (tk >= 0) & (tk < t_len)  # [c, width]
    wb = w[jnp.clip(t, 0, t_len - 1), jnp.clip(tk, 0, t_len - 1)]
    logits = jnp.where(mask[:, :, None], kb[..., None, :, :] + wb[:, :, None], _NEG)
    m = jnp.max(logits, axis=-2)  # [..., c, D]
    p = jnp.where(mask[:, :, None], jnp.exp(logits - m[..., None, :]), 0.0)
    return _Acc(m, jnp.sum(p * vb[..., None, :, :], axis=-2), jnp.sum(p, axis=-2))

  # Recompute each block in the backward pass instead of storing its [c, width, D] logits.
  blocks = jax.lax.map(jax.checkpoint(block), jnp.arange(nb))

  def unblock(x):  # [nb, ..., c, D] -> [..., T, D]
    x = jnp.moveaxis(x, 0, -3)
    return x.reshape(x.shape[:-3] + (t_pad, d))[..., :t_len, :]

  return _Acc(*(unblock(x) for x in blocks))


# --------------------------------------------------------------------------- validation


def _check_qkv(fn, q, k, v):
  if q.ndim < 2:
    raise ValueError(f"{fn}: q must be [..., T, D], got shape {q.shape}")
  if k.shape != q.shape or v.shape != q.shape:
    raise ValueError(
        f"{fn}: q, k and v must have the same shape [..., T, D]; got q {q.shape}, "
        f"k {k.shape}, v {v.shape}")


def _check_w(fn, w, t_len):
  if w.shape != (t_len, t_len):
    raise ValueError(
        f"{fn}: w must be [T, T] = {(t_len, t_len)} for T = {t_len}; got w {w.shape} "
        "(slice the top-left block of a larger bias first)")


def _check_window(fn, window):
  if not isinstance(window, int) or isinstance(window, bool) or window < 1:
    raise ValueError(f"{fn}: window must be an int >= 1, got {window!r}")


def _compute_dtype(*xs):
  """(output dtype, compute dtype): bfloat16 and float16 are computed in float32."""
  dt = jnp.result_type(*xs)
  return dt, jnp.promote_types(dt, jnp.float32)


def _cast(dt, *xs):
  return tuple(jnp.asarray(x, dt) for x in xs)


# --------------------------------------------------------------------------- the ops


def aft_full(q, k, v, w, *, causal: bool = False):
  """AFT-full (paper Eq. 2).

  Y[t] = sigma(q[t]) * sum_t' exp(k[t'] + w[t, t']) v[t'] / sum_t' exp(k[t'] + w[t, t'])

  Args:
    q, k, v: ``[..., T, D]``.
    w: ``[T, T]`` pairwise position bias.
    causal: sum over ``t' <= t`` only.

  Returns:
    ``[..., T, D]`` in the dtype of the inputs. O(T^2 D) time, O(T^2 + T D) memory.
  """
  _check_qkv("aft_full", q, k, v)
  t_len = q.shape[-2]
  _check_w("aft_full", w, t_len)
  out_dt, dt = _compute_dtype(q, k, v)
  q, k, v, w = _cast(dt, q, k, v, w)
  acc = _band(k, v, w, -(t_len - 1), 0 if causal else t_len - 1)
  return _finish(q, acc, out_dt)


def aft_simple(q, k, v, *, causal: bool = False):
  """AFT-simple (paper Eq. 5): w = 0.

  Y[t] = sigma(q[t]) * sum_t' softmax_t'(k)[t'] v[t']   (t' <= t when causal)

  Args:
    q, k, v: ``[..., T, D]``.

  Returns:
    ``[..., T, D]``. O(T D) time and memory; the causal form is a prefix scan.
  """
  _check_qkv("aft_simple", q, k, v)
  out_dt, dt = _compute_dtype(q, k, v)
  q, k, v = _cast(dt, q, k, v)
  if causal:
    acc = _acc_scan(_leaf(k, v), axis=q.ndim - 2)
    return _finish(q, acc, out_dt)
  weights = jax.nn.softmax(k, axis=-2)
  return (jax.nn.sigmoid(q) * jnp.sum(weights * v, axis=-2, keepdims=True)).astype(out_dt)


def aft_local(q, k, v, w, *, window: int, causal: bool = False):
  """AFT-local (paper Eq. 4): w[t, t'] is used where |t - t'| < window and is 0 elsewhere.

  Positions outside the window still contribute, with bias 0 (not -inf).

  Args:
    q, k, v: ``[..., T, D]``.
    w: ``[T, T]``; entries outside the window are ignored.
    window: s >= 1.
    causal: sum over ``t' <= t`` only.

  Returns:
    ``[..., T, D]``. O(T s D) time; no T x T array is built when s << T.
  """
  _check_qkv("aft_local", q, k, v)
  _check_window("aft_local", window)
  t_len = q.shape[-2]
  _check_w("aft_local", w, t_len)
  out_dt, dt = _compute_dtype(q, k, v)
  q, k, v, w = _cast(dt, q, k, v, w)
  s = min(window, t_len)
  acc = _band(k, v, w, -(s - 1), 0 if causal else s - 1)
  rest = _outside(_leaf(k, v), q.ndim - 2, s if s < t_len else None,
                  None if causal or s >= t_len else s)
  return _finish(q, acc if rest is None else _combine(acc, rest), out_dt)


def _kernel_sum(leaf: _Acc, kernel, offsets, axes) -> _Acc:
  """Exact sum over the kernel's positions: logits k[t + o] + kernel[o] for each offset o.

  leaf.m: [..., *spatial, H]; leaf.num: [..., *spatial, H, C]; kernel: [H, n_offsets];
  offsets: a tuple of per-axis integer offsets for each kernel entry.
  """
  def shifted(acc, offset):
    for off, axis in zip(offset, axes):
      acc = _acc_shift(acc, off, axis)
    return acc

  shifts = [shifted(leaf, o) for o in offsets]
  logits = [jnp.where(s.den > 0, s.m + kernel[:, j], _NEG) for j, s in enumerate(shifts)]
  m = jnp.max(jnp.stack(logits), axis=0)
  num = jnp.zeros_like(leaf.num)
  den = jnp.zeros_like(leaf.den)
  for s, logit in zip(shifts, logits):
    p = s.den * jnp.exp(logit - m)  # s.den is 1 in range, 0 outside
    num = num + p[..., None] * s.num
    den = den + p
  return _Acc(m, num, den)


def _check_conv(fn, q, k, v, kernel, n_spatial):
  nd = n_spatial + 2
  if q.ndim < nd or v.shape != q.shape or k.shape != q.shape[:-1]:
    sp = "Ht, Wd" if n_spatial == 2 else "T"
    raise ValueError(
        f"{fn}: expected q, v [..., {sp}, H, C] and k [..., {sp}, H]; got q {q.shape}, "
        f"k {k.shape}, v {v.shape}")
  if kernel.ndim != n_spatial + 1 or kernel.shape[0] != q.shape[-2]:
    raise ValueError(
        f"{fn}: kernel must be [H, {'kh, kw' if n_spatial == 2 else 's'}] with H = "
        f"{q.shape[-2]} heads; got kernel {kernel.shape}")


def aft_conv1d(q, k, v, kernel, *, causal: bool = False):
  """AFT-conv over a sequence (paper Eq. 6, 1-D): per head i, a kernel w^i of size s.

  Y[t, i] = sigma(q[t, i]) * sum_t' exp(k[t', i] + w^i[t, t']) v[t', i]
                           / sum_t' exp(k[t', i] + w^i[t, t'])

  where w^i[t, t'] = kernel[i, j] for t' = t + j - s // 2 (non-causal; s odd) or t' = t - j
  (causal), and 0 for every other t' (those positions still contribute).

  Args:
    q, v: ``[..., T, H, C]``; k: ``[..., T, H]`` (one key per head).
    kernel: ``[H, s]``.

  Returns:
    ``[..., T, H, C]``. O(T s H C): a depth-wise windowed sum plus O(T) prefix scans.
  """
  _check_conv("aft_conv1d", q, k, v, kernel, 1)
  s = kernel.shape[-1]
  if s < 1 or (not causal and s % 2 == 0):
    raise ValueError(
        f"aft_conv1d: a non-causal kernel size must be odd (centred); got kernel {kernel.shape}")
  out_dt, dt = _compute_dtype(q, k, v)
  q, k, v, kernel = _cast(dt, q, k, v, kernel)
  axis = k.ndim - 2  # the T axis of k [..., T, H] (and of v [..., T, H, C])
  leaf = _leaf(k, v)
  if causal:
    offsets = [(-j,) for j in range(s)]
    rest = _outside(leaf, axis, s, None)
  else:
    offsets = [(j - s // 2,) for j in range(s)]
    rest = _outside(leaf, axis, s // 2 + 1, s // 2 + 1)
  acc = _combine(_kernel_sum(leaf, kernel, offsets, (axis,)), rest)
  return _finish(q, acc, out_dt)


def aft_conv2d(q, k, v, kernel):
  """AFT-conv over an image (paper Eq. 6): per head i, a kh x kw kernel w^i ("SAME").

  Y[r, c, i] = sigma(q[r, c, i]) * sum_{r', c'} exp(k[r', c', i] + w^i) v[r', c', i]
                                 / sum_{r', c'} exp(k[r', c', i] + w^i)

  with w^i = kernel[i, a, b] at (r', c') = (r + a - kh // 2, c + b - kw // 2) and 0 at every
  other position of the image (which still contributes).

  Args:
    q, v: ``[..., Ht, Wd, H, C]``; k: ``[..., Ht, Wd, H]``.
    kernel: ``[H, kh, kw]``, odd sizes.

  Returns:
    ``[..., Ht, Wd, H, C]``. O(Ht Wd kh kw C) per head.
  """
  _check_conv("aft_conv2d", q, k, v, kernel, 2)
  kh, kw = kernel.shape[1:]
  if kh % 2 == 0 or kw % 2 == 0:
    raise ValueError(f"aft_conv2d: kernel sizes must be odd; got kernel {kernel.shape}")
  out_dt, dt = _compute_dtype(q, k, v)
  q, k, v, kernel = _cast(dt, q, k, v, kernel)
  row, col = k.ndim - 3, k.ndim - 2
  leaf = _leaf(k, v)
  offsets = [(a - kh // 2, b - kw // 2) for a in range(kh) for b in range(kw)]
  inside = _kernel_sum(leaf, kernel.reshape(kernel.shape[0], -1), offsets, (row, col))
  # Outside the kernel (w = 0): whole rows above and below the kernel's rows, plus, within
  # its rows, the columns left and right of it. All exact, no subtraction.
  rows = _acc_reduce(leaf, col)
  parts = [_outside(rows, row, kh // 2 + 1, kh // 2 + 1)]
  sides = _outside(leaf, col, kw // 2 + 1, kw // 2 + 1)
  for a in range(-(kh // 2), kh // 2 + 1):
    parts.append(_acc_shift(sides, a, row))
  acc = inside
  for part in parts:
    acc = _combine(acc, part)
  return _finish(q, acc, out_dt)
