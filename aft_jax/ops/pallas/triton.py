"""What the Pallas GPU kernels (``triton_simple``, ``triton_local``) share: block configurations,
the launch plan, the Triton call, the chunk-parallel form's segment totals, in-kernel helpers;
and, with the TPU kernel (``mosaic_simple``), the widest channel block and the custom VJP of a
weighted mean.

Every kernel walks its positions in chunks of ``block_t``, one program per (batch row, block of
``block_d`` channels). That is the sequential form: at small B * D few programs (AFT-simple at
B 1, D 512: 8 to 32) wait on their chunks one after another while a GPU has ~100 SMs to fill.
The chunk-parallel form (the split of flash-linear-attention's chunk kernels, Mamba2's SSD,
RecurrentGemma's scan) cuts T into segments of ``seg`` positions, grid (batch row, channel
block, segment): a totals kernel writes each segment's exact triple (``totals``), and each
segment's carry-in is the combine of the totals before it (``fold``; the backward: after it),
``FOLD`` at a time, each scaled by exp(its max - the overall max) <= 1. The split is exact; it
costs one more read of the inputs. ``plan_for`` chooses the form.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from aft_jax.ops.logsumexp import HIGHEST, NEG, keep


class TritonConfig(NamedTuple):
  """Positions per chunk, channels per program, Triton warps and stages (Triton's products need
  both block sizes >= 16, powers of two)."""

  block_t: int = 16
  block_d: int = 64
  num_warps: int = 4
  num_stages: int = 1


# Every configuration ``config_for`` can choose (the cross-lowering tests export each).
CONFIGS = tuple(TritonConfig(block_d=bd) for bd in (64, 32, 16))
# A memory-bound kernel wants >= 4 resident programs per SM of the largest GPU it runs on
# (H100 / H200: 132 SMs).
MIN_PROGRAMS = 4 * 132
# Segment lengths, longest first: the longest that still gives MIN_PROGRAMS (fewer totals, a
# shorter fold). 128 = 8 chunks of 16 is the shortest: at T 16384 its fold (8 steps) is as long
# as its own chunks. AFT-local's segments also hold the band's front (``min_seg``). Chosen by
# reasoning, not timed on a GPU (``benchmarks.accelerator_check`` times both forms).
SEGMENTS = (2048, 1024, 512, 256, 128)
FOLD = 16  # segment totals folded per step
FORMS = ("auto", "sequential", "chunked")


class LaunchPlan(NamedTuple):
  """The block configuration and ``seg``, positions per program along T (None: sequential)."""

  cfg: TritonConfig
  seg: int | None = None


def unsupported_channels(d: int, window=None) -> str | None:
  """Why a kernel cannot tile D = d channels, or None if it can."""
  if d % CONFIGS[-1].block_d:
    return f"the channel dim D = {d} is not a multiple of {CONFIGS[-1].block_d} (the kernel's tile)"
  return None


def widest_config(configs, d: int, batch: int, min_programs: int, why_not: str):
  """Of ``configs`` (widest first), the widest whose channel block divides d and gives
  ``min_programs`` (batch row, channel block) programs, else the narrowest that divides d; a
  ValueError saying ``why_not`` where none does."""
  fits = [cfg for cfg in configs if d % cfg.block_d == 0]
  if not fits:
    raise ValueError(why_not)
  return next((c for c in fits if batch * (d // c.block_d) >= min_programs), fits[-1])


def config_for(d: int, batch: int = 1, min_programs: int = 256) -> TritonConfig:
  """The sequential form's configuration for ``batch`` rows of D = d channels: each program
  walks T, so a GPU needs many of them."""
  return widest_config(CONFIGS, d, batch, min_programs, f"Pallas kernel: {unsupported_channels(d)}")


def plan_for(batch: int, t_len: int, d: int, min_seg: int = 0, form: str = "auto") -> LaunchPlan:
  """The launch for ``batch`` rows of T = t_len, D = d: sequential where its grid has
  ``MIN_PROGRAMS`` programs, else chunk-parallel where T holds two segments (``SEGMENTS``, each
  >= ``min_seg``), else sequential. ``form`` "sequential" or "chunked" takes that form where it
  can run (the ops ask "auto"; ``benchmarks.kernel_form.forced`` times each)."""
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
  """(batch rows, channel blocks[, segments])."""
  return (batch, d // plan.cfg.block_d) + ((n_seg,) if plan.seg else ())


def n_pad(n_seg: int) -> int:
  """The totals' rows: n_seg rounded up to whole ``FOLD`` blocks (the rest never read)."""
  return -(-n_seg // FOLD) * FOLD


# --------------------------------------------------------------------------- the calls


def mean_with_vjp(forward, backward):
  """The custom-VJP weighted mean of the AFT-simple kernels, a [B, T, D] of k, v (static cfg,
  interpret), from the kernels' halves over T padded to their chunks: ``forward(k, v, cfg,
  interpret, with_lse)`` -> a [and L]; ``backward(k, v, a, lse, g, cfg, interpret)`` -> dk, dv
  (g padded with zeros). Residuals: a and L (padded) besides k and v."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
  def mean(k, v, cfg, interpret: bool):
    return forward(k, v, cfg, interpret, False)[0][:, : k.shape[1]]

  def fwd(k, v, cfg, interpret):
    a, lse = forward(k, v, cfg, interpret, True)
    return a[:, : k.shape[1]], (k, v, a, tamed_lse(a, lse))

  def bwd(cfg, interpret, res, g):
    k, v, a, lse = res
    t_len = k.shape[1]
    g = pad_time(g.astype(jnp.float32), 0, a.shape[1] - t_len, 0.0)  # padding: cotangent 0
    a, g = tamed_cotangent(a, lse, g)
    dk, dv = backward(k, v, a, lse, g, cfg, interpret)
    return dk[:, :t_len], dv[:, :t_len]

  mean.defvjp(fwd, bwd)
  return mean


def tamed_lse(a, lse):
  """L as a residual: the largest float32 on rows without derivative (``keep``: after a NaN),
  a weight exp(k - L) of 0 as padding rows have, so the backward sums there are exact zeros."""
  return jnp.where(keep(a, lse), lse, -NEG)


def tamed_cotangent(a, lse, g):
  """(a, g) for the backward kernels (L from ``tamed_lse``): 0 on rows without derivative."""
  ok = lse < -NEG
  return jnp.where(ok, a, 0.0), jnp.where(ok, g, 0.0)


def call(kernel, cfg: TritonConfig, interpret: bool, grid, in_specs, out_specs, out_shape, ins):
  """``pl.pallas_call`` with Triton's compiler parameters unless interpreted (without them the
  GPU lowering is Mosaic GPU, which lacks the kernels' cumsum and dot_general)."""
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


def varying_like(out_shape, ins, interpret: bool):
  """``out_shape`` varying over every manual mesh axis one of ``ins`` varies over (inside
  ``jax.shard_map`` with check_vma=True a ``pallas_call`` is told how its outputs vary). Pallas'
  interpreter (jax 0.10.2) cannot run there (its loops start from buffers that vary over no
  axis): a one-line ValueError instead of a scan error from inside Pallas."""
  axes = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in ins))
  if axes and interpret:
    raise ValueError(
      f"Pallas' interpreter cannot run inside jax.shard_map with check_vma=True (inputs vary "
      f"over mesh axes {sorted(axes)}); use impl='xla' there, or check_vma=False"
    )
  mat = jax.sharding.ManualAxisType(varying=axes)
  return [jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat) for s in out_shape]


