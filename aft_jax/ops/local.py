"""AFT-local (paper Eq. 4) and AFT-full (Eq. 2: AFT-local with a band of every key, no kernel):
the ops, their steps, the banded XLA sums; its kernel: ``pallas.triton_local`` (docs/kernels.md)."""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax.ops import common
from aft_jax.ops import logsumexp as lse
from aft_jax.ops.logsumexp import DEN_OK, NEG, Acc, combine, matmul, set_aside
from aft_jax.ops.pallas import triton_local

FN, FULL = "aft_local", "aft_full"
KERNELS = (common.Kernel("gpu", triton_local.local_mean, triton_local.unsupported),)
FULL_KERNELS = ()  # (none: impl="pallas" is refused)
# Sub-pieces (>= 4 windows) of a long piece given w's factors: its memory stays linear.
SUB_PIECE = 2048
# AFT-full's causal blocks: this many scans, each over the keys its blocks need (_over_blocks).
KEY_GROUPS = 2


class Factors(NamedTuple):  # w = u v^T, u, v [L, d']: a piece forms only the block it reads
  u: jax.Array
  v: jax.Array

  @property
  def shape(self):
    return (self.u.shape[0], self.v.shape[0])


def aft_local(
  q, k, v, w, *, window, causal=False, impl="auto", offset=None, initial_state=None,
  output_final_state=False, segment_ids=None, positions=None, axis_name=None,
):  # fmt: skip
  """AFT-local: AFT-full with w[t, t'] where |t - t'| < window, bias 0 elsewhere.

  Args:
    q, k, v: ``[..., T, D]``.
    w: ``[T, T]``; in a piece ``[L, L]``, L >= offset + T; or its factors ``(u, v)``, ``[L, d']``.
    window: s >= 1.
    causal, impl: as ``aft_simple``.
    offset: causal: q's first row in w (an int or traced scalar), default
      ``initial_state.index``; a traced offset that is wrong or past L gives NaN.
    initial_state, output_final_state: causal: as ``aft_simple``, a ``WindowState``.
    segment_ids, positions: causal: packed documents' ids and positions in w, ``[..., T]`` ints.
    axis_name: causal: as ``aft_simple``; w is the whole sequence's bias.

  Returns:
    ``[..., T, D]``, or ``(Y, state)``; O(T s D) (docs/long_sequences.md).
  """
  q, k, v = common.check_qkv(FN, q, k, v)
  window = common.check_window(FN, window)
  given = dict(initial_state=initial_state, output_final_state=output_final_state, offset=offset)
  given.update(segment_ids=segment_ids, positions=positions, axis_name=axis_name)
  mode = common.check_mode(FN, causal, impl, **given)
  t_len, guard = q.shape[-2], None
  if isinstance(w, (tuple, list)):
    shapes = [jnp.shape(x) for x in w]
    if len(w) != 2 or len(shapes[0]) != 2 or shapes[0] != shapes[1]:
      raise ValueError(f"{FN}: w as factors (u, v) must be two [L, d'] arrays; got shapes {shapes}")
    common.check_arrays(FN, u=w[0], v=w[1])
    w = Factors(*w)
    if mode == "packed" or not causal or (mode == "whole" and not _in_sub_pieces(t_len, window)):
      w = _dense(w)  # these read all of w; a short sequence takes it dense
  if mode == "sharded":
    check_bias(FN, w, t_len * jax.lax.axis_size(axis_name), 0)
  elif mode == "packed":
    common.check_arrays(FN, q.shape[:-1], segment_ids=segment_ids, positions=positions)
    common.check_arrays(FN, w=w)
  elif mode == "whole" and not isinstance(w, Factors):
    check_bias(FN, w, t_len)
  else:
    shape = q.shape[:-2] + q.shape[-1:]
    common.check_state(FN, initial_state, lambda: aft_local_init(shape, window))
    offset, guard = _offset(offset, initial_state, w, t_len)
  return common.eager(  # a piece's offset traced: one program for every piece
    _run, ("offset",), q=q, k=k, v=v, w=w, offset=offset, guard=guard, state=initial_state,
    segment_ids=segment_ids, positions=positions, mode=mode, window=window, causal=bool(causal),
    impl=impl, final=output_final_state, axis_name=axis_name,
  )  # fmt: skip


