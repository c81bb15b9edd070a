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

Cost. Positions where ``w == 0`` (everything outside AFT-local's window or AFT-conv's kernel,
and all of AFT-simple) are summed with prefix/suffix scans in O(T D): a two-level sequential
scan (chunks of ~sqrt(T) positions), which is short to run and quick to compile. Positions with
a bias (AFT-full, AFT-local's window) are summed as matrix products of exp(w - row max) with
exp(k - channel max) v, in query blocks against the keys they can see, so AFT-local costs
O(T s D) and never builds a T x T array when s << T. That split shift is exact unless the
largest term of a sum underflows (|k + w| of order 100); such row groups are detected (their
denominator is tiny) and recomputed with a per-(t, channel) maximum.
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


class _Acc(NamedTuple):
  """A partial softmax-weighted sum: m, den ``[..., D]``; num ``[..., D]`` or ``[..., D, C]``.

  ``m`` never carries a gradient: every result is a ratio num / den in which m cancels, so
  holding m fixed (``stop_gradient``) gives the exact derivative and keeps max() out of the
  backward pass.
  """

  m: jax.Array
  num: jax.Array
  den: jax.Array


_sg = jax.lax.stop_gradient


def _bcast(scale, num):
  return scale[..., None] if num.ndim > scale.ndim else scale


def _combine(a: _Acc, b: _Acc) -> _Acc:
  """(m, num, den) of the union of two disjoint sets of terms (stable log-sum-exp)."""
  m = jnp.maximum(a.m, b.m)
  # One exp: the larger side is scaled by 1, the smaller by exp(-|a.m - b.m|).
  x = jnp.exp(-jnp.abs(a.m - b.m))
  a_big = a.m >= b.m
  sa, sb = jnp.where(a_big, 1.0, x), jnp.where(a_big, x, 1.0)
  return _Acc(m, a.num * _bcast(sa, a.num) + b.num * _bcast(sb, b.num), a.den * sa + b.den * sb)


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
  return _Acc(_shift(acc.m, offset, axis, _NEG), _shift(acc.num, offset, axis, 0.0),
              _shift(acc.den, offset, axis, 0.0))


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


def _ema(r, u, decay, x):
  """s_t = s_{t-1} + r_t (x_t - s_{t-1}) from s_{-1} = 0, in chunk layout; linear in x.

  r, x: [c, n, R] (``_to_chunks`` layout). The chunk totals are sum(u x) over each chunk
  (u [c, n, R]: the weight of each term at the chunk's end), a scan over the chunks with
  decay [n, R] (the product of (1 - r) over a chunk) gives what precedes each chunk, and one
  pass over the chunks started from that gives every position. Every factor is in [0, 1]
  (stable at any logit size); the transpose is the same scan run backwards.
  """
  n = r.shape[1]

  def inner(s, rx):
    rr, xx = rx
    s = s + rr * (xx - s)
    return s, s

  init = jnp.zeros(x.shape[1:], x.dtype)
  if n > 1:
    def outer(carry, dt):
      d, t = dt
      return d * carry + t, carry

    _, init = jax.lax.scan(outer, init[0], (decay, jnp.sum(u * x, axis=0)))
  return jax.lax.scan(inner, init, (r, x))[1]


def _mean_pass(kc, vc, residuals: bool):
  """Causal softmax-weighted means of vc with logits kc, both [c, n, R] (chunk layout).

  Returns a [c, n, R]: a[t] = sum_{t' <= t} exp(k[t'] - L[t]) v[t'] with L = logcumsumexp(k);
  with ``residuals`` also r = exp(k - L) [c, n, R] (the weight of the newest term, in (0, 1])
  and (m, den) [n, R] of the sums up to each chunk's end. A pass over the chunks that keeps
  only the carried (m, num, den), a scan over the chunk totals, and a second pass started
  from what precedes each chunk that writes only a (and r): no [T, D] arrays of m, num, den.
  """
  c, n, _ = kc.shape

  def add(carry, kv):  # fold one term (logit kk, value vv) into (m, num, den): one exp
    m, num, den = carry
    kk, vv = kv
    x = jnp.exp(-jnp.abs(m - kk))
    new = kk > m
    s_old, s_new = jnp.where(new, x, 1.0), jnp.where(new, 1.0, x)
    return (jnp.maximum(m, kk), num * s_old + vv * s_new, den * s_old + s_new), s_new

  zero = jnp.zeros(kc.shape[1:], kc.dtype)
  init = (zero + _NEG, zero, zero)
  if n > 1:
    totals, _ = jax.lax.scan(lambda cr, kv: (add(cr, kv)[0], None), init, (kc, vc))

    def outer(carry, tot):
      after = _combine(_Acc(*carry), _Acc(*tot))
      return tuple(after), (carry, tuple(after))

    _, (before, after) = jax.lax.scan(outer, tuple(x[0] for x in init), totals)
    init = before
    ends = (after[0], after[2])
  else:
    ends = None

  def step(carry, kv):
    carry, s_new = add(carry, kv)
    a = carry[1] / carry[2]
    if not residuals:
      return carry, a
    return carry, (a, s_new / carry[2])

  out = jax.lax.scan(step, init, (kc, vc))[1]
  return (*out, ends) if residuals else out


def _chunks(t_len: int):
  """(c, n): chunk length and number of chunks for ``_to_chunks``."""
  c = _chunk(t_len)
  return c, -(-t_len // c)


@jax.custom_jvp
def _causal_mean(k, v):
  """a[t] = sum_{t' <= t} exp(k[t'] - L[t]) v[t'] with L = logcumsumexp(k); k, v, a [T, R].

  A custom JVP (not VJP: forward mode works too), for memory: with r = exp(k - L) in (0, 1],
  a[t] = a[t-1] + r[t] (v[t] - a[t-1]), and dL = Q = that recurrence on dk, so da = the
  recurrence on dv + (dk - Q) (v[t] - a[t-1]) (exact: no max() to differentiate). Both are
  linear scans (``_ema``) whose only [T, D] coefficient is r, and the tangent is
  rematerialized, so reverse mode (linearize + transpose) keeps just a and r as [T, D]
  residuals: half the scratch of differentiating ``_prefix0``, and faster.
  """
  c, n = _chunks(k.shape[0])
  a = _mean_pass(_to_chunks(k, c, n, 0.0), _to_chunks(v, c, n, 0.0), False)
  return _from_chunks(a, k.shape[0])


def _mean_tangent(k, v, a, r, ends, dk, dv):
  """da of ``_causal_mean`` (linear in dk, dv; recomputes everything but a and r)."""
  c, n = r.shape[:2]
  u = decay = None
  if n > 1:
    m_end, den_end = ends  # (m, den) of the sums up to each chunk's end, [n, R]
    # Weight of each term at its chunk's end (for the chunk totals; <= 1, the padding of the
    # last chunk included), and the product of (1 - r) over chunk j: Z(end of j - 1) /
    # Z(end of j) with Z = exp(m) den (0 for chunk 0).
    u = jnp.exp(_to_chunks(k, c, n, 0.0) - m_end) / den_end
    decay = jnp.exp(m_end[:-1] - m_end[1:]) * den_end[:-1] / den_end[1:]
    decay = jnp.concatenate([jnp.zeros_like(decay[:1]), decay])
  w = v - jnp.pad(a[:-1], [(1, 0)] + [(0, 0)] * (a.ndim - 1))  # v[t] - a[t - 1]
  dk, dv, w = (_to_chunks(x, c, n, 0.0) for x in (dk, dv, w))
  q = _ema(r, u, decay, dk)
  return _from_chunks(_ema(r, u, decay, dv + (dk - q) * w), v.shape[0])


@_causal_mean.defjvp
def _causal_mean_jvp(primals, tangents):
  k, v = primals
  c, n = _chunks(k.shape[0])
  a, r, ends = _mean_pass(_to_chunks(k, c, n, 0.0), _to_chunks(v, c, n, 0.0), True)
  a = _from_chunks(a, k.shape[0])
  return a, jax.checkpoint(_mean_tangent)(k, v, a, r, ends, *tangents)


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


def _to_rows(x):
  """[..., T, D] -> [T, R] with R = prod(...) * D (free when there is no batch dim)."""
  t_len, d = x.shape[-2:]
  x = x.reshape((-1, t_len, d))
  return jnp.swapaxes(x, 0, 1).reshape(t_len, -1)


def _from_rows(x, shape):
  t_len, d = shape[-2:]
  x = jnp.swapaxes(x.reshape(t_len, -1, d), 0, 1)
  return x.reshape(shape)


# Below this value of the fast path's denominator (whose terms are products of two factors
# <= 1), terms may have underflowed and the block is recomputed exactly. Terms smaller than
# 1e-38 then weigh < 1e-10 relative to den, far below float32 resolution.
_DEN_OK = 1e-25
# Elements of the [rows, keys, R] logits tensor of one exact (fallback) step.
_BLOCK_ELEMENTS = 1 << 22


def _band_rect(w, lo: int, hi: int, c: int, nb: int):
  """w[t, t'] for the keys t' in [t + lo, t + hi] of each query block, as [nb, c, W].

  Row i of block b is query t = b c + i; column j is key t' = b c + lo + j (W = c + hi - lo);
  entries outside the band or outside [0, T) are _NEG. No gather: the band is read from the
  flattened w with row stride T + 1 (w[t, t + lo + j] = flat[t (T + 1) + lo + j]) and skewed
  into rectangles with the same trick (row stride W - 1).
  """
  t_len = w.shape[0]
  width = hi - lo + 1  # lo <= 0 <= hi, width + 2 <= T
  flat = w.reshape(-1)
  first = jnp.pad(w[0, :lo + width], (-lo, 0))
  start = (t_len + 1) + lo
  mid = flat[start:start + (t_len - 2) * (t_len + 1)].reshape(t_len - 2, t_len + 1)[:, :width]
  last = jnp.pad(w[t_len - 1, t_len - 1 + lo:], (0, width - (1 - lo)))
  band = jnp.concatenate([first[None], mid, last[None]], axis=0)  # band[t, j] = w[t, t + lo + j]
  key = jnp.arange(t_len)[:, None] + lo + jnp.arange(width)[None, :]
  band = jnp.where((key >= 0) & (key < t_len), band, _NEG)
  band = jnp.pad(band, ((0, nb * c - t_len), (0, 0)), constant_values=_NEG)
  # Skew: rect[b, i, j] = band[b c + i, j - i] (and _NEG where j - i is outside [0, width)).
  x = jnp.pad(band.reshape(nb, c, width), ((0, 0), (0, 0), (0, c)), constant_values=_NEG)
  x = x.reshape(nb, c * (width + c))[:, :c * (width + c - 1)]
  return x.reshape(nb, c, width + c - 1)


def _exact_rows(wr, kw, vw) -> _Acc:
  """Exact sums for query rows: wr [r, W] (_NEG = absent), kw, vw [W, R] -> [r, R] each."""
  logits = kw[None, :, :] + wr[:, :, None]
  m = _sg(jnp.max(logits, axis=1))
  p = jnp.exp(logits - m[:, None, :])
  return _Acc(m, jnp.einsum("rwx,wx->rx", p, vw, precision=_HI), jnp.sum(p, axis=1))


_HI = jax.lax.Precision.HIGHEST


def _exact_fallback(rect, kwin, vwin, bad, rows):
  """Exact (m, num, den) [nb, c, R] of the row groups flagged in ``bad`` [nb, groups]; zeros
  elsewhere. rect [nb, c, W]; kwin, vwin [nb, W, R] (the keys each query block can see)."""
  nb, c, win = rect.shape
  r = kwin.shape[-1]
  groups = bad.shape[1]

  def run(_):
    rect_g = jnp.pad(rect, ((0, 0), (0, groups * rows - c), (0, 0)), constant_values=_NEG)
    rect_g = rect_g.reshape(nb * groups, rows, win)
    if nb == 1:  # every group sees the same keys: share them instead of copying per group
      def one(args):
        flag, wr = args
        return jax.lax.cond(flag, lambda: tuple(_exact_rows(wr, kwin[0], vwin[0])),
                            lambda: (jnp.zeros((rows, r), kwin.dtype),) * 3)

      xs = (bad.reshape(-1), rect_g)
    else:  # one step per query block: its row groups share the block's keys (no copies)
      def one(args):
        flags, wrs, kw, vw = args
        outs = [jax.lax.cond(flags[g], lambda g=g: tuple(_exact_rows(wrs[g], kw, vw)),
                             lambda: (jnp.zeros((rows, r), kw.dtype),) * 3)
                for g in range(groups)]
        return tuple(jnp.concatenate(x, axis=0) for x in zip(*outs))

      xs = (bad, rect_g.reshape(nb, groups, rows, win), kwin, vwin)
    out = jax.lax.map(jax.checkpoint(one), xs)
    return tuple(x.reshape(nb, groups * rows, r)[:, :c] for x in out)

  return jax.lax.cond(jnp.any(bad), run, lambda _: (jnp.zeros((nb, c, r), kwin.dtype),) * 3,
                      None)


def _band(k, v, w, lo: int, hi: int) -> _Acc:
  """Exact sum over t' in [t + lo, t + hi] (clipped to [0, T)) with logits k[t'] + w[t, t'].

  k, v: [T, R] float32 (rows layout); w: [T, T]; lo <= 0 <= hi. Returns [T, R] arrays.

  Fast path: exp(k + w) = exp(w - mw[t]) exp(k - mk[r]) with a per-row shift of w and a
  per-channel shift of k (per key block), so the sums are matrix products of [c, W] blocks
  of exp(w) with [W, R] blocks of exp(k) v and exp(k). Every term is a product of factors
  <= 1, so the result is exact unless the largest term underflowed, which shows as
  den < _DEN_OK: those row groups (only they) are recomputed with an exact per-(t, channel)
  maximum. With logits of ordinary size that never happens; with huge ones (|k + w| ~ 100)
  it keeps the result exact. No [T, T] array is built when the band is narrow.
  """
  t_len, r = k.shape
  width = hi - lo + 1
  if width + 63 >= t_len:  # one block sees every key: rows of w against all keys
    c, nb, jlo, jhi = t_len, 1, 0, 0
    key = jnp.arange(t_len)[None, :] - jnp.arange(t_len)[:, None]
    rect = jnp.where((key >= lo) & (key <= hi), w, _NEG)[None]
  else:
    c = max(64, 1 << math.ceil(math.log2(max(1, width - 1) / 2)))
    nb = -(-t_len // c)
    jlo, jhi = -(-(-lo) // c), -(-hi // c)  # key blocks b + jlo ... b + jhi are in view
    jlo = -jlo
    rect = _band_rect(w, lo, hi, c, nb)  # columns: keys b c + lo + j
    rect = jnp.pad(rect, ((0, 0), (0, 0), (lo - jlo * c, (jhi + 1) * c - (c + hi))),
                   constant_values=_NEG)  # columns: keys (b + jlo) c + j
  parts = jhi - jlo + 1
  nbk = nb + parts - 1
  pad = ((-jlo * c, nbk * c + jlo * c - t_len), (0, 0))
  kb = jnp.pad(k, pad, constant_values=_NEG).reshape(nbk, c, r)
  vb = jnp.pad(v, pad).reshape(nbk, c, r)

  mw = _sg(jnp.max(rect, axis=2))  # [nb, c]
  mkb = _sg(jnp.max(kb, axis=1))  # [nbk, R]
  mk = mkb[0:nb]
  for j in range(1, parts):
    mk = jnp.maximum(mk, mkb[j:j + nb])
  p = jnp.exp(rect - mw[:, :, None])  # 0 outside the band
  e = jnp.exp(kb - mkb[:, None, :])  # 0 at padding keys
  ev = e * vb
  num = den = 0.0
  for j in range(parts):
    pj = p[:, :, j * c:(j + 1) * c]
    scale = jnp.exp(mkb[j:j + nb] - mk)[:, None, :]
    num = num + scale * jnp.einsum("bcw,bwx->bcx", pj, ev[j:j + nb], precision=_HI)
    den = den + scale * jnp.einsum("bcw,bwx->bcx", pj, e[j:j + nb], precision=_HI)
  fast = _Acc(mw[:, :, None] + mk[:, None, :], num, den)

  # Exact recomputation of row groups whose fast denominator may have lost its largest terms.
  win = parts * c
  rows = max(1, min(c, (_BLOCK_ELEMENTS * (4 if nb == 1 else 1)) // max(1, win * r)))
  groups = -(-c // rows)
  real = (jnp.arange(nb * c) < t_len).reshape(nb, c, 1)
  bad = ~(fast.den >= _DEN_OK) & real  # also catches NaN
  bad = jnp.pad(bad, ((0, 0), (0, groups * rows - c), (0, 0))).reshape(nb, groups, -1).any(-1)

  def fallback(rect, kb, vb, bad):
    windows = lambda x: jnp.concatenate([x[j:j + nb] for j in range(parts)], axis=1)
    return _exact_fallback(rect, windows(kb), windows(vb), bad, rows)
  exact = jax.checkpoint(fallback)(rect, kb, vb, bad)
  use = jnp.repeat(bad, rows, axis=1)[:, :c, None]
  acc = _Acc(*(jnp.where(use, x, y) for x, y in zip(exact, fast)))
  return _Acc(*(x.reshape(nb * c, r)[:t_len] for x in acc))


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
  acc = _band(_to_rows(k), _to_rows(v), w, -(t_len - 1), 0 if causal else t_len - 1)
  return _finish(q, _Acc(*(_from_rows(x, q.shape) for x in acc)), out_dt)


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
    a = _from_rows(_causal_mean(_to_rows(k), _to_rows(v)), q.shape)
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
  s = min(window, t_len)
  k2, v2 = _to_rows(k), _to_rows(v)
  acc = _band(k2, v2, w, -(s - 1), 0 if causal else s - 1)
  rest = _outside(_leaf(k2, v2), 0, s if s < t_len else None,
                  None if causal or s >= t_len else s)
  acc = acc if rest is None else _combine(acc, rest)
  return _finish(q, _Acc(*(_from_rows(x, q.shape) for x in acc)), out_dt)


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