# --------------------------------------------------------------------------- in-kernel helpers


def all_true(cond):
  """True where every element of the 2-D bool ``cond`` is (Triton has no reduce_and)."""
  return jnp.min(jnp.min(jnp.where(cond, 1.0, 0.0), axis=1), axis=0) > 0.5


def dot(x, y, trans_x: bool = False, trans_y: bool = False):
  """float32 x @ y (x^T, y^T where asked), no TF32 passes: the factors of exact sums."""
  dims = (((0 if trans_x else 1,), (1 if trans_y else 0,)), ((), ()))
  return jax.lax.dot_general(x, y, dims, precision=HIGHEST, preferred_element_type=jnp.float32)


def rows(j, n):
  """The j-th block of n rows."""
  return pl.ds(pl.multiple_of(j * n, n), n)


def load(ref, idx):
  """Rows ``idx`` of ``ref`` in float32."""
  return ref[idx, :].astype(jnp.float32)


def pad_time(x, before: int, after: int, fill):
  """[B, T, D] -> [B, before + T + after, D], the new rows ``fill``."""
  if not (before or after):
    return x
  return jnp.pad(x, ((0, 0), (before, after), (0, 0)), constant_values=fill)


def padded_to_chunks(k, v, block_t: int):
  """k, v with T padded to a multiple of block_t: keys ``pad_key`` (weight 0), values 0."""
  t_pad = -k.shape[1] % block_t
  return pad_time(k, 0, t_pad, pad_key(k.dtype)), pad_time(v, 0, t_pad, 0.0)


