"""Softmax-weighted means with a pairwise bias on a band of keys: the core of AFT-local and
AFT-full, computed in query blocks with a hand-written tangent.

For a query t and a channel r (k, v, a, L are ``[T, R]``; w is ``[T, T]``):

    a[t, r] = sum_t' exp(k[t', r] + b[t, t']) v[t', r] / sum_t' exp(k[t', r] + b[t, t'])
    L[t, r] = log sum_t' exp(k[t', r] + b[t, t'])

where b[t, t'] = w[t, t'] on the band |t - t'| < s and 0 on every other key; causal: only
t' <= t. (s >= T: the band is every key, AFT-full.)

Layout. Queries are cut into nb blocks of c rows (the last block is moved back to end at T,
so it may overlap the one before; overlapping rows get the same values). Block b, rows
[rs, rs + c), sees the keys [ks, ks + W): its band plus the bias-0 keys between, a [c, W]
rectangle summed with matrix products of exp(b - row max) and exp(k - channel max) v. Keys
before ks (and, two-sided, from ks + W on) have bias 0 for every row of the block: their sums
are per-block vectors [nb, R] from a running scan. Every sum is exact: the running scans
carry their maximum; the rectangle's split shift is exact unless the largest term of a row
underflows, which shows as a tiny denominator (< 1e-25, with logits |k + w| ~ 100), and such
row groups are recomputed with a per-(t, r) maximum.

Memory. Scans over blocks keep every intermediate at block size. The derivative is a custom
JVP (forward mode works; reverse mode is its transpose): with p[t, t'] = exp(k[t'] + b[t, t']
- L[t]),

    da[t] = sum_t' p[t, t'] (dv[t'] + (dk[t'] + dw[t, t']) (v[t'] - a[t]))

(dw on the band only), the same blocked products with the saved a and L, so the only [T, R]
residuals are a and L, and the scan bodies are rematerialized: no per-block copies of exp(w)
or exp(k) are kept for the backward pass. Causal, a row whose a or L is not finite (it sees a
NaN or a key of +inf) has tangent 0 and every factor the tangent multiplies is ``tame``d, so
reverse mode never turns such a row's zero cotangent into 0 * NaN in an earlier gradient.
The recomputations are ``branch.cond``s, whose predicate vmap shares across the batch.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax.ops import branch
from aft_jax.ops import logsumexp
from aft_jax.ops.logsumexp import DEN_OK, NEG, Acc, combine, matmul, set_aside

# Elements of the [rows, W, R] logits tensor of one exact (fallback) row group.
_GROUP_ELEMENTS = 1 << 20
# exp(row max + channel max - L) is < 1e25 wherever the fast path is used; capped elsewhere
# (where its product is discarded) so that no inf can meet a zero cotangent.
_MAX_LOG_SCALE = 80.0


class BandPlan(NamedTuple):
  """Static block layout: T, window s (>= T: all keys), causal, c rows per block, nb blocks,
  W keys per block, rows per exact-recomputation group, and whether the block products take
  bfloat16 factors (``logsumexp.matmul``)."""

  t_len: int
  s: int
  causal: bool
  c: int
  nb: int
  width: int
  rows: int
  low: bool = False

  @property
  def groups(self) -> int:
    return self.c // self.rows

  def tame(self, x):
    """A factor of the tangent: causal, ``logsumexp.tame`` (a row after a NaN or an infinity
    has derivative 0, so that its zero cotangent reaches no earlier input); non-causal, every
    row sees every position, and a NaN anywhere is NaN everywhere, derivative included."""
    return logsumexp.tame(x) if self.causal else x


def _default_block(s: int, t_len: int) -> int:
  # Measured on CPU (T = 4096, R = 512): the per-block cost of a scan step dominates below
  # ~64 rows, and the masked corners of the [c, c + s - 1] rectangle above ~s rows.
  if s >= t_len:
    return 256
  return min(128, max(64, 1 << round(math.log2(s))))


def make_plan(
  t_len: int, r: int, window: int, causal: bool, block: int | None = None, low: bool = False
) -> BandPlan:
  """The layout for ``T = t_len`` positions, ``R = r`` channels and band half-width ``window``."""
  s = min(window, t_len)
  c = min(t_len, block or _default_block(s, t_len))
  nb = -(-t_len // c)
  width = min(t_len, c + s - 1 if causal else c + 2 * s - 2)
  rows = 1
  while c % (2 * rows) == 0 and 2 * rows * width * r <= _GROUP_ELEMENTS:
    rows *= 2
  return BandPlan(t_len, s, causal, c, nb, width, rows, low)


def _starts(p: BandPlan):
  """Per block: first row rs, first key ks and end of the keys ke = ks + W (numpy, [nb])."""
  rs = np.minimum(np.arange(p.nb) * p.c, p.t_len - p.c)
  ks = np.clip(rs - (p.s - 1), 0, p.t_len - p.width)
  return rs.astype(np.int32), ks.astype(np.int32), (ks + p.width).astype(np.int32)


def _edge_ranges(p: BandPlan):
  """Key ranges [lo, hi) added per block to the prefix sums (keys < ks) and, two-sided, to the
  suffix sums (keys >= ke, built from the last block back). Each range has <= c keys."""
  _, ks, ke = _starts(p)
  pre = (np.concatenate([[0], ks[:-1]]).astype(np.int32), ks)
  suf = (ke, np.concatenate([ke[1:], [p.t_len]]).astype(np.int32))
  return pre, suf


def _bias(p: BandPlan, w_blk, rs, ks):
  """The block's biases [c, W] (NEG where a key is excluded) and its band mask."""
  d = (ks + jnp.arange(p.width))[None, :] - (rs + jnp.arange(p.c))[:, None]  # t' - t
  band = jnp.abs(d) < p.s
  if p.causal:
    band &= d <= 0
    return jnp.where(band, w_blk, jnp.where(d < 0, 0.0, NEG)), band
  return jnp.where(band, w_blk, 0.0), band


