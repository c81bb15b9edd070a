"""What the Pallas kernels share: configurations, the launch plan (``plan_for``), the Triton
call, segment totals, in-kernel helpers, the custom VJP (docs/kernels.md, "The kernels")."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from aft_jax.ops.logsumexp import HIGHEST, NEG, keep


class TritonConfig(NamedTuple):  # block sizes: powers of 2, >= 16
  block_t: int = 16  # positions per chunk
  block_d: int = 64  # channels per program
  num_warps: int = 4
  num_stages: int = 1


# Every configuration ``config_for`` can choose (the cross-lowering tests export each).
CONFIGS = tuple(TritonConfig(block_d=bd) for bd in (64, 32, 16))
# A memory-bound kernel wants >= 4 resident programs per SM (H100 / H200: 132 SMs).
MIN_PROGRAMS = 4 * 132
# Segment lengths, the longest first (both forms timed by ``benchmarks.accelerator_check``).
SEGMENTS = (2048, 1024, 512, 256, 128)
FOLD = 16  # segment totals folded per step
FORMS = ("auto", "sequential", "chunked")


class LaunchPlan(NamedTuple):
  cfg: TritonConfig
  seg: int | None = None  # positions per program (None: sequential)


def unsupported_channels(d: int, window=None) -> str | None:
  tile = CONFIGS[-1].block_d
  why = f"the channel dim D = {d} is not a multiple of {tile} (the kernel's tile)"
  return why if d % tile else None


def widest_config(configs, d: int, batch: int, min_programs: int, why_not: str):
  """The widest config dividing d with ``min_programs`` programs, else the narrowest dividing d."""
  fits = [cfg for cfg in configs if d % cfg.block_d == 0]
  if not fits:
    raise ValueError(why_not)
  return next((c for c in fits if batch * (d // c.block_d) >= min_programs), fits[-1])


def config_for(d: int, batch: int = 1, min_programs: int = 256) -> TritonConfig:
  return widest_config(CONFIGS, d, batch, min_programs, f"Pallas kernel: {unsupported_channels(d)}")


def plan_for(batch: int, t_len: int, d: int, min_seg: int = 0, form: str = "auto") -> LaunchPlan:
  """Sequential if it has ``MIN_PROGRAMS`` programs, else chunked (2 segments >= min_seg)."""
  if form not in FORMS:
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")
  seq = LaunchPlan(config_for(d, batch))
  cfg = widest_config(CONFIGS, d, 1, 0, f"Pallas kernel: {unsupported_channels(d)}")
  fits = [s for s in SEGMENTS if s >= min_seg and -(-t_len // s) >= 2]
  enough = lambda s: batch * (d // cfg.block_d) * -(-t_len // s) >= MIN_PROGRAMS
  chunked = LaunchPlan(cfg, next((s for s in fits if enough(s)), fits[-1])) if fits else None
  if form == "sequential" or chunked is None:
    return seq
  if form == "chunked" or batch * (d // seq.cfg.block_d) < MIN_PROGRAMS:
    return chunked
  return seq


def grid(batch: int, d: int, plan: LaunchPlan, n_seg: int) -> tuple[int, ...]:
  return (batch, d // plan.cfg.block_d) + ((n_seg,) if plan.seg else ())


def ones(n: int, where):  # [n, n]: 1.0 where where(row, col) (greater_equal: lower triangle)
  i, j = (jax.lax.broadcasted_iota(jnp.int32, (n, n), axis) for axis in (0, 1))
  return jnp.where(where(i, j), 1.0, 0.0).astype(jnp.float32)


def mean_with_vjp(forward, backward):  # mean(k, v, w, static), its VJP by forward and backward

  @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
  def mean(k, v, w, static):
    return forward(k, v, w, static, False)[0][:, : k.shape[1]]

  def fwd(k, v, w, static):
    a, lse, *more = forward(k, v, w, static, True)  # more: the kernel's other residuals
    return a[:, : k.shape[1]], (k, v, w, a, jnp.where(keep(a, lse), lse, -NEG), *more)

  def bwd(static, res, g):
    k, v, w, a, lse, *more = res  # L: the largest float32 on rows without derivative (weight 0)
    g = pad_time(g.astype(jnp.float32), 0, a.shape[1] - k.shape[1], 0.0)  # padding: 0
    a, g = jnp.where(lse < -NEG, a, 0.0), jnp.where(lse < -NEG, g, 0.0)
    return backward(k, v, w, a, lse, g, static, *more)

  mean.defvjp(fwd, bwd)
  return mean


def call(kernel, cfg: TritonConfig, interpret: bool, grid, in_specs, out_specs, out_shape, ins):
  """``pl.pallas_call``, compiled with Triton's parameters (else the lowering is Mosaic GPU)."""
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton as plt

    params["compiler_params"] = plt.CompilerParams(
      num_warps=cfg.num_warps, num_stages=cfg.num_stages
    )
  return pl.pallas_call(
    kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, interpret=interpret,
    out_shape=varying_like(out_shape, ins, interpret), **params,
  )(*ins)  # fmt: skip


