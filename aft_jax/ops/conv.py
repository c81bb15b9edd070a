"""AFT-conv (paper Eq. 6) over a sequence (``aft_conv1d``, its modes and step) and an image
(``aft_conv2d``), XLA only (docs/kernels.md, "How each module computes")."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax.ops import common
from aft_jax.ops import logsumexp as lse
from aft_jax.ops.logsumexp import HIGHEST, NEG, Acc, combine, finite, gate, output, tame, tame_bias

DENSE_MAX_T = 64  # causal T summed densely (there faster than the band; B H T^2 floats)
BAND_CHUNK = 32  # rows per product of the in-kernel sum (``_band_sum``)


def _check(fn, q, k, v, kernel, n_spatial, causal, impl):
  q, k, v = (common.array(fn, n, x) for n, x in (("q", q), ("k", k), ("v", v)))
  kernel = common.array(fn, "kernel", kernel)
  common.check_arrays(fn, q=q, k=k, v=v, kernel=kernel)
  sp = "Ht, Wd" if n_spatial == 2 else "T"
  if q.ndim < n_spatial + 2 or v.shape != q.shape or k.shape != q.shape[:-1]:
    raise ValueError(
      f"{fn}: expected q, v [..., {sp}, H, C] and k [..., {sp}, H]; got q {q.shape}, "
      f"k {k.shape}, v {v.shape}"
    )
  if kernel.ndim != n_spatial + 1 or kernel.shape[0] != q.shape[-2]:
    raise ValueError(
      f"{fn}: kernel must be [H, {'kh, kw' if n_spatial == 2 else 's'}] with H = "
      f"{q.shape[-2]} heads; got kernel {kernel.shape}"
    )
  common.resolve(fn, impl, (), causal=causal, channels=q.shape[-1])  # (no kernel: refused)
  if min(kernel.shape[1:]) < 1:
    raise ValueError(f"{fn}: kernel sizes must be >= 1; got kernel {kernel.shape}")
  if not causal and any(s % 2 == 0 for s in kernel.shape[1:]):
    what = "a non-causal kernel size" if n_spatial == 1 else "kernel sizes"
    raise ValueError(f"{fn}: {what} must be odd (centred); got kernel {kernel.shape}")
  return q, k, v, kernel


def aft_conv1d(
  q, k, v, kernel, *, causal=False, impl="auto", initial_state=None, output_final_state=False,
  segment_ids=None, axis_name=None,
):  # fmt: skip
  """AFT-conv over a sequence: per head i, AFT-full with w^i[t, t'] = kernel[i, j] at t' =
  t + j - s // 2 (non-causal, s odd) or t' = t - j (causal), 0 elsewhere.

  Args:
    q, v: ``[..., T, H, C]``; k: ``[..., T, H]`` (one key per head); kernel: ``[H, s]``.
    causal, impl: as ``aft_simple`` ("pallas" is refused: no kernel).
    initial_state, output_final_state, segment_ids, axis_name: causal: as ``aft_simple``.

  Returns:
    ``[..., T, H, C]``, or ``(Y, state)``; O(T s H C).
  """
  fn = "aft_conv1d"
  q, k, v, kernel = _check(fn, q, k, v, kernel, 1, causal, impl)
  mode = common.check_mode(
    fn, causal, impl, initial_state=initial_state, output_final_state=output_final_state,
    segment_ids=segment_ids, axis_name=axis_name,
  )  # fmt: skip
  common.check_arrays(fn, k.shape[:-1], segment_ids=segment_ids)
  k_t, v_t = k.shape[:-2] + k.shape[-1:], v.shape[:-3] + v.shape[-2:]
  common.check_state(fn, initial_state, lambda: aft_conv1d_init(k_t, v_t, kernel.shape[-1]))
  return common.eager(
    _run, q=q, k=k, v=v, kernel=kernel, state=initial_state, segment_ids=segment_ids,
    mode=mode, causal=bool(causal), final=output_final_state, axis_name=axis_name,
  )  # fmt: skip


def _run(q, k, v, kernel, state, segment_ids, mode, causal, final, axis_name):
  s = kernel.shape[-1]
  if mode == "packed":
    kernel_t = jnp.asarray(kernel, jnp.float32).T  # [s, H]: row j the bias at lag j
    return lse.packed(q, k, v, segment_ids, s, lambda j: kernel_t[j])
  if mode == "whole":
    return _whole(q, k, v, kernel, causal)
  if mode == "sharded":
    state, final = lse.shard_state(k, v, s, axis_name), False
  axis = k.ndim - 2
  if k.shape[axis] == 0:
    one = lambda x: x.shape[:axis] + x.shape[axis + 1 :]
    return lse.nothing(q, k, v, state, final, lambda: lse.window_init(one(k), one(v), s))
  # -inf: a key of -inf is no term (``logsumexp.leaf``).
  y = lse.after_state(lambda *qkv: _whole(*qkv, kernel, True), q, k, v, state, -jnp.inf)
  return (y, lse.final(state, k, v, s)) if final else y


def aft_conv2d(q, k, v, kernel, *, impl="auto"):
  """AFT-conv over an image: per head i, the bias kernel[i, a, b] at (r + a - kh // 2, c + b -
  kw // 2) ("SAME"), 0 elsewhere.

  Args:
    q, v: ``[..., Ht, Wd, H, C]``; k: ``[..., Ht, Wd, H]``; kernel: ``[H, kh, kw]``, odd sizes.
    impl: as ``aft_conv1d``.

  Returns:
    ``[..., Ht, Wd, H, C]``; O(Ht Wd kh kw C).
  """
  q, k, v, kernel = _check("aft_conv2d", q, k, v, kernel, 2, False, impl)
  return common.eager(_whole, q=q, k=k, v=v, kernel=kernel, causal=False)


def _whole(q, k, v, kernel, causal):  # kernel [H, s]: a sequence; [H, kh, kw]: an image
  out_dt, dt = common.dtypes(q, k, v)
  if q.size == 0 or k.size == 0:
    return jnp.zeros(q.shape, out_dt)
  q, k, v, kernel = (jnp.asarray(x, dt) for x in (q, k, v, kernel))
  kernel = _reachable(kernel, q.shape[-kernel.ndim - 1 : -2], causal)
  if kernel.ndim == 3:
    return _conv2d(q, k, v, kernel).astype(out_dt)
  return (_causal_conv1d if causal else _conv1d)(q, k, v, kernel).astype(out_dt)


def _reachable(kernel, sizes, causal):  # the taps that can reach a position over ``sizes``
  if causal:
    return kernel[:, : sizes[0]]
  cut = [slice(max(0, s // 2 - n + 1), s // 2 + n) for s, n in zip(kernel.shape[1:], sizes)]
  return kernel[(slice(None), *cut)]


def aft_conv1d_init(k_shape, v_shape, kernel_size: int) -> lse.WindowState:
  """The state before any token, for k_t ``[..., H]``, v_t ``[..., H, C]`` and a kernel size."""
  return lse.window_init(k_shape, v_shape, kernel_size)


def aft_conv1d_step(state: lse.WindowState, q_t, k_t, v_t, kernel):
  """One token: q_t, v_t ``[..., H, C]``, k_t ``[..., H]``, kernel ``[H, s]``; ``(Y[t], state)``."""
  kernel = jnp.asarray(kernel, jnp.float32)
  return lse.window_step(state, q_t, k_t, v_t, lambda _, age: kernel.T[age])


def _acc_shift(acc: Acc, offsets, axes) -> Acc:  # acc[i + offset] per axis, empty past the ends
  for offset, axis in zip(offsets, axes):
    acc = Acc(*(lse.shift(x, -offset, axis, f) for x, f in zip(acc, (NEG, 0.0, 0.0))))
  return acc


def _prefix0(acc: Acc) -> Acc:  # exact inclusive prefix sums: scans over sqrt(T) chunks
  t_len = acc.m.shape[0]
  c = max(1, 1 << round(math.log2(max(1.0, math.sqrt(t_len)))))
  n = -(-t_len // c)
  fills = (NEG, 0.0, 0.0)

  def chunks(x, fill):  # [T, ...] -> [c, n, ...]: position j c + i at [i, j]
    x = jnp.pad(x, [(0, n * c - t_len)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
    return jnp.swapaxes(x.reshape((n, c) + x.shape[1:]), 0, 1)

  xs = Acc(*(chunks(x, f) for x, f in zip(acc, fills)))
  empty = Acc(*(jnp.full_like(x[0], f) for x, f in zip(xs, fills)))  # varying as the inputs

  def step(carry, x):
    new = combine(carry, Acc(*x))
    return new, new

  totals, local = jax.lax.scan(step, empty, tuple(xs))  # local: [c, n, ...]
  out = Acc(*local)
  if n > 1:
    outer = lambda carry, x: (combine(carry, Acc(*x)), carry)
    _, before = jax.lax.scan(outer, Acc(*(x[0] for x in empty)), tuple(totals))  # exclusive
    out = combine(Acc(*(x[None] for x in before)), out)
  unchunk = lambda x: jnp.swapaxes(x, 0, 1).reshape((n * c,) + x.shape[2:])[:t_len]
  return Acc(*(unchunk(x) for x in out))


def _acc_scan(acc: Acc, axis: int, reverse: bool = False) -> Acc:  # prefix (suffix) sums
  fwd = lambda x: jnp.flip(jnp.moveaxis(x, axis, 0), 0) if reverse else jnp.moveaxis(x, axis, 0)
  back = lambda x: jnp.moveaxis(jnp.flip(x, 0) if reverse else x, 0, axis)
  return Acc(*(back(x) for x in _prefix0(Acc(*(fwd(x) for x in acc)))))


def _outside(leaf: Acc, axis: int, before: int, after: int | None = None) -> Acc:
  """Sum of the terms at t' <= t - before [and t' >= t + after] (bias 0 there)."""
  acc = _acc_shift(_acc_scan(leaf, axis), (-before,), (axis,))
  if after is None:
    return acc
  return combine(acc, _acc_shift(_acc_scan(leaf, axis, reverse=True), (after,), (axis,)))


def _kernel_sum(leaf: Acc, kernel, offsets, axes) -> Acc:  # over offsets o: k[t + o] + kernel[:, o]
  shifts = [_acc_shift(leaf, o, axes) for o in offsets]
  logits = [jnp.where(s.den > 0, s.m + kernel[:, j], NEG) for j, s in enumerate(shifts)]
  # At least NEG: taps of -inf are no terms (exp(-inf - NEG) = 0), not a shift of -inf (NaN).
  m = jax.lax.stop_gradient(jnp.maximum(jnp.max(jnp.stack(logits), axis=0), NEG))
  num, den = jnp.zeros_like(leaf.num), jnp.zeros_like(leaf.den)
  for s, logit in zip(shifts, logits):
    p = jnp.exp(logit - m)  # s.num, s.den carry the leaf's k-gradient factor
    num, den = num + p[..., None] * s.num, den + p * s.den
  return Acc(m, num, den)


def _band_sum(leaf: Acc, kernel, first: int, axis: int) -> Acc:
  """``_kernel_sum`` along ``axis`` (heads after it), tap j at offset first + j, as one product
  per head and chunk of c rows: the band of the kernel's biases (0 off the band) times the
  chunk's c + s - 1 keys. Finite leaves: a key off a row's band meets it there (0 * NaN)."""
  s, t_len = kernel.shape[-1], leaf.m.shape[axis]
  c = max(min(BAND_CHUNK, t_len), s - 1)
  n = -(-t_len // c)

  def windows(x, fill):  # [..., T, H, ...] -> [..., H, n, c + s - 1, ...]: chunk i's keys
    x = jnp.swapaxes(x, axis, axis + 1)
    pad = [(0, 0)] * x.ndim
    pad[axis + 1] = (-first, (n + 1) * c - t_len + first)
    x = jnp.pad(x, pad, constant_values=fill)
    x = x.reshape(x.shape[: axis + 1] + (n + 1, c) + x.shape[axis + 2 :])
    cut = lambda lo, hi, size: jax.lax.slice_in_dim(x, lo, hi, axis=axis + 1)[
      (slice(None),) * (axis + 2) + (slice(0, size),)
    ]
    return jnp.concatenate([cut(0, n, c), cut(1, n + 1, s - 1)], axis=axis + 2)

  m, num, den = (windows(x, f) for x, f in zip(leaf, (NEG, 0.0, 0.0)))
  tap = np.arange(c + s - 1)[None, :] - np.arange(c)[:, None]  # row i, key i + j: tap j
  band = (tap >= 0) & (tap < s)
  bias = kernel[:, None, np.clip(tap, 0, s - 1)]  # [H, 1, c, c + s - 1]
  ok = band & (den > 0)[..., None, :]  # [..., H, n, c, c + s - 1]
  logits = jnp.where(ok, m[..., None, :] + bias, NEG)
  # At least NEG: taps of -inf are no terms (exp(-inf - NEG) = 0), not a shift of -inf (NaN).
  mx = jax.lax.stop_gradient(jnp.maximum(jnp.max(logits, axis=-1), NEG))  # [..., H, n, c]
  p = jnp.where(ok, jnp.exp(logits - mx[..., None]), 0.0)  # num, den carry the k-gradient
  out = Acc(mx, jnp.einsum("...ck,...kd->...cd", p, num, precision=HIGHEST),
            jnp.sum(p * den[..., None, :], axis=-1))  # fmt: skip

  def rows(x):  # [..., H, n, c, ...] -> [..., T, H, ...]
    x = x.reshape(x.shape[: axis + 1] + (n * c,) + x.shape[axis + 3 :])
    return jnp.swapaxes(jax.lax.slice_in_dim(x, 0, t_len, axis=axis + 1), axis, axis + 1)

  return Acc(*(rows(x) for x in out))


@jax.custom_jvp
def _causal_conv1d(q, k, v, kernel):
  return _conv1d(q, k, v, kernel, True)


@_causal_conv1d.defjvp
def _causal_conv1d_jvp(primals, tangents):  # non-finite inputs 0, on rows that saw none; else 0
  q, k, v, kernel = primals
  bad, k_clean, v_clean = _tamed(k, v)
  clean = (tame(q), k_clean, v_clean, tame_bias(kernel))
  y_clean, dy = jax.jvp(lambda *a: _conv1d(*a, True, finite_values=True), clean, tangents)
  anything = jnp.any(bad) | ~jnp.all(finite(q)) | ~jnp.all(finite(kernel))
  y = lse.cond(anything, lambda: _conv1d(q, k, v, kernel, True), lambda: y_clean)
  # The rows that saw a non-finite key or value (a running maximum: only where there is one).
  seen = lse.cond(jnp.any(bad), lambda: _seen(bad, k.ndim - 2), lambda: jnp.zeros_like(bad))
  return y, jnp.where(~seen & finite(y), dy, 0.0)


def _seen(bad, axis: int):  # causal: where a row has seen a True of ``bad`` along ``axis``
  return jax.lax.cummax(bad.astype(jnp.int32), axis=axis) > 0


def _tamed(k, v):  # (where a key or value is not finite [..., T, H, C], k and v with those 0)
  bad_k = ~finite(k) & (k != -jnp.inf)  # a key of -inf is no term (``logsumexp.leaf``)
  return bad_k[..., None] | ~finite(v), jnp.where(bad_k, 0.0, k), tame(v)


def _conv1d(q, k, v, kernel, causal: bool = False, finite_values: bool = False):
  """sigma(q) * the mean; ``finite_values``: k, v are known finite, or keys of -inf (the JVP's
  tamed inputs). The rows that see a non-finite key or value take the shifted sums (exact); the
  others keep the fast form's values, bit for bit."""
  dense = causal and k.shape[k.ndim - 2] <= DENSE_MAX_T
  fast = lambda k, v: (
    _dense_causal(q, k, v, kernel) if dense else _sums_conv1d(q, k, v, kernel, causal)
  )
  if finite_values:
    return fast(k, v)
  bad, k_clean, v_clean = _tamed(k, v)
  axis, y = k.ndim - 2, fast(k_clean, v_clean)

  def shifted():
    seen = _seen(bad, axis) if causal else jnp.any(bad, axis=axis, keepdims=True)
    return jnp.where(seen, _sums_conv1d(q, k, v, kernel, causal, banded=False), y)

  return lse.cond(jnp.any(bad), shifted, lambda: y)


def _dense_causal(q, k, v, kernel):  # one masked [T, T] sum per head; finite v
  t_len, s = k.shape[-2], kernel.shape[-1]
  t = np.arange(t_len)
  d = t[:, None] - t[None, :]  # t - t'
  bias = jnp.where((d < s)[None], kernel[:, np.clip(d, 0, s - 1)], 0.0)  # [H, T, T']
  logits = k[..., None, :, :] + jnp.moveaxis(bias, 0, -1)  # [..., T, T', H]
  valid = (d >= 0)[:, :, None] & (k != -jnp.inf)[..., None, :, :]
  # Masked before the exponential: a later key above a row's max would overflow (0 * inf).
  logits = jnp.where(valid, logits, NEG)
  m = jax.lax.stop_gradient(jnp.max(logits, axis=-2))  # [..., T, H]
  p = jnp.where(valid, jnp.exp(logits - m[..., None, :]), 0.0)
  num = jnp.einsum("...tsh,...shc->...thc", p, v, precision=HIGHEST)
  # A row of no term (all keys -inf) is NaN as in the band form, its cotangent stopped (0 * NaN).
  den = jnp.sum(p, axis=-2)
  empty = (den == 0.0)[..., None]
  mean = jnp.where(empty, 0.0, num) / jnp.where(empty, 1.0, den[..., None])
  return gate(q, jnp.where(empty, jnp.nan, mean))


def _sums_conv1d(q, k, v, kernel, causal: bool, banded: bool = True):
  """sigma(q) * the mean: the kernel's taps (``banded``: a product per chunk, for finite k and
  v; else one shifted copy of the keys per tap) and the positions past them (scans)."""
  s, axis = kernel.shape[-1], k.ndim - 2
  leaf = lse.leaf(k, v)
  kernel, first = (kernel[:, ::-1], 1 - s) if causal else (kernel, -(s // 2))
  if banded:
    inside = _band_sum(leaf, kernel, first, axis)
  else:
    inside = _kernel_sum(leaf, kernel, [(first + j,) for j in range(s)], (axis,))
  rest = _outside(leaf, axis, s) if causal else _outside(leaf, axis, s // 2 + 1, s // 2 + 1)
  return output(q, combine(inside, rest))


def _conv2d(q, k, v, kernel):  # sigma(q) * the AFT-conv mean over an image
  kh, kw = kernel.shape[1:]
  row, col = k.ndim - 3, k.ndim - 2
  leaf = lse.leaf(k, v)
  offsets = [(a - kh // 2, b - kw // 2) for a in range(kh) for b in range(kw)]
  acc = _kernel_sum(leaf, kernel.reshape(kernel.shape[0], -1), offsets, (row, col))
  # Outside the kernel (w = 0): whole rows above and below, then its rows' columns either side.
  rows = lse.reduce_over(leaf, col, jnp.ones(leaf.m.shape[col], bool))  # each row's whole sum
  rows = Acc(*(jnp.expand_dims(x, col) for x in rows))
  acc = combine(acc, _outside(rows, row, kh // 2 + 1, kh // 2 + 1))
  sides = _outside(leaf, col, kw // 2 + 1, kw // 2 + 1)
  for a in range(-(kh // 2), kh // 2 + 1):
    acc = combine(acc, _acc_shift(sides, (a,), (row,)))
  return output(q, acc)