def _run(q, k, v, w, segment_ids, positions, mode, window, causal, impl, fn=FN, offset=None,
         guard=None, state=None, final=False, axis_name=None):  # fmt: skip
  if mode == "packed":
    return lse.packed(q, k, v, segment_ids, window, band_bias(w, positions, q.shape[-2]))
  if mode == "sharded":
    state = lse.shard_state(k, v, window, axis_name)
    return _piece(q, k, v, w, window, impl, state.index, state, False)
  if mode == "whole" and not isinstance(w, Factors):
    return _whole(q, k, v, w, window, causal, impl, fn)
  out = _piece(q, k, v, w, window, impl, 0 if offset is None else offset, state, final)
  if guard is None:
    return out
  y = jnp.where(guard, out[0] if final else out, jnp.nan).astype(jnp.result_type(q, k, v))
  return (y, out[1]) if final else y


def _whole(q, k, v, w, window, causal, impl, fn=FN):
  def xla(k, v, w, low):
    k2, v2 = common.rows(k), common.rows(v)
    plan = make_plan(k2.shape[0], k2.shape[1], window, causal, low=low)
    return common.unrows(banded_mean(plan, k2, v2, w), k.shape)

  kernels = KERNELS if fn == FN else FULL_KERNELS
  return common.run(fn, kernels, impl, xla, q, k, v, w, causal=causal, window=window)


def aft_local_init(shape, window: int) -> lse.WindowState:
  """The state before any token, for q_t, k_t, v_t of ``shape`` [..., D] and a window s."""
  return lse.window_init(shape, shape, window)


def aft_local_step(state: lse.WindowState, q_t, k_t, v_t, w_t):
  """One token: as ``aft_full_step`` with w[t, t'] for t - t' < s and 0 for older keys; q_t,
  k_t, v_t ``[..., D]``, w_t ``[L]`` (row t of the bias, L > t). Returns ``(Y[t], state)``."""
  w_t = jnp.asarray(w_t, jnp.float32)
  bias = lambda pos, _: w_t[jnp.clip(pos, 0, w_t.shape[-1] - 1)][:, None]
  return lse.window_step(state, q_t, k_t, v_t, bias)


def aft_full(
  q, k, v, w, *, causal=False, impl="auto", initial_state=None, output_final_state=False,
  segment_ids=None, positions=None,
):  # fmt: skip
  """AFT-full: Y[t] = sigma(q[t]) * sum_t' softmax_t'(k[t'] + w[t, t']) v[t'] (causal: t' <= t).

  Args:
    q, k, v: ``[..., T, D]``; w: ``[T, T]``, the pairwise bias.
    causal, impl: as ``aft_simple``.
    initial_state, output_final_state: refused (decode with ``aft_full_step``).
    segment_ids, positions: causal: as ``aft_local``; w ``[L, L]``, L > every position.

  Returns:
    ``[..., T, D]``; O(T^2 D) time, O(T^2 + T D) memory.
  """
  if initial_state is not None or output_final_state:
    raise ValueError(
      f"{FULL}: initial_state and output_final_state are for aft_simple, aft_local and "
      "aft_conv1d; AFT-full's past is every key and value (decode with aft_full_step)"
    )
  q, k, v = common.check_qkv(FULL, q, k, v)
  mode = common.check_mode(FULL, causal, impl, segment_ids=segment_ids, positions=positions)
  if mode == "packed":
    common.check_arrays(FULL, q.shape[:-1], segment_ids=segment_ids, positions=positions)
    common.check_arrays(FULL, w=w)
  else:
    check_bias(FULL, w, q.shape[-2])
  return common.eager(
    _run, q=q, k=k, v=v, w=w, segment_ids=segment_ids, positions=positions, mode=mode,
    window=q.shape[-2], causal=bool(causal), impl=impl, fn=FULL,
  )  # fmt: skip


def aft_full_init(shape, max_len: int) -> lse.WindowState:
  """The state before any token, for q_t, k_t, v_t of ``shape`` [..., D] and T <= max_len."""
  return aft_local_init(shape, max_len)