def _slice(x, start, size):
  return jax.lax.dynamic_slice_in_dim(x, start, size, 0)


def _range_keys(k, lo, hi, c):
  """(start, mask) of the c keys from start = min(lo, T - c): mask [c, 1] is lo <= t' < hi."""
  st = jnp.clip(lo, 0, k.shape[0] - c)
  idx = st + jnp.arange(c)
  return st, ((idx >= lo) & (idx < hi))[:, None]


def _no_keys(ranges) -> bool:
  """Whether every range [lo, hi) of ``_edge_ranges`` (numpy, static) is empty."""
  lo, hi = ranges
  return bool(np.all(np.asarray(lo) >= np.asarray(hi)))


def _edge_sums(p: BandPlan, k, v, ranges, reverse: bool) -> Acc:
  """Running exact sums (bias 0) over the blocks' key ranges: the triple after each block's
  range is added, [nb, R] each (in block order, or from the last block back)."""
  c = p.c

  def step(acc, lohi):
    st, keep = _range_keys(k, *lohi, c)
    kk = jnp.where(keep, _slice(k, st, c), NEG)
    m = jnp.maximum(acc.m, jnp.max(kk, axis=0))
    e = jnp.where(keep, jnp.exp(kk - m), 0.0)
    scale = jnp.exp(acc.m - m)
    acc = Acc(
      m,
      acc.num * scale + jnp.sum(e * jnp.where(keep, _slice(v, st, c), 0.0), axis=0),
      acc.den * scale + jnp.sum(e, axis=0),
    )
    return acc, acc

  zero = jnp.zeros_like(k[0])  # of k's type: in shard_map, varying where k does (carries)
  if _no_keys(ranges):  # one block, say: nothing to add (XLA would constant-fold the masks)
    none = jnp.zeros_like(k[:1], shape=(p.nb, *k.shape[1:]))
    return Acc(none + NEG, none, none)
  return jax.lax.scan(step, Acc(zero + NEG, zero, zero), ranges, reverse=reverse)[1]


