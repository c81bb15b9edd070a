"""Causal AFT-simple's mean as Pallas Triton kernels for k, v ``[B, T, D]``, forward and custom
VJP (docs/kernels.md, "How each module computes")."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from aft_jax.ops.logsumexp import DEN_OK, NEG, set_aside
from aft_jax.ops.pallas import triton
from aft_jax.ops.pallas.triton import LaunchPlan, TritonConfig, all_true, colsum, dot, load, rows

# Backward: beyond this rise of L in a chunk (exp(L - L_start) near overflow), row by row.
_MAX_RISE = 40.0


def _fwd_kernel(k_ref, v_ref, *refs, bt: int, n_seg: int | None):  # a [and L]; refs[:3]: totals
  n_chunks = k_ref.shape[0] // bt
  tril = triton.ones(bt, jnp.greater_equal)
  carry_in = triton.empty(k_ref.shape[1])
  if n_seg is not None:  # the segments before this one
    s = pl.program_id(2)
    carry_in = triton.fold(*refs[:3], lambda i: i < s)
    refs = refs[3:]
  a_ref, *lse_ref = refs

  def store(idx, a, lse):
    a_ref[idx, :] = a
    if lse_ref:
      lse_ref[0][idx, :] = lse

  def chunk(j, carry):
    m0, num0, den0 = carry  # [1, bd] each
    idx = rows(j, bt)
    kc, vc = load(k_ref, idx), load(v_ref, idx)
    # The shift: what the chunk's first row sees, never a later key.
    m = jnp.maximum(m0, load(k_ref, pl.ds(j * bt, 1)))
    ok, e, vs = set_aside(jnp.exp(kc - m), vc)
    s0 = jnp.exp(m0 - m)
    num = s0 * num0 + dot(tril, e * vs)
    den = s0 * den0 + dot(tril, e)
    # The rows that see a set-aside term, or whose shift lost their terms: redone below.
    redo = (dot(tril, jnp.where(ok, 0.0, 1.0)) > 0.5) | ~(den >= DEN_OK)
    # Flagged rows are stored as NaN (a fast value never is), which the exact pass redoes.
    store(idx, jnp.where(redo, jnp.nan, num / den), m + jnp.log(den))

    def fast():
      return (m, s0 * num0 + colsum(e * vs), s0 * den0 + colsum(e))

    def exact():  # row by row with a running maximum, stored where the fast pass flagged
      def row(i, c):
        m1, num1, den1 = c
        r = pl.ds(j * bt + i, 1)
        k1, v1 = load(k_ref, r), load(v_ref, r)
        m2 = jnp.maximum(m1, k1)
        s1, s2 = jnp.exp(m1 - m2), jnp.exp(k1 - m2)
        num2, den2 = num1 * s1 + v1 * s2, den1 * s1 + s2
        a_fast = a_ref[r, :]
        again = a_fast != a_fast
        a_ref[r, :] = jnp.where(again, num2 / den2, a_fast)
        if lse_ref:
          lse_ref[0][r, :] = jnp.where(again, m2 + jnp.log(den2), lse_ref[0][r, :])
        return m2, num2, den2

      return jax.lax.fori_loop(0, bt, row, carry)

    return jax.lax.cond(all_true(~redo), fast, exact)

  jax.lax.fori_loop(0, n_chunks, chunk, carry_in)


def _bwd_kernel(k_ref, v_ref, a_ref, lse_ref, g_ref, *refs, bt: int, n_seg: int | None):  # dk, dv
  n_chunks = k_ref.shape[0] // bt
  triu = triton.ones(bt, jnp.less_equal)
  zero = jnp.zeros((1, k_ref.shape[1]), jnp.float32)
  carry_in = (zero, zero, zero - NEG)  # nothing after
  if n_seg is not None:
    # The later queries' C1, C2 = sum exp(-L - m) g [g a], m = max(-L) (their first row's).
    s = pl.program_id(2)
    m, c1, c2 = triton.fold(*refs[:3], lambda i: (i > s) & (i < n_seg))
    carry_in = (c1, c2, -m)
    refs = refs[3:]
  dk_ref, dv_ref = refs

  def store(idx, p, v, c1, c2):
    dv_ref[idx, :] = (p * c1).astype(dv_ref.dtype)
    dk_ref[idx, :] = (p * (v * c1 - c2)).astype(dk_ref.dtype)

  def chunk(i, carry):
    c1n, c2n, ln = carry  # C1, C2 at the next chunk's first row, in the scale of its L
    j = n_chunks - 1 - i
    idx = rows(j, bt)
    lse = load(lse_ref, idx)
    l0 = jnp.min(lse, axis=0, keepdims=True)  # L never decreases: the chunk's first row

    def fast():
      kc, vc = load(k_ref, idx), load(v_ref, idx)
      gs = load(g_ref, idx) * jnp.exp(l0 - lse)
      ga = gs * load(a_ref, idx)
      up, nx = jnp.exp(lse - l0), jnp.exp(lse - ln)
      c1 = up * dot(triu, gs) + nx * c1n
      c2 = up * dot(triu, ga) + nx * c2n
      store(idx, jnp.exp(kc - lse), vc, c1, c2)
      back = jnp.exp(l0 - ln)
      return (colsum(gs) + back * c1n, colsum(ga) + back * c2n, l0)

    def exact():
      def row(i2, c):
        c1, c2, l1 = c
        r = pl.ds(j * bt + bt - 1 - i2, 1)
        lr, g = load(lse_ref, r), load(g_ref, r)
        nx = jnp.exp(lr - l1)
        c1, c2 = g + nx * c1, g * load(a_ref, r) + nx * c2
        store(r, jnp.exp(load(k_ref, r) - lr), load(v_ref, r), c1, c2)
        return c1, c2, lr

      return jax.lax.fori_loop(0, bt, row, carry)

    rise = jnp.max(lse, axis=0, keepdims=True) - l0
    return jax.lax.cond(all_true(rise <= _MAX_RISE), fast, exact)

  jax.lax.fori_loop(0, n_chunks, chunk, carry_in)


def _call(kernel, plan: LaunchPlan, interpret: bool, ins, outs, kind, limit=None):
  """pallas_call over (batch, D / block_d[, segments]) after the segment totals of ``kind``."""
  (b, t_len, d), seg = ins[0].shape, plan.seg or ins[0].shape[1]
  n_seg = t_len // seg
  tot_ins = ins[:2] if kind == "keys" else (ins[3], ins[4], ins[2])  # (k, v) or (L, g, a)
  tots = triton.totals(tot_ins, kind, plan, t_len, interpret, limit=limit)
  spec = pl.BlockSpec((None, seg, plan.cfg.block_d), lambda i, j, *s: (i, s[0] if s else 0, j))
  tot = lambda x: pl.BlockSpec((None, x.shape[1], plan.cfg.block_d), lambda i, j, *s: (i, 0, j))
  kernel = functools.partial(kernel, bt=plan.cfg.block_t, n_seg=n_seg if plan.seg else None)
  out_shape = [jax.ShapeDtypeStruct((b, t_len, d), dt) for dt in outs]
  in_specs, grid = [spec] * len(ins) + [tot(x) for x in tots], triton.grid(b, d, plan, n_seg)
  return triton.call(
    kernel, plan.cfg, interpret, grid, in_specs, [spec] * len(outs), out_shape, (*ins, *tots)
  )


def _forward(k, v, _, static, with_lse: bool):  # over the padded T
  plan, interpret = static
  ins = triton.padded_to_chunks(k, v, plan.seg or plan.cfg.block_t)
  return _call(_fwd_kernel, plan, interpret, ins, [jnp.float32] * (2 if with_lse else 1), "keys")


def _backward(k, v, w, a, lse, g, static):
  plan, interpret = static
  ins = (*triton.padded_to_chunks(k, v, plan.seg or plan.cfg.block_t), a, lse, g)
  dk, dv = _call(_bwd_kernel, plan, interpret, ins, [k.dtype, v.dtype], "cotangent", k.shape[1])
  return dk[:, : k.shape[1]], dv[:, : k.shape[1]], w


_mean = triton.mean_with_vjp(_forward, _backward)


def causal_mean(k_BTD, v_BTD, cfg: TritonConfig | None = None, interpret=False, seg=None):
  """a ``[B, T, D]`` float32 of k, v, differentiable; default launch ``triton.plan_for``'s."""
  if cfg is None:
    cfg, seg = triton.plan_for(*k_BTD.shape)
  if seg is not None and (seg < cfg.block_t or seg % cfg.block_t):
    raise ValueError(f"Pallas kernel: seg = {seg} must be whole chunks of {cfg.block_t} positions")
  return _mean(k_BTD, v_BTD, None, (LaunchPlan(cfg, seg), interpret))


unsupported = triton.unsupported_channels