def aft_full_step(state: lse.WindowState, q_t, k_t, v_t, w_t):
  """One token t = ``state.index``: q_t, k_t, v_t ``[..., D]``, w_t ``[L]``; ``(Y[t], state)``."""
  return aft_local_step(state, q_t, k_t, v_t, w_t)


def check_bias(fn, w, t_len: int, offset=None):  # [T, T] (offset None) or [L, L], L >= offset + T
  if not isinstance(w, Factors):
    common.check_arrays(fn, w=w)
  shape, least = tuple(w.shape), t_len + (offset if isinstance(offset, int) else 0)
  if offset is None and shape != (t_len, t_len):
    raise ValueError(
      f"{fn}: w must be [T, T] = {(t_len, t_len)} for T = {t_len}; got w {shape} "
      "(slice the top-left block of a larger bias first)"
    )
  if len(shape) != 2 or shape[0] != shape[1] or shape[0] < least:
    raise ValueError(
      f"{fn}: w must be [L, L] with L >= offset + T = {least} (offset {offset}, T {t_len}); "
      f"got w {shape}"
    )


def _offset(offset, state, w, t_len: int):
  """(offset, an int where static; None or the traced bool that it fits w and the state)."""
  index = None if state is None else state.index
  given = offset is not None
  offset = offset if given else (0 if index is None else index)
  if not (jnp.issubdtype(jnp.result_type(offset), jnp.integer) and jnp.ndim(offset) == 0):
    raise ValueError(f"{FN}: offset must be an int >= 0 (or an int scalar), got {offset!r}")
  static = lambda x: None if x is None or isinstance(x, jax.core.Tracer) else int(x)
  at, known = static(offset), static(index)
  if at is not None and at < 0:
    raise ValueError(f"{FN}: offset must be >= 0; got offset {at}")
  if given and at is not None and known is not None and at != known:
    raise ValueError(
      f"{FN}: offset {at} does not match initial_state.index {known}: the state holds the "
      f"{known} positions before the piece (leave offset out to take it from the state)"
    )
  check_bias(FN, w, t_len, offset if at is None else at)
  guard = None if at is not None else (offset >= 0) & (offset + t_len <= w.shape[0])
  if given and index is not None and (at is None or known is None):
    same = jnp.asarray(offset) == index
    guard = same if guard is None else guard & same
  return (offset if at is None else at), guard


def _in_sub_pieces(t_len: int, window: int) -> bool:
  return t_len > 2 * max(SUB_PIECE, 4 * window)


def _dense(w: Factors, pos=None):  # u v^T (float32), or its rows and columns ``pos``
  u, v = (jnp.asarray(x, jnp.float32) for x in w)
  return u @ v.T if pos is None else u[pos] @ v[pos].T


def _piece(q, k, v, w, window, impl, offset, state, final):  # at w's rows offset.. after ``state``
  t_len, one = q.shape[-2], q.shape[:-2] + q.shape[-1:]
  init = lambda: lse.window_init(one, one, window, offset)
  if t_len == 0:
    return lse.nothing(q, k, v, state, final, init)
  n = 0 if state is None else 1 + window  # prepended positions
  w = w if isinstance(w, Factors) else jnp.asarray(w, jnp.float32)
  whole = isinstance(offset, int) and offset == 0 and n == 0 and w.shape[0] == t_len
  if (not whole or isinstance(w, Factors)) and _in_sub_pieces(t_len, window):
    return _sub_pieces(q, k, v, w, window, impl, offset, state or init(), final)
  piece_w = w if whole and not isinstance(w, Factors) else _block_of(w, offset, n, t_len)
  y = lse.after_state(lambda *qkv: _whole(*qkv, piece_w, window, True, impl), q, k, v, state)
  return (y, lse.final(state or init(), k, v, window)) if final else y