def _edge_tangent(p: BandPlan, k, v, m, ranges, reverse: bool, dk, dv):
  """The tangent of ``_edge_sums`` in the scale of its maxima m [nb, R]: per block
  G = sum exp(k - m) (dv + dk v) and H = sum exp(k - m) dk over the keys so far, [nb, R]."""
  c = p.c
  empty = jnp.full_like(m[:1], NEG)
  m_prev = jnp.concatenate([m[1:], empty] if reverse else [empty, m[:-1]])

  def step(gh, xs):
    lo, hi, mb, mp = xs
    st, keep = _range_keys(k, lo, hi, c)
    e = p.tame(jnp.exp(jnp.where(keep, _slice(k, st, c) - mb, NEG)))
    dkk = _slice(dk, st, c)
    scale = p.tame(jnp.exp(mp - mb))  # <= 1: the maximum only grows
    vv = jnp.where(keep, _slice(v, st, c), 0.0)  # masked before the product (0 * NaN = NaN)
    g = gh[0] * scale + jnp.sum(e * (_slice(dv, st, c) + dkk * vv), axis=0)
    h = gh[1] * scale + jnp.sum(e * dkk, axis=0)
    return (g, h), (g, h)

  if _no_keys(ranges):
    return jnp.zeros_like(m), jnp.zeros_like(m)
  zero = jnp.zeros_like(k[0])
  return jax.lax.scan(jax.checkpoint(step), (zero, zero), (*ranges, m, m_prev), reverse=reverse)[1]


def _patch(p: BandPlan, bad, fast, exact):
  """``fast`` (a tuple of [c, R] arrays) with the row groups flagged in ``bad`` [groups]
  replaced by ``exact(g)`` (a tuple of [rows, R]); nothing is recomputed when none is."""

  def one(args):
    g, flag, f = args
    return branch.cond(flag, lambda: exact(g), lambda: f)

  def run():
    split = tuple(x.reshape((p.groups, p.rows) + x.shape[1:]) for x in fast)
    out = jax.lax.map(jax.checkpoint(one), (jnp.arange(p.groups), bad, split))
    return tuple(x.reshape((p.c,) + x.shape[2:]) for x in out)

  return branch.cond(jnp.any(bad), run, lambda: fast)


class _Residuals(NamedTuple):
  """What the forward pass hands to the tangent: a, L ``[T, R]``, the recomputed row groups
  ``[nb, groups]`` and the maxima of the prefix and suffix edge sums ``[nb, R]`` (suffix: None
  when causal)."""

  a: jax.Array
  lse: jax.Array
  bad: jax.Array
  pre_m: jax.Array
  suf_m: jax.Array | None


def _block(p: BandPlan, k, v, w, rs, ks):
  """Block (rs, ks): its biases [c, W] and band mask (``_bias``) and its keys and values
  [W, R]."""
  bias, band = _bias(p, jax.lax.dynamic_slice(w, (rs, ks), (p.c, p.width)), rs, ks)
  return bias, band, _slice(k, ks, p.width), _slice(v, ks, p.width)


def _shifted(p: BandPlan, bias, kw, vw, rs, ks):
  """The block's split shift: exp(bias - row max) [c, W], exp(k - channel max) and the values
  [W, R], the two maxima, and (causal) per (row, channel) [c, R] the largest exp(k - channel
  max) the row sees, inf where it sees a set-aside key (else None).

  Causal: the channel max is over the keys the block's first row sees, never a later key, so
  later keys (finite or not) cannot change an earlier row's rounding; a key exceeding it by more
  than e^60, or not finite, or with a non-finite value is set aside (``logsumexp.set_aside``:
  zeroed before the products) and the rows that see it are recomputed exactly.
  """
  mw = jnp.max(bias, axis=1)
  pt = jnp.exp(bias - mw[:, None])
  if not p.causal:
    mk = jnp.max(kw, axis=0)
    return pt, jnp.exp(kw - mk), vw, mw, mk, None
  first = (ks + jnp.arange(p.width) <= rs)[:, None]  # the keys the block's first row sees
  mk = jnp.max(jnp.where(first, kw, NEG), axis=0)
  ok, e, vw = set_aside(jnp.exp(kw - mk), vw)
  # Row i sees the keys up to rs + i: a running max of e (inf where set aside), read there.
  seen = jax.lax.cummax(jnp.where(ok, e, jnp.inf), axis=0)
  return pt, e, vw, mw, mk, jax.lax.dynamic_slice_in_dim(seen, rs - ks, p.c, 0)


