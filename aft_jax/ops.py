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
log-sum-exp, and prefix sums carry the running maximum. Results are finite and accurate in
float32 for logits of any size. bfloat16 inputs are computed in float32 and returned in
bfloat16. The maxima ``m`` never carry a gradient (they cancel in num / den), so the backward
pass is linear scans and matrix products, with no max() to differentiate.

Where the work happens. AFT-local and AFT-full: ``banded.py`` (query blocks against the keys
they can see, as matrix products of exp(w - row max) and exp(k - channel max) v, plus running
sums of the bias-0 keys outside the window; O(T s D), no T x T array when s << T). Causal
AFT-simple: ``causal_mean.py`` (one pass over chunks with a triangular matrix product per
chunk; about the speed of a ``cumsum``). Both have a hand-written JVP whose only [T, D]
residuals are the output mean and its log-normalizer, so the backward pass stores little.
AFT-conv and non-causal AFT-simple: the triples below (prefix scans and shifted sums), with
plain autodiff.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from aft_jax import banded, causal_mean
from aft_jax.logsumexp import NEG as _NEG, Acc as _Acc, bcast as _bcast, combine as _combine

__all__ = ["aft_full", "aft_simple", "aft_local", "aft_conv1d", "aft_conv2d"]

_sg = jax.lax.stop_gradient


def _leaf(k, v) -> _Acc:
  """One term per position: logit k, value v. den = exp(k - m) at m = k: value 1, d/dk = 1."""
  m = _sg(k)
  e = 1.0 + (k - m)
  return _Acc(m, v * _bcast(e, v), e)


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
  return _Acc(
    _shift(acc.m, offset, axis, _NEG),
    _shift(acc.num, offset, axis, 0.0),
    _shift(acc.den, offset, axis, 0.0),
  )


def _chunk(t_len: int) -> int:
  """Chunk length for the two-level scan: about sqrt(T), so both loops are short."""
  return max(1, 1 << round(math.log2(max(1.0, math.sqrt(t_len)))))