def _sub_pieces(q, k, v, w, window, impl, offset, state, final):
  t_len, axis, c = q.shape[-2], q.ndim - 2, max(SUB_PIECE, 4 * window)
  m, lead = t_len // c, q.shape[:axis]
  split = lambda x: jnp.moveaxis(
    jax.lax.slice_in_dim(x, 0, m * c, axis=axis).reshape(lead + (m, c) + x.shape[-1:]), axis, 0
  )

  def step(carry, qkv):
    y, state = _piece(*qkv, w, window, impl, carry[1], carry[0], True)
    return (state, carry[1] + c), y

  start = (state, jnp.asarray(offset, jnp.int32))
  (state, at), ys = jax.lax.scan(step, start, tuple(split(x) for x in (q, k, v)))
  ys = jnp.moveaxis(ys, 0, axis).reshape(lead + (m * c,) + q.shape[-1:])
  if m * c < t_len:
    rest = lambda x: jax.lax.slice_in_dim(x, m * c, t_len, axis=axis)
    y, state = _piece(rest(q), rest(k), rest(v), w, window, impl, at, state, True)
    ys = jnp.concatenate([ys, y], axis)
  return (ys, state) if final else ys


def _block_of(w, offset, n: int, t_len: int):  # offset - n .. offset + T - 1 (before 0: 0), no copy
  size = n + t_len
  if isinstance(w, Factors):  # that block of u v^T alone
    return _dense(w, jnp.clip(offset - n + jnp.arange(size), 0, w.shape[0] - 1))
  early = jax.lax.dynamic_slice(
    jnp.pad(w[:size, :size], ((n, 0), (n, 0))), (offset,) * 2, (size,) * 2
  )
  if size > w.shape[0]:  # then offset + T <= L means offset < n
    return early
  late = jax.lax.dynamic_slice(w, (offset - n, offset - n), (size, size))
  if isinstance(offset, int):
    return late if offset >= n else early
  return jnp.where(offset >= n, late, early)


def band_bias(w, positions, t_len: int):  # j -> w[pos[t], pos[t - j]] [..., T, 1]; NaN outside w
  w = jnp.asarray(w, jnp.float32)
  pos = jnp.arange(t_len) if positions is None else jnp.asarray(positions)

  def bias(j):
    key = lse.shift(pos, j, pos.ndim - 1, 0)
    got = w.at[pos, key].get(mode="fill", fill_value=jnp.nan)
    # A negative index would count from the end of w (NumPy's rule), not fall outside it.
    return jnp.where((pos >= 0) & (key >= 0), got, jnp.nan)[..., None]

  return bias


_GROUP_ELEMENTS = 1 << 20  # of the [rows, W, R] logits of one exact row group
# exp(row max + channel max - L) < 1e25 on the fast path; capped where its product is discarded.
_MAX_LOG_SCALE = 80.0


class BandPlan(NamedTuple):
  t_len: int
  s: int
  causal: bool
  c: int  # rows per block
  nb: int  # blocks
  width: int  # keys per block
  rows: int  # rows per exact group
  low: bool = False

  def tame(self, x):  # a tangent's factor (non-causal: a NaN is NaN everywhere anyway)
    return lse.tame(x) if self.causal else x


def _default_block(s: int, t_len: int) -> int:  # CPU-timed: scan steps vs masked corners
  return 256 if s >= t_len else min(128, max(64, 1 << round(math.log2(s))))