def _matmul(p: BandPlan, pt, x):
  return matmul("cw,wx->cx", pt, x, p.low)


def _forward(p: BandPlan, k, v, w) -> _Residuals:
  """a, L [T, R] and what the tangent needs besides (``_Residuals``)."""
  r = k.shape[1]
  rs, ks, _ = _starts(p)
  pre_r, suf_r = _edge_ranges(p)
  pre = _edge_sums(p, k, v, pre_r, False)
  suf = None if p.causal else _edge_sums(p, k, v, suf_r, True)

  def block(_, xs):
    b_rs, b_ks, pre_b, suf_b = xs
    bias, _, kw, vw = _block(p, k, v, w, b_rs, b_ks)
    pt, e, vs, mw, mk, seen = _shifted(p, bias, kw, vw, b_rs, b_ks)
    nd = _matmul(p, pt, jnp.concatenate([e * vs, e], axis=1))
    fast = (mw[:, None] + mk, nd[:, :r], nd[:, r:])
    # A product exp(b - mw) exp(k - mk) loses a term when its first factor underflows (< 1e-38),
    # so den must exceed DEN_OK times the largest second factor the row sees (inf: set aside).
    redo = ~(fast[2] >= DEN_OK * (1.0 if seen is None else jnp.maximum(seen, 1.0)))
    bad = jnp.any(redo.reshape(p.groups, p.rows, r), axis=(1, 2))
    # Causal: the keys after each row, masked before exp and the products.
    sees = (jnp.arange(p.width)[None, :] + b_ks <= jnp.arange(p.c)[:, None] + b_rs)[..., None]

    def exact(g):  # the flagged (row, channel)s of group g; the others keep the fast values
      rows = lambda x: _slice(x, g * p.rows, p.rows)
      logits = rows(bias)[:, :, None] + kw[None]
      vg = vw[None]
      if p.causal:
        logits = jnp.where(rows(sees), logits, NEG)
        vg = jnp.where(rows(sees), vg, 0.0)
      m = jnp.max(logits, axis=1)
      pe = jnp.exp(logits - m[:, None])
      if p.causal:
        pe = jnp.where(rows(sees), pe, 0.0)
      out = (m, jnp.sum(pe * vg, axis=1), jnp.sum(pe, axis=1))
      return tuple(jnp.where(rows(redo), x, rows(f)) for x, f in zip(out, fast))

    acc = combine(Acc(*_patch(p, bad, fast, exact)), Acc(*(x[None] for x in pre_b)))
    if suf_b is not None:
      acc = combine(acc, Acc(*(x[None] for x in suf_b)))
    return None, (acc.num / acc.den, acc.m + jnp.log(acc.den), bad)

  _, (a, lse, bad) = jax.lax.scan(block, None, (rs, ks, pre, suf))
  suf_m = None if suf is None else suf.m
  return _Residuals(_unblock(p, a), _unblock(p, lse), bad, pre.m, suf_m)


def _unblock(p: BandPlan, x):
  """[nb, c, ...] -> [T, ...], dropping the rows the last block shares with the one before."""
  if p.nb * p.c == p.t_len:
    return x.reshape((p.t_len,) + x.shape[2:])
  head = x[:-1].reshape(((p.nb - 1) * p.c,) + x.shape[2:])
  return jnp.concatenate([head, x[-1, p.nb * p.c - p.t_len :]], axis=0)


