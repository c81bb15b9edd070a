"""Causal AFT-local's banded mean as Pallas Triton kernels for k, v ``[B, T, D]``, w ``[T, T]``,
forward and custom VJP with dw (docs/kernels.md, "How each module computes")."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from aft_jax.ops.logsumexp import DEN_OK, NEG, set_aside, tame, tame_bias
from aft_jax.ops.pallas import triton
from aft_jax.ops.pallas.triton import CONFIGS, LaunchPlan, TritonConfig, all_true, colsum, dot, load
from aft_jax.ops.pallas.triton import rows

# A chunk's slab grows with the window (O(T (s + c) D)); beyond this, AFT-full's job.
MAX_WINDOW = 1024
# Backward: row by row where exp(row max + channel max - L) exceeds the forward's 1 / DEN_OK.
_MAX_LOG_SCALE = 57.0


def unsupported(d: int, window: int) -> str | None:
  if window > MAX_WINDOW:
    return f"the window {window} is larger than the kernel's {MAX_WINDOW}"
  return triton.unsupported_channels(d)


def _slab_width(s: int, bt: int) -> int:  # bt + s - 1 keys, rounded up to blocks of bt
  return bt * (-(-(s - 1) // bt) + 1)


def _slab_bias(w, s: int, t_pad: int, bt: int):
  """[t_pad, W]: (t, u) the bias of key (t // bt) bt - (W - bt) + u (older: 0, later: NEG)."""
  t_len = w.shape[0]
  width = _slab_width(s, bt)
  t = jnp.arange(t_pad)[:, None]
  tk = (t // bt) * bt - (width - bt) + jnp.arange(width)[None, :]
  band = w[jnp.minimum(t, t_len - 1), jnp.clip(tk, 0, t_len - 1)].astype(jnp.float32)
  bias = jnp.where(t - tk < s, band, 0.0)
  return jnp.where((tk <= t) & (tk >= 0), bias, NEG)


def _bias_column(bias_ref, r, u, bt: int, eye):  # row r's biases against block u, [bt, 1]
  return jnp.sum(jnp.where(eye > 0.5, bias_ref[r, rows(u, bt)], 0.0), axis=1, keepdims=True)


def _slab(bias_ref, k_ref, v_ref, bt: int, batch=None):
  """Chunk j's ``keys(j, u)`` (block u's bias, k, v), ``maxima(j)``, ``shifted``; row ``batch``."""
  n_keys = bias_ref.shape[1] // bt
  at = lambda idx: (idx, slice(None)) if batch is None else (batch, idx, slice(None))

  def keys(j, u):
    idx = at(rows(j + u, bt))
    kv = (k_ref[idx].astype(jnp.float32), v_ref[idx].astype(jnp.float32))
    return (bias_ref[rows(j, bt), rows(u, bt)], *kv)

  def maxima(j, first: bool = False):  # first: over the keys the chunk's first row sees

    def step(u, mm):
      b, kb, _ = keys(j, u)
      if first:  # the last key block holds the chunk's own keys: only its first is seen
        later = (u == n_keys - 1) & (jax.lax.broadcasted_iota(jnp.int32, kb.shape, 0) > 0)
        kb = jnp.where(later, NEG, kb)
      return (
        jnp.maximum(mm[0], jnp.max(b, axis=1, keepdims=True)),
        jnp.maximum(mm[1], jnp.max(kb, axis=0, keepdims=True)),
      )

    init = (jnp.full((bt, 1), NEG, jnp.float32), jnp.full((1, k_ref.shape[-1]), NEG, jnp.float32))
    return jax.lax.fori_loop(0, n_keys, step, init)

  def shifted(j, u, mw, mk):  # key block u under the split shift: exp(b - mw), exp(k - mk), v
    b, kb, vb = keys(j, u)
    return jnp.exp(b - mw), jnp.exp(kb - mk), vb

  return n_keys, keys, maxima, shifted


def _scaled_cotangent(mw, mk, lse, g, a, real):  # (exact?, g exp(mw + mk - L), that times a)
  log_scale = mw + mk - lse
  gs = g * jnp.exp(log_scale)
  return all_true((log_scale <= _MAX_LOG_SCALE) | ~real), gs, gs * a


def _real(j, bt: int, t_len: int):  # [bt, 1]: which rows of chunk j are positions < T (not padding)
  return j * bt + jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0) < t_len


def _segment(bias_ref, refs, bt: int, n_seg: int | None, seg: int, take):
  """(first chunk, chunks, carry-in, other refs) of all of T or of segment s (folding refs[:3])."""
  if n_seg is None:
    return 0, bias_ref.shape[0] // bt, None, refs
  s = pl.program_id(2)
  return s * (seg // bt), seg // bt, triton.fold(*refs[:3], lambda i: take(i, s)), refs[3:]


def _fwd_kernel(bias_ref, k_ref, v_ref, *refs, bt: int, t_len: int, n_seg, seg: int):
  """One (batch row, channel block[, segment]): a [and L]; k, v front-padded by W - bt keys."""
  j0, n_chunks, carry_in, (a_ref, *lse_ref) = _segment(
    bias_ref, refs, bt, n_seg, seg, lambda i, s: i < s
  )
  n_keys, keys, maxima, shifted = _slab(bias_ref, k_ref, v_ref, bt)
  bd = k_ref.shape[1]
  eye = triton.ones(bt, jnp.equal)

  def chunk(j, carry):
    m0, num0, den0 = carry  # [1, bd]: the keys before the slab (bias 0 for every row)
    mw, mk = maxima(j, first=True)

    def sums(u, nd):
      b, kb, vb = keys(j, u)
      ok, e, vb = set_aside(jnp.exp(kb - mk), vb)
      p = jnp.where(b <= NEG, 0.0, jnp.exp(b - mw))  # a later key: 0 (a row of no term: mw NEG)
      # Per row, over the keys it sees: how many set aside, and the sum of exp(k - mk).
      sees = jnp.where(b <= NEG, 0.0, 1.0)  # NEG: a later key; a NaN bias is a term
      aside = dot(sees, jnp.where(ok, 0.0, 1.0))
      return nd[0] + dot(p, e * vb), nd[1] + dot(p, e), nd[2] + aside, nd[3] + dot(sees, e)

    zero = jnp.zeros((bt, bd), jnp.float32)
    num, den, aside, esum = jax.lax.fori_loop(0, n_keys, sums, (zero,) * 4)
    # Redone (stored NaN, which a fast value never is): a set-aside key seen, or a lost term.
    lost = ~(den >= DEN_OK * jnp.maximum(esum, 1.0))
    real, idx = _real(j, bt, t_len), rows(j - j0, bt)
    redo = ((aside > 0.5) | lost) & real
    m = jnp.maximum(mw + mk, m0)
    s1, s0 = jnp.exp(mw + mk - m), jnp.exp(m0 - m)
    num, den = num * s1 + num0 * s0, den * s1 + den0 * s0
    # Padding rows store 0: their shift may lose every term, and a NaN would reach 0 * NaN.
    a_ref[idx, :] = jnp.where(real, jnp.where(redo, jnp.nan, num) / den, 0.0)
    if lse_ref:
      lse_ref[0][idx, :] = jnp.where(real, m + jnp.log(den), 0.0)

    def exact():  # row by row, the maximum per (row, channel) carried over the key blocks
      def row(i, _):
        r, r_out = pl.ds(j * bt + i, 1), pl.ds((j - j0) * bt + i, 1)

        def block(u, c):
          m1, num1, den1 = c
          _, kb, vb = keys(j, u)
          bias = _bias_column(bias_ref, r, u, bt, eye)
          sees = ~(bias <= NEG)  # later keys masked before exp and the products (NaN seen)
          logits = jnp.where(sees, bias + kb, NEG)
          m2 = jnp.maximum(m1, jnp.max(logits, axis=0, keepdims=True))
          e, s1 = jnp.where(sees, jnp.exp(logits - m2), 0.0), jnp.exp(m1 - m2)
          num2 = num1 * s1 + colsum(e * jnp.where(sees, vb, 0.0))
          return m2, num2, den1 * s1 + colsum(e)

        m1, num1, den1 = jax.lax.fori_loop(0, n_keys, block, carry)
        a_fast = a_ref[r_out, :]
        again = a_fast != a_fast  # the other rows keep the fast values, bit for bit
        a_ref[r_out, :] = jnp.where(again, num1 / den1, a_fast)
        if lse_ref:
          lse_ref[0][r_out, :] = jnp.where(again, m1 + jnp.log(den1), lse_ref[0][r_out, :])
        return 0

      jax.lax.fori_loop(0, bt, row, 0)

    jax.lax.cond(all_true(~redo), lambda: None, exact)

    # The slab's first key block is older than every row of the next chunk's band (bias 0).
    kb, vb = load(k_ref, rows(j, bt)), load(v_ref, rows(j, bt))
    seen = ~_real(j, bt, n_keys * bt - bt)  # not the front padding
    m = jnp.maximum(m0, jnp.max(kb, axis=0, keepdims=True))
    e, s0 = jnp.where(seen, jnp.exp(kb - m), 0.0), jnp.exp(m0 - m)
    return (m, num0 * s0 + colsum(e * vb), den0 * s0 + colsum(e))

  jax.lax.fori_loop(0, n_chunks, lambda i, c: chunk(j0 + i, c), carry_in or triton.empty(bd))


def _bwd_kernel(bias_ref, k_ref, v_ref, a_ref, lse_ref, g_ref, *refs, bt, t_len, n_seg, seg):
  """dk, dv in the keys' padded layout (a segment's keys and the next one's first W - bt)."""
  j0, n_chunks, carry_in, (dk_ref, dv_ref) = _segment(
    bias_ref, refs, bt, n_seg, seg, lambda i, s: (i > s) & (i < n_seg)
  )
  n_keys, keys, maxima, shifted = _slab(bias_ref, k_ref, v_ref, bt)
  bd = k_ref.shape[1]
  eye = triton.ones(bt, jnp.equal)

  def clear(i, _):
    dk_ref[rows(i, bt), :] = jnp.zeros((bt, bd), jnp.float32)
    dv_ref[rows(i, bt), :] = jnp.zeros((bt, bd), jnp.float32)
    return 0

  jax.lax.fori_loop(0, dk_ref.shape[0] // bt, clear, 0)

  def add(idx, dk, dv):
    dk_ref[idx, :] = dk_ref[idx, :] + dk
    dv_ref[idx, :] = dv_ref[idx, :] + dv

  def lse_rows(idx, real):
    return jnp.where(real, load(lse_ref, idx), -NEG)  # padding: weight exp(-L) = 0

  def chunk(i, carry):
    j = j0 + n_chunks - 1 - i
    out = rows(j, bt)
    mine = lambda u: rows(j - j0 + u, bt)  # key block j + u in this program's dk, dv
    real = _real(j, bt, t_len)
    lse, g, a = lse_rows(out, real), load(g_ref, out), load(a_ref, out)
    mw, mk = maxima(j)
    ok, gs, ga = _scaled_cotangent(mw, mk, lse, g, a, real)

    def fast():  # p = exp(b - mw) exp(k - mk) exp(mw + mk - L), the last factor < 1 / DEN_OK
      def block(u, _):
        p, e, vb = shifted(j, u, mw, mk)
        c1, c2 = dot(p, gs, trans_x=True), dot(p, ga, trans_x=True)  # [bt keys, bd]
        add(mine(u), e * (vb * c1 - c2), e * c1)
        return 0

      jax.lax.fori_loop(0, n_keys, block, 0)

    def exact():  # row by row: p = exp(b + k - L) <= 1 directly
      def row(i2, _):
        r = pl.ds(j * bt + i2, 1)
        lr = lse_rows(r, j * bt + i2 < t_len)
        gr, ar = load(g_ref, r), load(a_ref, r)

        def block(u, _):
          _, kb, vb = keys(j, u)
          pg = jnp.exp(_bias_column(bias_ref, r, u, bt, eye) + kb - lr) * gr
          add(mine(u), pg * (vb - ar), pg)
          return 0

        return jax.lax.fori_loop(0, n_keys, block, 0)

      jax.lax.fori_loop(0, bt, row, 0)

    jax.lax.cond(ok, fast, exact)

    # Block 0's keys are bias-0 terms of every later L: exp(k + m) <= 1 for m = max(-L).
    m, c1, c2 = carry
    kb, vb = load(k_ref, out), load(v_ref, out)
    e = jnp.exp(kb + m)
    add(mine(0), e * (vb * c1 - c2), e * c1)
    m2 = jnp.maximum(m, jnp.max(-lse, axis=0, keepdims=True))
    s, e = jnp.exp(m - m2), jnp.exp(-lse - m2)
    return (m2, c1 * s + colsum(e * g), c2 * s + colsum(e * g * a))

  jax.lax.fori_loop(0, n_chunks, chunk, carry_in or triton.empty(bd))


def _dw_kernel(bias_ref, k_ref, v_ref, a_ref, lse_ref, g_ref, dw_ref, *, bt: int, t_len: int):
  """Query chunk j's slab-bias gradient [bt, W]: sum p g (v - a) over batch rows, channels."""
  j = pl.program_id(0)
  n_keys = bias_ref.shape[1] // bt
  out, real = rows(j, bt), _real(j, bt, t_len)
  eye = triton.ones(bt, jnp.equal)

  def add(idx, x):
    dw_ref[idx] = dw_ref[idx] + x

  def clear(u, _):
    dw_ref[:, rows(u, bt)] = jnp.zeros((bt, bt), jnp.float32)
    return 0

  jax.lax.fori_loop(0, n_keys, clear, 0)

  def batch_row(r, _):
    _, keys, maxima, shifted = _slab(bias_ref, k_ref, v_ref, bt, batch=r)
    mw, mk = maxima(j)
    lse = jnp.where(real, lse_ref[r, out, :], -NEG)  # padding: weight exp(-L) = 0
    ok, gs, ga = _scaled_cotangent(mw, mk, lse, g_ref[r, out, :], a_ref[r, out, :], real)

    def fast():  # as the backward kernel's
      def block(u, _):
        p, e, vb = shifted(j, u, mw, mk)
        add(
          (slice(None), rows(u, bt)), p * (dot(gs, e * vb, trans_y=True) - dot(ga, e, trans_y=True))
        )
        return 0

      jax.lax.fori_loop(0, n_keys, block, 0)

    def exact():  # row by row: p = exp(b + k - L) <= 1 directly
      def row(i, _):
        rr = pl.ds(j * bt + i, 1)
        lr = jnp.where(j * bt + i < t_len, lse_ref[r, rr, :], -NEG)
        gr, ar = g_ref[r, rr, :], a_ref[r, rr, :]

        def block(u, _):
          _, kb, vb = keys(j, u)
          t = jnp.exp(_bias_column(bias_ref, rr, u, bt, eye) + kb - lr) * gr * (vb - ar)
          dw_col = jnp.sum(t, axis=1, keepdims=True)
          add((pl.ds(i, 1), rows(u, bt)), colsum(eye * dw_col))
          return 0

        return jax.lax.fori_loop(0, n_keys, block, 0)

      jax.lax.fori_loop(0, bt, row, 0)

    jax.lax.cond(ok, fast, exact)
    return 0

  jax.lax.fori_loop(0, k_ref.shape[0], batch_row, 0)


def _layout(k, window: int, plan: LaunchPlan):  # (s, t_pad, slab width W, keys' front padding)
  t_len, bt = k.shape[1], plan.cfg.block_t
  s = min(window, t_len)
  width = _slab_width(s, bt)
  return s, t_len + (-t_len % (plan.seg or bt)), width, width - bt


def plan_for(batch: int, t_len: int, d: int, window: int) -> LaunchPlan:
  bt = CONFIGS[0].block_t
  return triton.plan_for(batch, t_len, d, min_seg=_slab_width(min(window, t_len), bt) - bt)


def _call(kernel, plan: LaunchPlan, interpret: bool, t_len, ins, outs, tots=(), keys_out=False):
  """ins: the biases, then columns; outputs [B, t_pad, D] or (``keys_out``) the keys' layout."""
  (t_pad, width), (b, _, d) = ins[0].shape, ins[1].shape
  cfg, seg = plan.cfg, plan.seg or t_pad
  bd, n_seg, front = cfg.block_d, t_pad // seg, width - cfg.block_t
  col = lambda n: pl.BlockSpec((None, n, bd), lambda i, j, *s: (i, 0, j))
  if not keys_out:
    spec = pl.BlockSpec((None, seg, bd), lambda i, j, *s: (i, s[0] if s else 0, j))
    shape = (b, t_pad, d)
  elif plan.seg:
    spec = pl.BlockSpec((None, None, seg + front, bd), lambda i, j, s: (i, s, 0, j))
    shape = (b, n_seg, seg + front, d)
  else:
    spec, shape = col(front + t_pad), (b, front + t_pad, d)
  kernel = functools.partial(
    kernel, bt=cfg.block_t, t_len=t_len, n_seg=n_seg if plan.seg else None, seg=seg
  )
  in_specs = [pl.BlockSpec(ins[0].shape, lambda i, j, *s: (0, 0))]
  in_specs += [col(x.shape[1]) for x in (*ins[1:], *tots)]
  out_shape = [jax.ShapeDtypeStruct(shape, dt) for dt in outs]
  grid = triton.grid(b, d, plan, n_seg)
  return triton.call(
    kernel, cfg, interpret, grid, in_specs, [spec] * len(outs), out_shape, (*ins, *tots)
  )


def _overlap_add(x, front: int):  # [B, n_seg, seg + front, D] -> keys' layout (halos added)
  b, n_seg, n, d = x.shape
  seg = n - front
  main = x[:, :, :seg].reshape(b, n_seg * seg, d)
  halo = jnp.pad(x[:, :, seg:], ((0, 0), (0, 0), (0, seg - front), (0, 0)))
  halo = jnp.pad(halo.reshape(b, n_seg * seg, d), ((0, 0), (seg, 0), (0, 0)))
  return jnp.pad(main, ((0, 0), (0, front), (0, 0))) + halo[:, : n_seg * seg + front]


def dw_config(d: int) -> TritonConfig:
  return triton.widest_config(CONFIGS, d, 1, 0, f"Pallas kernel: {unsupported(d, 1)}")


def _dw_partials(ins, cfg: TritonConfig, interpret: bool, t_len: int):  # [D / bd, t_pad, W]
  (t_pad, width), (b, _, d) = ins[0].shape, ins[1].shape
  bt, bd = cfg.block_t, cfg.block_d
  col = lambda x: pl.BlockSpec((b, x.shape[1], bd), lambda j, c: (0, 0, c))
  in_specs = [pl.BlockSpec(ins[0].shape, lambda j, c: (0, 0))] + [col(x) for x in ins[1:]]
  out_specs = [pl.BlockSpec((None, bt, width), lambda j, c: (c, j, 0))]
  out = [jax.ShapeDtypeStruct((d // bd, t_pad, width), jnp.float32)]
  kernel = functools.partial(_dw_kernel, bt=bt, t_len=t_len)
  grid = (t_pad // bt, d // bd)
  return triton.call(kernel, cfg, interpret, grid, in_specs, out_specs, out, ins)[0]


def _padded(k, v, window: int, plan: LaunchPlan):  # k, v: W - bt keys in front, T padded to chunks
  _, t_pad, _, front = _layout(k, window, plan)
  t_len = k.shape[1]
  pad = lambda x, fill: triton.pad_time(x, front, t_pad - t_len, fill)
  return pad(k, triton.pad_key(k.dtype)), pad(v, 0.0)


def _forward(k, v, w, static, with_lse: bool):  # a [and L] [B, t_pad, D] float32
  window, plan, interpret = static
  s, t_pad, _, front = _layout(k, window, plan)
  ins = (_slab_bias(w, s, t_pad, plan.cfg.block_t), *_padded(k, v, window, plan))
  # Key segment s: the key rows [s seg, (s + 1) seg), the front padding left out.
  tots = triton.totals(ins[1:], "keys", plan, t_pad, interpret, skip=front)
  outs = [jnp.float32] * (2 if with_lse else 1)
  return _call(_fwd_kernel, plan, interpret, k.shape[1], ins, outs, tots)


def _backward(k, v, w, a, lse, g, static):
  window, plan, interpret = static
  t_len = k.shape[1]
  s, t_pad, _, front = _layout(k, window, plan)
  # A NaN or +inf bias reaches only its own row (which then has no derivative); -inf: no term.
  bias, bias_vjp = jax.vjp(lambda w: _slab_bias(tame_bias(w), s, t_pad, plan.cfg.block_t), w)
  # A NaN key would make its whole chunk's shift NaN: non-finite keys and values are 0 here.
  k, v = tame(k), tame(v)
  ins = (bias, *_padded(k, v, window, plan), a, lse, g)
  tots = triton.totals((lse, g, a), "cotangent", plan, t_pad, interpret, limit=t_len)
  outs = [jnp.float32] * 2  # dk, dv in the keys' padded layout
  dk, dv = _call(_bwd_kernel, plan, interpret, t_len, ins, outs, tots, keys_out=True)
  if plan.seg:
    dk, dv = _overlap_add(dk, front), _overlap_add(dv, front)
  dbias = _dw_partials(ins, dw_config(k.shape[2]), interpret, t_len)
  (dw,) = bias_vjp(jnp.sum(dbias, axis=0))
  keys = slice(front, front + t_len)
  return dk[:, keys].astype(k.dtype), dv[:, keys].astype(v.dtype), dw.astype(w.dtype)


_local_mean = triton.mean_with_vjp(_forward, _backward)


def local_mean(k_BTD, v_BTD, w_TT, window: int, cfg=None, interpret=False, seg=None):
  """a ``[B, T, D]`` float32 for k, v, w ``[T, T]``; default launch ``plan_for``'s."""
  if cfg is None:
    cfg, seg = plan_for(*k_BTD.shape, window)
  front = _layout(k_BTD, window, LaunchPlan(cfg, seg))[3]
  if seg and (seg % cfg.block_t or seg < front):
    raise ValueError(
      f"Pallas kernel: segments of {seg} positions must be whole chunks of {cfg.block_t} and "
      f"hold the window's {front} earlier keys (window {window})"
    )
  return _local_mean(k_BTD, v_BTD, w_TT, (window, LaunchPlan(cfg, seg), interpret))