def pad_key(dtype) -> float:
  """A padding key: NEG where the dtype holds it, else its lowest (bfloat16 would round NEG to
  -inf, and -inf - -inf = NaN)."""
  return max(NEG, float(jnp.finfo(dtype).min))


def empty(bd: int):
  """The triple of no terms, [1, bd] each."""
  zero = jnp.zeros((1, bd), jnp.float32)
  return zero + NEG, zero, zero


def _combine_block(carry, x, y1, y2, ok):
  """``carry`` (m, s1, s2) [1, bd] plus the terms exp(x) y1, exp(x) y2 of the rows where ``ok``
  ([n, bd] each), every factor <= 1; values masked before the products (a later NaN must not
  reach an earlier segment)."""
  m0, a0, b0 = carry
  x = jnp.where(ok, x, NEG)
  m = jnp.maximum(m0, jnp.max(x, axis=0, keepdims=True))
  e, s0 = jnp.where(ok, jnp.exp(x - m), 0.0), jnp.exp(m0 - m)
  y1, y2 = jnp.where(ok, y1, 0.0), jnp.where(ok, y2, 0.0)
  sum_ = lambda y: jnp.sum(e * y, axis=0, keepdims=True)
  return m, a0 * s0 + sum_(y1), b0 * s0 + sum_(y2)


def fold(m_ref, s1_ref, s2_ref, take):
  """The combine of the segment totals [n_pad, bd] whose index ``take(index [FOLD, 1])``
  accepts, ``FOLD`` at a time: a triple [1, bd] each."""

  def step(i, carry):
    idx = rows(i, FOLD)
    ok = take(i * FOLD + jax.lax.broadcasted_iota(jnp.int32, (FOLD, 1), 0))
    return _combine_block(carry, m_ref[idx, :], s1_ref[idx, :], s2_ref[idx, :], ok)

  return jax.lax.fori_loop(0, m_ref.shape[0] // FOLD, step, empty(m_ref.shape[1]))


def _totals_kernel(*refs, bt: int, seg: int, kind: str, skip: int, limit: int):
  """One (batch row, channel block, segment s): the triple of its rows with skip <= row <
  limit. ``kind`` "keys": refs k, v, terms exp(k) v, exp(k); "cotangent": refs L, g, a, terms
  exp(-L) g, exp(-L) g a (the backward's sums over later queries)."""
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


def totals(ins, kind: str, plan: LaunchPlan, n_seg: int, interpret: bool, skip=0, limit=None):
  """The segment totals (m, s1, s2), each [B, n_pad, D] float32, of ins = (k, v) or (L, g, a)
  [B, n, D], segment s its rows [s seg, (s + 1) seg)."""
  b, n, d = ins[0].shape
  cfg = plan.cfg
  col = pl.BlockSpec((None, n, cfg.block_d), lambda i, j, s: (i, 0, j))
  one = pl.BlockSpec((None, 1, cfg.block_d), lambda i, j, s: (i, s, j))
  kernel = functools.partial(
    _totals_kernel, bt=cfg.block_t, seg=plan.seg, kind=kind, skip=skip,
    limit=n if limit is None else limit,
  )  # fmt: skip
  out = jax.ShapeDtypeStruct((b, n_pad(n_seg), d), jnp.float32)
  return call(
    kernel, cfg, interpret, grid(b, d, plan, n_seg), [col] * len(ins), [one] * 3, [out] * 3, ins
  )