def _tangent(p: BandPlan, k, v, w, res: _Residuals, dk, dv, dw):
  """da [T, R]: linear in (dk, dv, dw); everything else is recomputed from the primals."""
  r = k.shape[1]
  a, lse, pre_m, suf_m = res.a, res.lse, res.pre_m, res.suf_m
  rs, ks, _ = _starts(p)
  pre_r, suf_r = _edge_ranges(p)
  pre = (pre_m, *_edge_tangent(p, k, v, pre_m, pre_r, False, dk, dv))
  suf = None if p.causal else (suf_m, *_edge_tangent(p, k, v, suf_m, suf_r, True, dk, dv))

  def block(patched: bool, xs):
    b_rs, b_ks, bad_b, pre_b, suf_b = xs
    bias, band, kw, vw = _block(p, k, v, w, b_rs, b_ks)
    dwb = jnp.where(band, jax.lax.dynamic_slice(dw, (b_rs, b_ks), (p.c, p.width)), 0.0)
    dkw, dvw = _slice(dk, b_ks, p.width), _slice(dv, b_ks, p.width)
    a_raw, l_r = _slice(a, b_rs, p.c), _slice(lse, b_rs, p.c)
    a_r = p.tame(a_raw)
    pt, e, vs, mw, mk, _ = _shifted(p, bias, kw, vw, b_rs, b_ks)
    pt = p.tame(pt)
    scale = p.tame(jnp.exp(jnp.minimum(mw[:, None] + mk - l_r, _MAX_LOG_SCALE)))
    nd = _matmul(p, pt, jnp.concatenate([e * (dvw + dkw * vs), e * dkw], axis=1)) + _matmul(
      p, pt * dwb, jnp.concatenate([e * vs, e], axis=1)
    )
    da = scale * (nd[:, :r] - a_r * nd[:, r:])

    def exact(g):
      rows = lambda x: _slice(x, g * p.rows, p.rows)
      pe = p.tame(jnp.exp(rows(bias)[:, :, None] + kw[None] - rows(l_r)[:, None]))  # <= 1
      vd = p.tame(vw[None] - rows(a_r)[:, None])
      t = dvw[None] + (dkw[None] + rows(dwb)[:, :, None]) * vd
      return (jnp.sum(pe * t, axis=1),)

    if patched:
      (da,) = _patch(p, bad_b, (da,), exact)
    for edge in (pre_b, suf_b):
      if edge is not None:
        m, g, h = edge
        da = da + p.tame(jnp.exp(m - l_r)) * (g - a_r * h)  # exp(m - L) <= 1
    return jnp.where(logsumexp.keep(a_raw, l_r), da, 0.0) if p.causal else da

  def run(patched: bool):
    body = jax.checkpoint(lambda _, xs: (None, block(patched, xs)))
    return jax.lax.scan(body, None, (rs, ks, res.bad, pre, suf))[1]

  # The recomputed rows are patched in a second version of the scan, chosen once: a cond in
  # every block would take that block's tangents as operands, and its transpose (reverse mode)
  # would fill and add zero cotangents of them per block whichever branch runs (measured on
  # CPU: 1/6 of AFT-full's forward+backward at T 1024, d 512).
  da = branch.cond(jnp.any(res.bad), lambda: run(True), lambda: run(False))
  return _unblock(p, da)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def banded_mean(p: BandPlan, k, v, w):
  """a [T, R] (module docstring) for k, v [T, R] and w [T, T], float32 or float64."""
  return _forward(p, k, v, w).a


@banded_mean.defjvp
def _banded_mean_jvp(p, primals, tangents):
  k, v, w = primals
  res = _forward(p, k, v, w)
  tangent = jax.checkpoint(functools.partial(_tangent, p))
  return res.a, tangent(k, v, w, res, *tangents)