def varying_like(out_shape, ins, interpret: bool):  # out_shape varying as ins; refused interpreted
  axes = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in ins))
  if axes and interpret:
    raise ValueError(
      f"Pallas' interpreter cannot run inside jax.shard_map with check_vma=True (inputs vary "
      f"over mesh axes {sorted(axes)}); use impl='xla' there, or check_vma=False"
    )
  mat = jax.sharding.ManualAxisType(varying=axes)
  return [jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat) for s in out_shape]


def all_true(cond):  # every element of the 2-D cond (Triton has no reduce_and)
  return jnp.min(jnp.min(jnp.where(cond, 1.0, 0.0), axis=1), axis=0) > 0.5


def dot(x, y, trans_x: bool = False, trans_y: bool = False):  # float32 x @ y, no TF32
  dims = (((0 if trans_x else 1,), (1 if trans_y else 0,)), ((), ()))
  return jax.lax.dot_general(x, y, dims, precision=HIGHEST, preferred_element_type=jnp.float32)


colsum = lambda x: jnp.sum(x, axis=0, keepdims=True)  # [n, bd] -> [1, bd]
rows = lambda j, n: pl.ds(pl.multiple_of(j * n, n), n)  # the j-th block of n rows
load = lambda ref, idx: ref[idx, :].astype(jnp.float32)


def pad_time(x, before: int, after: int, fill):  # [B, T, D] -> [B, before + T + after, D]
  if not (before or after):
    return x
  return jnp.pad(x, ((0, 0), (before, after), (0, 0)), constant_values=fill)


def padded_to_chunks(k, v, block_t: int):  # T to whole chunks: keys pad_key (weight 0), values 0
  t_pad = -k.shape[1] % block_t
  return pad_time(k, 0, t_pad, pad_key(k.dtype)), pad_time(v, 0, t_pad, 0.0)


def pad_key(dtype) -> float:  # NEG, or the dtype's lowest (NEG in bfloat16 is -inf)
  return max(NEG, float(jnp.finfo(dtype).min))


def empty(bd: int):
  zero = jnp.zeros((1, bd), jnp.float32)  # the triple of no terms
  return zero + NEG, zero, zero


def _combine_block(carry, x, y1, y2, ok):  # carry plus exp(x) (y1, y2) of the rows where ok
  m0, a0, b0 = carry
  x = jnp.where(ok, x, NEG)
  m = jnp.maximum(m0, jnp.max(x, axis=0, keepdims=True))
  e, s0 = jnp.where(ok, jnp.exp(x - m), 0.0), jnp.exp(m0 - m)
  y1, y2 = jnp.where(ok, y1, 0.0), jnp.where(ok, y2, 0.0)
  return m, a0 * s0 + colsum(e * y1), b0 * s0 + colsum(e * y2)


def fold(m_ref, s1_ref, s2_ref, take):  # the segment totals whose index ``take`` accepts, combined

  def step(i, carry):
    idx = rows(i, FOLD)
    ok = take(i * FOLD + jax.lax.broadcasted_iota(jnp.int32, (FOLD, 1), 0))
    return _combine_block(carry, m_ref[idx, :], s1_ref[idx, :], s2_ref[idx, :], ok)

  return jax.lax.fori_loop(0, m_ref.shape[0] // FOLD, step, empty(m_ref.shape[1]))


def _totals_kernel(*refs, bt: int, seg: int, kind: str, skip: int, limit: int):
  """A segment's triple, rows in [skip, limit): exp(k) (v, 1), or exp(-L) (g, g a)."""
  *ins, m_ref, s1_ref, s2_ref = refs
  s = pl.program_id(2)

  def chunk(i, carry):
    j = s * (seg // bt) + i
    idx = rows(j, bt)
    row = j * bt + jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    ok = (row >= skip) & (row < limit)
    x, y1 = load(ins[0], idx), load(ins[1], idx)
    if kind == "keys":
      return _combine_block(carry, x, y1, jnp.ones_like(y1), ok)
    return _combine_block(carry, -x, y1, y1 * load(ins[2], idx), ok)

  m_ref[...], s1_ref[...], s2_ref[...] = jax.lax.fori_loop(
    0, seg // bt, chunk, empty(ins[0].shape[1])
  )


def totals(ins, kind: str, plan: LaunchPlan, t_pad: int, interpret: bool, skip=0, limit=None):
  """(m, s1, s2) [B, n_pad, D] per segment of (k, v) or (L, g, a); none when sequential."""
  if not plan.seg:
    return ()
  (b, n, d), n_seg = ins[0].shape, t_pad // plan.seg
  cfg = plan.cfg
  col = pl.BlockSpec((None, n, cfg.block_d), lambda i, j, s: (i, 0, j))
  one = pl.BlockSpec((None, 1, cfg.block_d), lambda i, j, s: (i, s, j))
  kernel = functools.partial(
    _totals_kernel, bt=cfg.block_t, seg=plan.seg, kind=kind, skip=skip,
    limit=n if limit is None else limit,
  )  # fmt: skip
  out = jax.ShapeDtypeStruct((b, -(-n_seg // FOLD) * FOLD, d), jnp.float32)  # whole folds
  return call(
    kernel, cfg, interpret, grid(b, d, plan, n_seg), [col] * len(ins), [one] * 3, [out] * 3, ins
  )
