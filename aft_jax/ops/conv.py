"""AFT-conv (paper Eq. 6) as exact log-sum-exp sums: a kernel's worth of shifted terms plus
prefix and suffix scans of the bias-0 terms outside the kernel.

The kernel w is 0 outside its few offsets, so for every position the sum splits into (a) the
kernel's own offsets, one shifted copy of the keys per kernel entry with its bias added, and
(b) everything else, which has bias 0: running (prefix/suffix) sums of the keys, shifted past
the kernel. Both parts are carried as (m, num, den) triples (``logsumexp``) and combined, so
the result is exact for logits of any size; the maxima carry no gradient, so plain autodiff
gives a backward pass of linear scans.

Layout: k ``[..., *spatial, H]`` (one key per head), v ``[..., *spatial, H, C]``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax.ops import branch
from aft_jax.ops.logsumexp import (
  HIGHEST, NEG, Acc, bcast, combine, finite, gate, output, tame,
)  # fmt: skip

_sg = jax.lax.stop_gradient


def _leaf(k, v) -> Acc:
  """One term per position: logit k, value v. den = exp(k - m) at m = k (held fixed): value 1,
  and every derivative in k 1 (the exponential's own: Hessians are exact too)."""
  # A key of -inf is no term (m = NEG, den 0): its own shift -inf would give -inf - -inf = NaN.
  none = k == -jnp.inf
  m = jnp.where(none, NEG, _sg(k))
  e = jnp.where(none, 0.0, jnp.exp(jnp.where(none, 0.0, k - m)))
  return Acc(m, jnp.where(bcast(none, v), 0.0, v) * bcast(e, v), e)


def _shift(x, offset: int, axis: int, fill):
  """y[..., i, ...] = x[..., i + offset, ...] along ``axis``; ``fill`` where out of range."""
  n = x.shape[axis]
  if abs(offset) >= n:
    return jnp.full_like(x, fill)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (max(-offset, 0), max(offset, 0))
  x = jnp.pad(x, pad, constant_values=fill)
  return jax.lax.slice_in_dim(x, max(offset, 0), max(offset, 0) + n, axis=axis)


def _acc_shift(acc: Acc, offset: int, axis: int) -> Acc:
  return Acc(
    _shift(acc.m, offset, axis, NEG),
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


def _prefix0(acc: Acc) -> Acc:
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
  fills = (NEG, 0.0, 0.0)

  xs = Acc(*(_to_chunks(x, c, n, f) for x, f in zip(acc, fills)))
  # Of the inputs' type: inside shard_map, varying where they do, as a scan's carry must be.
  empty = Acc(*(jnp.full_like(x[0], f) for x, f in zip(xs, fills)))

  def step(carry, x):
    new = combine(carry, Acc(*x))
    return new, new

  totals, local = jax.lax.scan(step, empty, tuple(xs))  # local: [c, n, ...]
  if n == 1:
    out = Acc(*local)
  else:

    def outer(carry, x):
      return combine(carry, Acc(*x)), carry

    first = Acc(*(x[0] for x in empty))
    _, before = jax.lax.scan(outer, first, tuple(totals))  # exclusive, [n, ...]
    out = combine(Acc(*(x[None] for x in before)), Acc(*local))

  return Acc(*(_from_chunks(x, t_len) for x in out))


def _acc_scan(acc: Acc, axis: int, reverse: bool = False) -> Acc:
  """Inclusive prefix (or suffix) sums along ``axis`` with a carried maximum."""

  def fwd(x):
    x = jnp.moveaxis(x, axis, 0)
    return jnp.flip(x, 0) if reverse else x

  def back(x):
    x = jnp.flip(x, 0) if reverse else x
    return jnp.moveaxis(x, 0, axis)

  out = _prefix0(Acc(*(fwd(x) for x in acc)))
  return Acc(*(back(x) for x in out))


def _acc_reduce(acc: Acc, axis: int) -> Acc:
  """The whole sum along ``axis`` (the axis is kept, with size 1)."""
  m = jnp.max(acc.m, axis=axis, keepdims=True)
  s = jnp.exp(acc.m - m)  # positive axes index num and m alike
  return Acc(
    m,
    jnp.sum(acc.num * bcast(s, acc.num), axis=axis, keepdims=True),
    jnp.sum(acc.den * s, axis=axis, keepdims=True),
  )


def _outside(leaf: Acc, axis: int, before: int | None, after: int | None) -> Acc | None:
  """Sum of the terms at t' <= t - before and t' >= t + after (w = 0 there); None if none."""
  parts = []
  if before is not None:
    parts.append(_acc_shift(_acc_scan(leaf, axis), -before, axis))
  if after is not None:
    parts.append(_acc_shift(_acc_scan(leaf, axis, reverse=True), after, axis))
  if not parts:
    return None
  return parts[0] if len(parts) == 1 else combine(*parts)


def _kernel_sum(leaf: Acc, kernel, offsets, axes) -> Acc:
  """Exact sum over the kernel's positions: logits k[t + o] + kernel[o] for each offset o.

  leaf.m: [..., *spatial, H]; leaf.num: [..., *spatial, H, C]; kernel: [H, n_offsets];
  offsets: a tuple of per-axis integer offsets for each kernel entry.
  """

  def shifted(acc, offset):
    for off, axis in zip(offset, axes):
      acc = _acc_shift(acc, off, axis)
    return acc

  shifts = [shifted(leaf, o) for o in offsets]
  logits = [jnp.where(s.den > 0, s.m + kernel[:, j], NEG) for j, s in enumerate(shifts)]
  m = _sg(jnp.max(jnp.stack(logits), axis=0))
  num = jnp.zeros_like(leaf.num)
  den = jnp.zeros_like(leaf.den)
  for s, logit in zip(shifts, logits):
    p = jnp.exp(logit - m)  # s.num, s.den carry the leaf's k-gradient factor; 0 outside
    num = num + p[..., None] * s.num
    den = den + p * s.den
  return Acc(m, num, den)


def conv1d(q, k, v, kernel, causal: bool):
  """sigma(q) * the AFT-conv mean over T (float32/64 in and out).

  q, v: ``[..., T, H, C]``; k: ``[..., T, H]``; kernel: ``[H, s]`` (entry j: t' = t - j when
  causal, t' = t + j - s // 2 otherwise).
  """
  return _causal_conv1d(q, k, v, kernel) if causal else _conv1d(q, k, v, kernel, False)


@jax.custom_jvp
def _causal_conv1d(q, k, v, kernel):
  return _conv1d(q, k, v, kernel, True)


@_causal_conv1d.defjvp
def _causal_conv1d_jvp(primals, tangents):
  """The derivative at the inputs with every non-finite entry replaced by 0, where a row has
  not yet seen one (a NaN or +inf key, a non-finite value: causal, so there it is the
  derivative at the inputs themselves) and its output is finite; 0 elsewhere. Plain autodiff
  of the sums would multiply the later rows' zero cotangents by their NaN factors and reach
  every earlier input."""
  q, k, v, kernel = primals
  axis = k.ndim - 2  # T, in k [..., T, H] and v [..., T, H, C]
  bad_k = ~finite(k) & (k != -jnp.inf)  # a key of -inf is no term (``_leaf``)
  bad = bad_k[..., None] | ~finite(v)
  seen = jax.lax.cummax(bad.astype(jnp.int32), axis=axis) > 0
  clean = (tame(q), jnp.where(bad_k, 0.0, k), tame(v), tame(kernel))
  y_clean, dy = jax.jvp(lambda *a: _conv1d(*a, True, finite_values=True), clean, tangents)
  # Inputs that are all finite: y_clean is the output; else it is recomputed (rare).
  anything = jnp.any(seen) | ~jnp.all(finite(q)) | ~jnp.all(finite(kernel))
  y = branch.cond(anything, lambda: _conv1d(q, k, v, kernel, True), lambda: y_clean)
  return y, jnp.where(~seen & finite(y), dy, 0.0)


# Causal AFT-conv1d over at most this many positions is summed densely (``_dense_causal``):
# every (t, t') pair of a head at once, one masked [T, T] exponential and a matrix product, in
# place of the kernel's s shifted copies and the prefix scans. At nanoGPT's CPU recipe (T 64,
# kernel 32, 4 heads of 32, batch 12) one layer's forward and backward took 2.8 ms against 21.6
# ms on the 2-core CPU, and the train step 158 -> ~85 ms (benchmarks/RESULTS.md, "aft-jax
# beside nanoGPT"); its memory, B H T^2 floats a layer, is what bounds it.
DENSE_MAX_T = 256


def _conv1d(q, k, v, kernel, causal: bool, finite_values: bool = False):
  """``finite_values``: v is known finite (the JVP's tamed inputs): no patch for rows that see
  a non-finite value."""
  axis = k.ndim - 2  # the T axis of k [..., T, H] (and of v [..., T, H, C])
  if causal and k.shape[axis] <= DENSE_MAX_T:
    return _dense_causal(q, k, v, kernel, finite_values)
  return _scan_conv1d(q, k, v, kernel, causal)


def _dense_causal(q, k, v, kernel, finite_values: bool):
  """Causal AFT-conv1d as one masked [T, T] sum per head: logits k[t'] + w[t - t'] (the
  kernel's entry where 0 <= t - t' < s, else 0) over t' <= t, shifted by each row's maximum,
  as ``logsumexp.from_terms`` sums them, with the values' sum a matrix product.

  A product sums every t' of a row, the later ones (and keys of -inf) with weight 0, so
  non-finite values are zeroed first (0 * NaN would reach earlier rows) and the rows that see
  one (a term t' <= t with a non-finite value and a key that is not -inf) are recomputed by
  the exact scans (``_scan_conv1d``, behind ``branch.cond``): every other row is bit for bit
  what it is with finite values."""
  t_len, s = k.shape[-2], kernel.shape[-1]
  t = np.arange(t_len)
  d = t[:, None] - t[None, :]  # t - t'
  bias = jnp.where((d < s)[None], kernel[:, np.clip(d, 0, s - 1)], 0.0)  # [H, T, T']
  logits = k[..., None, :, :] + jnp.moveaxis(bias, 0, -1)  # [..., T, T', H]
  term = k != -jnp.inf  # a key of -inf is no term (``_leaf``)
  valid = (d >= 0)[:, :, None] & term[..., None, :, :]
  # Masked before the exponential too: a later key above a row's maximum (or any key, in a
  # row with no term, m = NEG) would overflow, and its zero cotangent times inf is NaN.
  logits = jnp.where(valid, logits, NEG)
  m = _sg(jnp.max(logits, axis=-2))  # [..., T, H]
  p = jnp.where(valid, jnp.exp(logits - m[..., None, :]), 0.0)
  nonfinite = None if finite_values else ~finite(v)
  values = v if finite_values else jnp.where(nonfinite, 0.0, v)  # (also where k = -inf)
  num = jnp.einsum("...tsh,...shc->...thc", p, values, precision=HIGHEST)
  # A row with no term (every key -inf: a state's empty rows) is 0 / 0 = NaN, as the scans
  # give it, but with its cotangent stopped: through the product a NaN cotangent would reach
  # every value of the sum (0 * NaN), where the scans' masks keep it out.
  den = jnp.sum(p, axis=-2)
  empty = (den == 0.0)[..., None]
  mean = jnp.where(empty, 0.0, num) / jnp.where(empty, 1.0, den[..., None])
  y = gate(q, jnp.where(empty, jnp.nan, mean))
  if finite_values:
    return y
  bad = nonfinite & term[..., None]
  seen = jax.lax.cummax(bad.astype(jnp.int32), axis=bad.ndim - 3) > 0  # [..., T, H, C]
  return branch.cond(
    jnp.any(seen),
    lambda: jnp.where(seen, _scan_conv1d(q, k, v, kernel, True), y),
    lambda: y,
  )


def _scan_conv1d(q, k, v, kernel, causal: bool):
  s = kernel.shape[-1]
  axis = k.ndim - 2
  leaf = _leaf(k, v)
  if causal:
    offsets = [(-j,) for j in range(s)]
    rest = _outside(leaf, axis, s, None)
  else:
    offsets = [(j - s // 2,) for j in range(s)]
    rest = _outside(leaf, axis, s // 2 + 1, s // 2 + 1)
  return output(q, combine(_kernel_sum(leaf, kernel, offsets, (axis,)), rest))


def conv2d(q, k, v, kernel):
  """sigma(q) * the AFT-conv mean over an image ("SAME", float32/64 in and out).

  q, v: ``[..., Ht, Wd, H, C]``; k: ``[..., Ht, Wd, H]``; kernel: ``[H, kh, kw]``, odd sizes.
  """
  kh, kw = kernel.shape[1:]
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
    acc = combine(acc, part)
  return output(q, acc)
