"""Causal AFT-simple's mean as a Pallas TPU (Mosaic) kernel: ``triton_simple``'s maths, opt-in
(never timed on a TPU; docs/kernels.md, "How each module computes")."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from aft_jax.ops.logsumexp import DEN_OK, NEG, set_aside
from aft_jax.ops.pallas import triton
from aft_jax.ops.pallas.triton import colsum, dot

# Backward: the exact scan beyond this rise of L in a chunk; forward: the least fast denominator.
MAX_RISE, MIN_DEN = 40.0, DEN_OK
LANES = 128  # a TPU vector register's minor dimension: block_d is a multiple of it


class MosaicConfig(NamedTuple):
  block_t: int = 128  # positions per grid step (sublanes, a multiple of 16)
  block_d: int = 128  # channels per block (lanes)


# block_t 128 fills the MXU's rows; block_d as wide as the channels allow (not timed).
CONFIGS = tuple(MosaicConfig(block_t=128, block_d=bd) for bd in (512, 256, 128))


def unsupported(d: int, window=None) -> str | None:
  why = f"the channel dim D = {d} is not a multiple of {LANES} (the TPU kernel's lane tile; "
  return why + "pad the channels or use impl='xla')" if d % LANES else None


def config_for(d: int, batch: int = 1) -> MosaicConfig:  # two programs at least (megacore)
  return triton.widest_config(CONFIGS, d, batch, 2, f"Pallas TPU kernel: {unsupported(d)}")


def _prefix_triples(k, v):  # per row t of k, v [n, bd]: the triple of rows <= t
  n = k.shape[0]
  row = jax.lax.broadcasted_iota(jnp.int32, k.shape, 0)  # each element's row
  m, num, den = k, v, jnp.ones_like(k)
  s = 1
  while s < n:
    take = row >= s
    # roll by s: row t receives row t - s (wrapped rows are masked by ``take``).
    pm = jnp.where(take, pltpu.roll(m, s, 0), NEG)
    # Masked before the products: a wrapped (later) row may hold a NaN, and 0 * NaN = NaN.
    pn, pd = (jnp.where(take, pltpu.roll(x, s, 0), 0.0) for x in (num, den))
    mine = m >= pm
    x = jnp.exp(-jnp.abs(m - pm))  # one exp: the larger side is scaled by 1
    sa = jnp.where(mine, 1.0, x)
    sb = jnp.where(take, jnp.where(mine, x, 1.0), 0.0)
    m, num, den = jnp.maximum(m, pm), num * sa + pn * sb, den * sa + pd * sb
    s *= 2
  return m, num, den


def _suffix_sums(lse, p1, p2):  # per row t': sum_{t >= t'} exp(L[t'] - L[t]) p[t], factors <= 1
  n = lse.shape[0]
  row = jax.lax.broadcasted_iota(jnp.int32, lse.shape, 0)
  s = 1
  while s < n:
    # Row t' receives row t' + s; factor 0 past the chunk's end (and for a wrapped row's exp).
    f = jnp.where(row < n - s, jnp.exp(lse - pltpu.roll(lse, n - s, 0)), 0.0)
    p1, p2 = p1 + f * pltpu.roll(p1, n - s, 0), p2 + f * pltpu.roll(p2, n - s, 0)
    s *= 2
  return p1, p2


def _fwd_kernel(k_ref, v_ref, a_ref, *rest, with_lse: bool):  # per (batch, block, chunk): a [and L]
  lse_ref = rest[0] if with_lse else None
  m_ref, num_ref, den_ref = rest[-3:]  # the triple of every earlier chunk, [1, bd]

  @pl.when(pl.program_id(2) == 0)
  def _():
    for ref, x in zip((m_ref, num_ref, den_ref), (NEG, 0.0, 0.0)):
      ref[...] = jnp.full(ref.shape, x, jnp.float32)

  kc, vc = k_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32)
  m0, num0, den0 = m_ref[...], num_ref[...], den_ref[...]
  # The shift: what the chunk's first row sees, never a later key.
  m = jnp.maximum(m0, kc[0:1])
  ok, e, vs = set_aside(jnp.exp(kc - m), vc)
  s0 = jnp.exp(m0 - m)
  ev = e * vs
  tril = triton.ones(kc.shape[0], jnp.greater_equal)
  num = s0 * num0 + dot(tril, ev)
  den = s0 * den0 + dot(tril, e)
  # The rows that see a set-aside term, or whose shift lost their terms: only they are redone.
  redo = (dot(tril, jnp.where(ok, 0.0, 1.0)) > 0.5) | ~(den >= MIN_DEN)
  last = lambda x: x[x.shape[0] - 1 :]

  def fast():
    # The carry: every term (none is set aside), in the scale m.
    carry = (s0 * num0 + colsum(ev), s0 * den0 + colsum(e))
    return jnp.broadcast_to(m, kc.shape), num, den, m, *carry

  def exact():  # the chunk's own prefix triples, then the carry added to each row
    mc, numc, denc = _prefix_triples(kc, vc)
    mt = jnp.maximum(m0, mc)
    sc, sr = jnp.exp(m0 - mt), jnp.exp(mc - mt)
    numt, dent = num0 * sc + numc * sr, den0 * sc + denc * sr
    pick = lambda x, f: jnp.where(redo, x, f)  # the other rows keep the fast values, bit for bit
    mf = jnp.broadcast_to(m, kc.shape)
    return pick(mt, mf), pick(numt, num), pick(dent, den), last(mt), last(numt), last(dent)

  mt, num, den, *carry = jax.lax.cond(jnp.max(jnp.where(redo, 1.0, 0.0)) < 0.5, fast, exact)
  a_ref[...] = num / den
  if with_lse:
    lse_ref[...] = mt + jnp.log(den)
  m_ref[...], num_ref[...], den_ref[...] = carry


def _bwd_kernel(k_ref, v_ref, a_ref, lse_ref, g_ref, dk_ref, dv_ref, c1_ref, c2_ref, ln_ref):
  """One grid step, chunks from the last: dk, dv; the scratch holds C1, C2, L of the next chunk."""

  @pl.when(pl.program_id(2) == 0)
  def _():  # L after the last chunk -NEG: exp(L - ln) = 0, nothing after
    for ref, x in zip((c1_ref, c2_ref, ln_ref), (0.0, 0.0, -NEG)):
      ref[...] = jnp.full(ref.shape, x, jnp.float32)

  lse, g, a = lse_ref[...], g_ref[...], a_ref[...]
  c1n, c2n, ln = c1_ref[...], c2_ref[...], ln_ref[...]
  l0 = jnp.min(lse, axis=0, keepdims=True)  # L never decreases: the chunk's first row
  gs = g * jnp.exp(l0 - lse)
  ga = gs * a
  nx = jnp.exp(lse - ln)

  def fast():
    up = jnp.exp(lse - l0)
    triu = triton.ones(lse.shape[0], jnp.less_equal)
    return up * dot(triu, gs) + nx * c1n, up * dot(triu, ga) + nx * c2n

  def exact():
    p1, p2 = _suffix_sums(lse, g, g * a)
    return p1 + nx * c1n, p2 + nx * c2n

  rise = jnp.max(lse - l0)
  c1, c2 = jax.lax.cond(rise <= MAX_RISE, fast, exact)
  p = jnp.exp(k_ref[...].astype(jnp.float32) - lse)
  dv_ref[...] = (p * c1).astype(dv_ref.dtype)
  dk_ref[...] = (p * (v_ref[...].astype(jnp.float32) * c1 - c2)).astype(dk_ref.dtype)
  # C1, C2 at this chunk's first row, in the scale of its L (l0): factors <= 1, exact.
  back = jnp.exp(l0 - ln)
  c1_ref[...] = colsum(gs) + back * c1n
  c2_ref[...] = colsum(ga) + back * c2n
  ln_ref[...] = l0


def _call(kernel, cfg: MosaicConfig, interpret: bool, reverse: bool, ins, outs):
  (b, t_len, d), bt, bd = ins[0].shape, cfg.block_t, cfg.block_d
  n_t = t_len // bt
  index = (lambda i, j, t: (i, n_t - 1 - t, j)) if reverse else (lambda i, j, t: (i, t, j))
  spec = pl.BlockSpec((None, bt, bd), index)
  out_shape = [jax.ShapeDtypeStruct((b, t_len, d), dt) for dt in outs]
  return pl.pallas_call(
    kernel, grid=(b, d // bd, n_t), in_specs=[spec] * len(ins), out_specs=[spec] * len(outs),
    out_shape=triton.varying_like(out_shape, ins, interpret),
    scratch_shapes=[pltpu.VMEM((1, bd), jnp.float32) for _ in range(3)],
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    interpret=interpret,
  )(*ins)  # fmt: skip


def _forward(k, v, _, static, with_lse: bool):
  cfg, interpret = static
  kernel = functools.partial(_fwd_kernel, with_lse=with_lse)
  outs = [jnp.float32] * (2 if with_lse else 1)
  return _call(kernel, cfg, interpret, False, triton.padded_to_chunks(k, v, cfg.block_t), outs)


def _backward(k, v, w, a, lse, g, static):
  cfg, interpret = static
  ins = (*triton.padded_to_chunks(k, v, cfg.block_t), a, lse, g)
  dk, dv = _call(_bwd_kernel, cfg, interpret, True, ins, [k.dtype, v.dtype])
  return dk[:, : k.shape[1]], dv[:, : k.shape[1]], w


_causal_mean = triton.mean_with_vjp(_forward, _backward)


def causal_mean(k_BTD, v_BTD, cfg: MosaicConfig | None = None, interpret: bool = False):
  """a ``[B, T, D]`` float32 for k, v (D a multiple of 128); ``cfg`` default ``config_for``'s."""
  d = k_BTD.shape[-1]
  cfg = cfg or config_for(d, k_BTD.shape[0])
  if d % cfg.block_d or cfg.block_d % LANES or cfg.block_t % 16:
    raise ValueError(
      f"Pallas TPU kernel: {cfg} cannot tile D = {d} channels (block_d must be a multiple of "
      f"{LANES} dividing D, block_t a multiple of 16)"
    )
  return _causal_mean(k_BTD, v_BTD, None, (cfg, interpret))