def make_plan(t_len: int, r, window: int, causal: bool, block=None, low=False) -> BandPlan:
  s = min(window, t_len)
  c = min(t_len, block or _default_block(s, t_len))
  width = min(t_len, c + s - 1 if causal else c + 2 * s - 2)
  rows = 1
  while isinstance(r, int) and c % (2 * rows) == 0 and 2 * rows * width * r <= _GROUP_ELEMENTS:
    rows *= 2
  return BandPlan(t_len, s, causal, c, -(-t_len // c), width, rows, low)


def _layout(p: BandPlan):  # per block: rs, ks, the prefix and suffix sums' key ranges [lo, hi)
  i32 = lambda x: np.asarray(x, np.int32)
  rs = np.minimum(np.arange(p.nb) * p.c, p.t_len - p.c)
  ks = np.clip(rs - (p.s - 1), 0, p.t_len - p.width)
  ke = ks + p.width
  return i32(rs), i32(ks), (i32([0, *ks[:-1]]), i32(ks)), (i32(ke), i32([*ke[1:], p.t_len]))


def _slice(x, start, size):
  return jax.lax.dynamic_slice_in_dim(x, start, size, 0)


def _range_keys(k, lo, hi, c):  # (start, mask [c, 1]) of the c keys from min(lo, T - c)
  st = jnp.clip(lo, 0, k.shape[0] - c)
  idx = st + jnp.arange(c)
  return st, ((idx >= lo) & (idx < hi))[:, None]


def _edge_sums(p: BandPlan, k, v, ranges, reverse: bool) -> Acc:  # running sums (bias 0) [nb, R]

  def step(acc, lohi):
    st, keep = _range_keys(k, *lohi, p.c)
    kk = jnp.where(keep, _slice(k, st, p.c), NEG)
    m = jnp.maximum(acc.m, jnp.max(kk, axis=0))
    e, scale = jnp.where(keep, jnp.exp(kk - m), 0.0), jnp.exp(acc.m - m)
    num = acc.num * scale + jnp.sum(e * jnp.where(keep, _slice(v, st, p.c), 0.0), axis=0)
    acc = Acc(m, num, acc.den * scale + jnp.sum(e, axis=0))
    return acc, acc

  if np.all(ranges[0] >= ranges[1]):  # one block, say: nothing to add
    none = jnp.zeros_like(k[:1], shape=(p.nb, *k.shape[1:]))
    return Acc(none + NEG, none, none)
  zero = jnp.zeros_like(k[0])  # k's type: in shard_map, varying where k does
  return jax.lax.scan(step, Acc(zero + NEG, zero, zero), ranges, reverse=reverse)[1]


def _edge_tangent(p: BandPlan, k, v, m, ranges, reverse: bool, dk, dv):
  """``_edge_sums``' tangent: G = sum exp(k - m) (dv + dk v), H = sum exp(k - m) dk."""
  empty = jnp.full_like(m[:1], NEG)
  m_prev = jnp.concatenate([m[1:], empty] if reverse else [empty, m[:-1]])

  def step(gh, xs):
    lo, hi, mb, mp = xs
    st, keep = _range_keys(k, lo, hi, p.c)
    e = p.tame(jnp.exp(jnp.where(keep, _slice(k, st, p.c) - mb, NEG)))
    dkk, scale = _slice(dk, st, p.c), p.tame(jnp.exp(mp - mb))  # <= 1: the max only grows
    vv = jnp.where(keep, _slice(v, st, p.c), 0.0)  # masked before the product
    g = gh[0] * scale + jnp.sum(e * (_slice(dv, st, p.c) + dkk * vv), axis=0)
    h = gh[1] * scale + jnp.sum(e * dkk, axis=0)
    return (g, h), (g, h)

  if np.all(ranges[0] >= ranges[1]):
    return jnp.zeros_like(m), jnp.zeros_like(m)
  zero = jnp.zeros_like(k[0])
  return jax.lax.scan(jax.checkpoint(step), (zero, zero), (*ranges, m, m_prev), reverse=reverse)[1]


def _patch(p: BandPlan, bad, fast, exact):  # the groups flagged ``bad`` replaced by ``exact(g)``
  groups = p.c // p.rows
  one = lambda args: lse.cond(args[1], lambda: exact(args[0]), lambda: args[2])

  def run():
    split = tuple(x.reshape((groups, p.rows) + x.shape[1:]) for x in fast)
    out = jax.lax.map(jax.checkpoint(one), (jnp.arange(groups), bad, split))
    return tuple(x.reshape((p.c,) + x.shape[2:]) for x in out)

  return lse.cond(jnp.any(bad), run, lambda: fast)


def _block(p: BandPlan, k, v, w, rs, ks):  # bias, band, keys, values, shift factors, maxima, seen
  d = (ks + jnp.arange(p.width))[None, :] - (rs + jnp.arange(p.c))[:, None]  # t' - t
  band = (jnp.abs(d) < p.s) & ((d <= 0) if p.causal else True)
  w_blk = jax.lax.dynamic_slice(w, (rs, ks), (p.c, p.width))
  bias = jnp.where(band, w_blk, jnp.where(d < 0, 0.0, NEG) if p.causal else 0.0)
  kw, vw = _slice(k, ks, p.width), _slice(v, ks, p.width)
  # The largest bias a row sees (causal: not a later key's NEG; a row with no term, -inf: NaN).
  mw = jnp.max(jnp.where(d > 0, -jnp.inf, bias) if p.causal else bias, axis=1)
  pt = jnp.exp(bias - mw[:, None])
  if not p.causal:
    mk = jnp.max(kw, axis=0)
    return bias, band, kw, vw, pt, jnp.exp(kw - mk), vw, mw, mk, None
  first = (ks + jnp.arange(p.width) <= rs)[:, None]  # the keys the block's first row sees
  mk = jnp.max(jnp.where(first, kw, NEG), axis=0)
  ok, e, vs = set_aside(jnp.exp(kw - mk), vw)
  # Row i has seen the keys up to rs + i: those before rs reduced once, a running max after.
  x, at = jnp.where(ok, e, jnp.inf), jnp.clip(rs - ks, 0, p.width - p.c)
  before = jnp.max(jnp.where((jnp.arange(p.width) < at)[:, None], x, -jnp.inf), axis=0)
  seen = jnp.maximum(before, jax.lax.cummax(_slice(x, at, p.c), axis=0))
  return bias, band, kw, vw, pt, e, vs, mw, mk, seen


def _forward(p: BandPlan, k, v, w):  # a, L [T, R], recomputed groups [nb, groups], edges' maxima
  r = k.shape[1]
  rs, ks, pre_r, suf_r = _layout(p)
  pre = _edge_sums(p, k, v, pre_r, False)
  suf = None if p.causal else _edge_sums(p, k, v, suf_r, True)

  def block(p, xs):
    b_rs, b_ks, pre_b, suf_b = xs
    bias, _, kw, vw, pt, e, vs, mw, mk, seen = _block(p, k, v, w, b_rs, b_ks)
    nd = matmul("cw,wx->cx", pt, jnp.concatenate([e * vs, e], axis=1), p.low)
    fast = (mw[:, None] + mk, nd[:, :r], nd[:, r:])
    # exp(b - mw) underflowed unless den > DEN_OK * the row's largest exp(k - mk) (inf: aside).
    redo = ~(fast[2] >= DEN_OK * (1.0 if seen is None else jnp.maximum(seen, 1.0)))
    bad = jnp.any(redo.reshape(p.c // p.rows, p.rows, r), axis=(1, 2))
    sees = (jnp.arange(p.width)[None, :] + b_ks <= jnp.arange(p.c)[:, None] + b_rs)[..., None]

    def exact(g):  # the flagged (row, channel)s of group g; the others keep the fast values
      rows = lambda x: _slice(x, g * p.rows, p.rows)
      logits, vg = rows(bias)[:, :, None] + kw[None], vw[None]
      if p.causal:  # the keys after each row masked before exp and the products
        logits, vg = jnp.where(rows(sees), logits, NEG), jnp.where(rows(sees), vg, 0.0)
      m = jnp.max(logits, axis=1)
      pe = jnp.exp(logits - m[:, None])
      pe = jnp.where(rows(sees), pe, 0.0) if p.causal else pe
      out = (m, jnp.sum(pe * vg, axis=1), jnp.sum(pe, axis=1))
      return tuple(jnp.where(rows(redo), x, rows(f)) for x, f in zip(out, fast))

    acc = combine(Acc(*_patch(p, bad, fast, exact)), Acc(*(x[None] for x in pre_b)))
    if suf_b is not None:
      acc = combine(acc, Acc(*(x[None] for x in suf_b)))
    return acc.num / acc.den, acc.m + jnp.log(acc.den), bad

  a, lse_, bad = _over_blocks(p, block, (rs, ks, pre, suf))
  return _unblock(p, a), _unblock(p, lse_), bad, pre.m, None if suf is None else suf.m


def _over_blocks(p: BandPlan, body, xs, remat=False):
  """``body(plan, xs[b])`` for each block b, stacked: a scan over the blocks. Where a causal
  plan's blocks read all T keys (AFT-full), ``KEY_GROUPS`` scans over consecutive blocks, each
  over the keys up to its last block's last row: 3/4 of the products where nb is even, each
  group's body compiled once (more groups: fewer products, a slower compile; measured in
  benchmarks/results/peer_length/profile.md)."""
  once = jax.checkpoint if remat else lambda f: f
  groups = [(0, p.nb, p)]
  if p.causal and p.width == p.t_len and p.nb > 1:
    cut = np.round(np.linspace(0, p.nb, min(p.nb, KEY_GROUPS) + 1)).astype(int).tolist()
    # Every ks is 0; block b - 1 ends at row min(b c, T) (the last moved back to end at T).
    groups = [(a, b, p._replace(width=min(b * p.c, p.t_len))) for a, b in zip(cut[:-1], cut[1:])]
  outs = []
  for a, b, plan in groups:
    fn = once(functools.partial(body, plan))
    part = jax.tree.map(lambda x, a=a, b=b: x[a:b], xs)
    outs.append(jax.lax.scan(lambda _, x, fn=fn: (None, fn(x)), None, part)[1])
  return outs[0] if len(outs) == 1 else jax.tree.map(lambda *x: jnp.concatenate(x), *outs)


def _unblock(p: BandPlan, x):  # [nb, c, ...] -> [T, ...] (the last block overlaps)
  if p.nb * p.c == p.t_len:
    return x.reshape((p.t_len,) + x.shape[2:])
  head = x[:-1].reshape(((p.nb - 1) * p.c,) + x.shape[2:])
  return jnp.concatenate([head, x[-1, p.nb * p.c - p.t_len :]], axis=0)


def _tangent(p: BandPlan, k, v, w, res, dk, dv, dw):  # da [T, R], linear in (dk, dv, dw)
  r, (a, lse_, bad, pre_m, suf_m) = k.shape[1], res
  rs, ks, pre_r, suf_r = _layout(p)
  pre = (pre_m, *_edge_tangent(p, k, v, pre_m, pre_r, False, dk, dv))
  suf = None if p.causal else (suf_m, *_edge_tangent(p, k, v, suf_m, suf_r, True, dk, dv))

  def block(patched: bool, p, xs):
    b_rs, b_ks, bad_b, pre_b, suf_b = xs
    bias, band, kw, vw, pt, e, vs, mw, mk, _ = _block(p, k, v, w, b_rs, b_ks)
    dwb = jnp.where(band, jax.lax.dynamic_slice(dw, (b_rs, b_ks), (p.c, p.width)), 0.0)
    dkw, dvw = _slice(dk, b_ks, p.width), _slice(dv, b_ks, p.width)
    a_raw, l_r = _slice(a, b_rs, p.c), _slice(lse_, b_rs, p.c)
    a_r, pt = p.tame(a_raw), p.tame(pt)
    scale = p.tame(jnp.exp(jnp.minimum(mw[:, None] + mk - l_r, _MAX_LOG_SCALE)))
    nd = matmul("cw,wx->cx", pt, jnp.concatenate([e * (dvw + dkw * vs), e * dkw], axis=1), p.low)
    nd = nd + matmul("cw,wx->cx", pt * dwb, jnp.concatenate([e * vs, e], axis=1), p.low)
    da = scale * (nd[:, :r] - a_r * nd[:, r:])

    def exact(g):
      rows = lambda x: _slice(x, g * p.rows, p.rows)
      pe = p.tame(jnp.exp(rows(bias)[:, :, None] + kw[None] - rows(l_r)[:, None]))  # <= 1
      vd = p.tame(vw[None] - rows(a_r)[:, None])
      return (jnp.sum(pe * (dvw[None] + (dkw[None] + rows(dwb)[:, :, None]) * vd), axis=1),)

    if patched:
      (da,) = _patch(p, bad_b, (da,), exact)
    for edge in (pre_b, suf_b):
      if edge is not None:
        m, g, h = edge
        da = da + p.tame(jnp.exp(m - l_r)) * (g - a_r * h)  # exp(m - L) <= 1
    return jnp.where(lse.keep(a_raw, l_r), da, 0.0) if p.causal else da

  def run(patched: bool):
    return _over_blocks(p, functools.partial(block, patched), (rs, ks, bad, pre, suf), True)

  # Two scans, not a cond per block (its transpose fills and adds zero cotangents per block).
  return _unblock(p, lse.cond(jnp.any(bad), lambda: run(True), lambda: run(False)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def banded_mean(p: BandPlan, k, v, w):  # a [T, R] for k, v [T, R], w [T, T] (module docstring)
  return _forward(p, k, v, w)[0]


@banded_mean.defjvp
def _banded_mean_jvp(p, primals, tangents):
  k, v, w = primals
  res = _forward(p, k, v, w)
  return res[0], jax.checkpoint(functools.partial(_tangent, p))(k, v, w, res, *tangents)