def _to_chunks(x, c: int, n: int, fill):
  """[T, ...] -> [c, n, ...]: position j c + i at [i, j]; ``fill`` pads T up to n c."""
  x = jnp.pad(x, [(0, n * c - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
  return jnp.swapaxes(x.reshape((n, c) + x.shape[1:]), 0, 1)


def _from_chunks(x, t_len: int):
  """Inverse of ``_to_chunks``."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])[:t_len]


def _prefix0(acc: _Acc) -> _Acc:
  """Inclusive prefix sums along axis 0, exactly (a carried maximum per position).

  Two short sequential loops instead of one of length T: the sequence is cut into n chunks of
  length c ~ sqrt(T); a scan over the c positions of every chunk at once gives the
  within-chunk prefixes, a scan over the n chunk totals gives what precedes each chunk, and
  one elementwise combine finishes. Cost O(T D), c + n loop steps, no log-depth graph (so it
  also compiles fast), and m carries no gradient so the backward pass is two linear scans.
  """
  t_len = acc.m.shape[0]
  c = _chunk(t_len)
  n = -(-t_len // c)
  fills = (_NEG, 0.0, 0.0)

  xs = _Acc(*(_to_chunks(x, c, n, f) for x, f in zip(acc, fills)))
  empty = _Acc(*(jnp.full(x.shape[1:], f, x.dtype) for x, f in zip(xs, fills)))

  def step(carry, x):
    new = _combine(carry, _Acc(*x))
    return new, new

  totals, local = jax.lax.scan(step, empty, tuple(xs))  # local: [c, n, ...]
  if n == 1:
    out = _Acc(*local)
  else:

    def outer(carry, x):
      return _combine(carry, _Acc(*x)), carry

    first = _Acc(*(x[0] for x in empty))
    _, before = jax.lax.scan(outer, first, tuple(totals))  # exclusive, [n, ...]
    out = _combine(_Acc(*(x[None] for x in before)), _Acc(*local))

  return _Acc(*(_from_chunks(x, t_len) for x in out))


def _acc_scan(acc: _Acc, axis: int, reverse: bool = False) -> _Acc:
  """Inclusive prefix (or suffix) sums along ``axis`` with a carried maximum."""

  def fwd(x):
    x = jnp.moveaxis(x, axis, 0)
    return jnp.flip(x, 0) if reverse else x

  def back(x):
    x = jnp.flip(x, 0) if reverse else x
    return jnp.moveaxis(x, 0, axis)

  out = _prefix0(_Acc(*(fwd(x) for x in acc)))
  return _Acc(*(back(x) for x in out))


def _acc_reduce(acc: _Acc, axis: int) -> _Acc:
  """The whole sum along ``axis`` (the axis is kept, with size 1)."""
  m = jnp.max(acc.m, axis=axis, keepdims=True)
  s = jnp.exp(acc.m - m)  # positive axes index num and m alike
  return _Acc(
    m,
    jnp.sum(acc.num * _bcast(s, acc.num), axis=axis, keepdims=True),
    jnp.sum(acc.den * s, axis=axis, keepdims=True),
  )


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


def _to_rows(x):
  """[..., T, D] -> [T, R] with R = prod(...) * D (free when there is no batch dim)."""
  t_len, d = x.shape[-2:]
  x = x.reshape((-1, t_len, d))
  return jnp.swapaxes(x, 0, 1).reshape(t_len, -1)


def _from_rows(x, shape):
  t_len, d = shape[-2:]
  x = jnp.swapaxes(x.reshape(t_len, -1, d), 0, 1)
  return x.reshape(shape)


def _windowed(q, k, v, w, window: int, causal: bool, dtype):
  """sigma(q) * the banded mean (``banded.banded_mean``) of [..., T, D] inputs."""
  k2, v2 = _to_rows(k), _to_rows(v)
  plan = banded.make_plan(k2.shape[0], k2.shape[1], window, causal)
  a = _from_rows(banded.banded_mean(plan, k2, v2, w), q.shape)
  return (jax.nn.sigmoid(q) * a).astype(dtype)


# --------------------------------------------------------------------------- validation


def _check_qkv(fn, q, k, v):
  if q.ndim < 2:
    raise ValueError(f"{fn}: q must be [..., T, D], got shape {q.shape}")
  if k.shape != q.shape or v.shape != q.shape:
    raise ValueError(
      f"{fn}: q, k and v must have the same shape [..., T, D]; got q {q.shape}, "
      f"k {k.shape}, v {v.shape}"
    )


def _check_w(fn, w, t_len):
  if w.shape != (t_len, t_len):
    raise ValueError(
      f"{fn}: w must be [T, T] = {(t_len, t_len)} for T = {t_len}; got w {w.shape} "
      "(slice the top-left block of a larger bias first)"
    )


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
  return _windowed(q, k, v, w, t_len, causal, out_dt)


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
    a = _from_rows(causal_mean.causal_mean(_to_rows(k), _to_rows(v)), q.shape)
    return (jax.nn.sigmoid(q) * a).astype(out_dt)
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
  return _windowed(q, k, v, w, window, causal, out_dt)


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
  m = _sg(jnp.max(jnp.stack(logits), axis=0))
  num = jnp.zeros_like(leaf.num)
  den = jnp.zeros_like(leaf.den)
  for s, logit in zip(shifts, logits):
    p = jnp.exp(logit - m)  # s.num, s.den carry the leaf's k-gradient factor; 0 outside
    num = num + p[..., None] * s.num
    den = den + p * s.den
  return _Acc(m, num, den)


def _check_conv(fn, q, k, v, kernel, n_spatial):
  nd = n_spatial + 2
  if q.ndim < nd or v.shape != q.shape or k.shape != q.shape[:-1]:
    sp = "Ht, Wd" if n_spatial == 2 else "T"
    raise ValueError(
      f"{fn}: expected q, v [..., {sp}, H, C] and k [..., {sp}, H]; got q {q.shape}, "
      f"k {k.shape}, v {v.shape}"
    )
  if kernel.ndim != n_spatial + 1 or kernel.shape[0] != q.shape[-2]:
    raise ValueError(
      f"{fn}: kernel must be [H, {'kh, kw' if n_spatial == 2 else 's'}] with H = "
      f"{q.shape[-2]} heads; got kernel {kernel.shape}"
    )


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
      f"aft_conv1d: a non-causal kernel size must be odd (centred); got kernel {kernel.shape}"
    )
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
