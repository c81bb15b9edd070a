"""How the Pallas GPU kernels split their work into programs: the one choice between the
sequential and the chunk-parallel form (``plan_for``, from the table below), and the pieces the
chunk-parallel form of ``pallas_simple`` and ``pallas_local`` shares.

Sequential form: one program per (batch row, block of ``block_d`` channels) walks the whole
sequence, carrying the exact (max, num, den) triple from chunk to chunk. At small B * D that is
few programs (causal AFT-simple at B 1, D 512: 8 to 32), each waiting on its own chunks one
after another, while a GPU has ~100 streaming multiprocessors to fill.

Chunk-parallel form (the split flash-linear-attention's chunk kernels, Mamba2's SSD and
RecurrentGemma's scan make): the sequence is cut into segments of ``seg`` positions and the grid
is (batch row, channel block, segment):

1. a totals kernel (``totals``): per segment, the exact triple of its terms
   (``logsumexp``'s monoid: max, sum exp(x - max) y1, sum exp(x - max) y2), [B, n_pad, D];
2. the kernel proper, per segment: its carry-in is the combine of the totals of the segments
   before it (``fold``; the backward: after it), all at once in blocks of ``FOLD`` (each
   total scaled by exp(its max - the overall max) <= 1, so totals whose maxima differ by more
   than float32's range still combine exactly), then it walks its own ``seg / block_t`` chunks
   as the sequential form walks all of them.

The split is exact (the triple combines associatively); it costs one more read of the inputs
(the totals) and, per program, n_seg / ``FOLD`` steps of the fold.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from aft_jax.ops import pallas_util
from aft_jax.ops.logsumexp import NEG
from aft_jax.ops.pallas_util import TritonConfig, rows

# --------------------------------------------------------------------------- the choice
#
# Why these numbers. A program runs on one SM with 4 warps; a GPU hides its memory latency only
# with several resident programs per SM, so a kernel that is pure memory traffic wants at least
# 4 programs per SM of the largest GPU it runs on (H100 / H200: 132 SMs; an A100 has 108).
MIN_PROGRAMS = 4 * 132
# Segment lengths, longest first: the longest one that still gives MIN_PROGRAMS is taken
# (longer segments: fewer totals, a shorter fold). 128 = 8 chunks of 16 is the shortest: there,
# at T = 16384, a program's fold (n_seg / FOLD = 8 steps) is already as long as its own 8
# chunks, and shorter segments would only add fold. AFT-local's segments must also hold the
# band's front (``min_seg``: window - 1 rounded up to chunks), whose keys a segment's first
# chunk reads from the segment before. Chosen by reasoning, not timed on a GPU:
# ``benchmarks.accelerator_check`` times both forms where one is lent.
SEGMENTS = (2048, 1024, 512, 256, 128)
# The chunk-parallel form's channel block: the widest (64), since the segments supply the
# programs; 32 or 16 where D is not a multiple of 64.
CHUNKED_CONFIGS = pallas_util.CONFIGS
# Segment totals folded per step (one [FOLD, block_d] load per triple component).
FOLD = 16

FORMS = ("auto", "sequential", "chunked")


class LaunchPlan(NamedTuple):
  """A kernel launch: the block configuration and ``seg``, the positions per program along T
  (None: the sequential form, one program walks all of T)."""

  cfg: TritonConfig
  seg: int | None = None


def _chunked_plan(batch: int, t_len: int, d: int, min_seg: int) -> LaunchPlan | None:
  """The chunk-parallel launch for these shapes, or None where T holds fewer than two
  segments of the shortest allowed length."""
  why = f"Pallas kernel: {pallas_util.unsupported_channels(d)}"
  cfg = pallas_util.widest_config(CHUNKED_CONFIGS, d, 1, 0, why)
  fits = [s for s in SEGMENTS if s >= min_seg and -(-t_len // s) >= 2]
  if not fits:
    return None
  for seg in fits:
    if batch * (d // cfg.block_d) * -(-t_len // seg) >= MIN_PROGRAMS:
      return LaunchPlan(cfg, seg)
  return LaunchPlan(cfg, fits[-1])


def plan_for(batch: int, t_len: int, d: int, min_seg: int = 0, form: str = "auto") -> LaunchPlan:
  """The launch for ``batch`` rows of T = t_len positions and D = d channels (D a multiple of
  16): the sequential form (``config_for``) where its grid has ``MIN_PROGRAMS`` programs, else
  the chunk-parallel form where T holds two segments (``SEGMENTS``, each >= ``min_seg``), else
  the sequential one. ``form`` "sequential" or "chunked" takes that form wherever it can run
  (the ops always ask for "auto"; ``benchmarks.kernel_form.forced`` times each)."""
  if form not in FORMS:
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")
  seq = LaunchPlan(pallas_util.config_for(d, batch))
  chunked = _chunked_plan(batch, t_len, d, min_seg)
  if form == "sequential" or chunked is None:
    return seq
  if form == "chunked" or batch * (d // seq.cfg.block_d) < MIN_PROGRAMS:
    return chunked
  return seq


def grid(batch: int, d: int, plan: LaunchPlan, n_seg: int) -> tuple[int, ...]:
  """(batch rows, channel blocks[, segments]): the chunk-parallel form's third axis."""
  return (batch, d // plan.cfg.block_d) + ((n_seg,) if plan.seg else ())


# --------------------------------------------------------------------------- the kernels' parts


def empty(bd: int):
  """The triple of no terms, [1, bd] each."""
  zero = jnp.zeros((1, bd), jnp.float32)
  return zero + NEG, zero, zero


def _combine_block(carry, x, y1, y2, ok):
  """``carry`` (m, s1, s2) [1, bd] plus the terms exp(x) y1, exp(x) y2 of the rows where ``ok``
  ([n, bd] each): the stable log-sum-exp combine, every factor <= 1."""
  m0, a0, b0 = carry
  x = jnp.where(ok, x, NEG)
  m = jnp.maximum(m0, jnp.max(x, axis=0, keepdims=True))
  e, s0 = jnp.where(ok, jnp.exp(x - m), 0.0), jnp.exp(m0 - m)
  # Values masked before the products: a later row's NaN must not reach an earlier segment.
  y1, y2 = jnp.where(ok, y1, 0.0), jnp.where(ok, y2, 0.0)
  return (
    m,
    a0 * s0 + jnp.sum(e * y1, axis=0, keepdims=True),
    b0 * s0 + jnp.sum(e * y2, axis=0, keepdims=True),
  )


def fold(m_ref, s1_ref, s2_ref, take):
  """The combine of the segment totals [n_pad, bd] (m, s1, s2) whose index ``take`` accepts
  (``take(index [FOLD, 1]) -> bool``), ``FOLD`` at a time: a triple [1, bd] each."""
  bd = m_ref.shape[1]

  def step(i, carry):
    idx = rows(i, FOLD)
    ok = take(i * FOLD + jax.lax.broadcasted_iota(jnp.int32, (FOLD, 1), 0))
    return _combine_block(carry, m_ref[idx, :], s1_ref[idx, :], s2_ref[idx, :], ok)

  return jax.lax.fori_loop(0, m_ref.shape[0] // FOLD, step, empty(bd))


def _totals_kernel(*refs, bt: int, seg: int, kind: str, skip: int, limit: int):
  """One (batch row, channel block, segment s): the triple of the segment's rows
  [s seg, (s + 1) seg) with skip <= row < limit. ``kind`` "keys": refs k, v, terms exp(k) v and
  exp(k); "cotangent": refs L, g, a, terms exp(-L) g and exp(-L) g a (the backward's suffix
  sums over later queries)."""
  *ins, m_ref, s1_ref, s2_ref = refs
  s = pl.program_id(2)
  bd = ins[0].shape[1]

  def chunk(i, carry):
    j = s * (seg // bt) + i
    idx = rows(j, bt)
    row = j * bt + jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    ok = (row >= skip) & (row < limit)
    x, y1 = pallas_util.load(ins[0], idx), pallas_util.load(ins[1], idx)
    if kind == "keys":
      return _combine_block(carry, x, y1, jnp.ones_like(y1), ok)
    return _combine_block(carry, -x, y1, y1 * pallas_util.load(ins[2], idx), ok)

  m, s1, s2 = jax.lax.fori_loop(0, seg // bt, chunk, empty(bd))
  m_ref[...], s1_ref[...], s2_ref[...] = m, s1, s2


def n_pad(n_seg: int) -> int:
  """The totals' rows: n_seg rounded up to whole ``FOLD`` blocks (the rest never read)."""
  return -(-n_seg // FOLD) * FOLD


def totals(
  ins, kind: str, plan: LaunchPlan, n_seg: int, interpret: bool, skip: int = 0, limit=None
):
  """The segment totals (m, s1, s2), each [B, n_pad, D] float32 (rows >= n_seg unwritten), of
  ins = (k, v) or (L, g, a), [B, n, D] arrays whose rows [s seg, (s + 1) seg) are segment s
  (``_totals_kernel``)."""
  b, n, d = ins[0].shape
  cfg = plan.cfg
  col = pl.BlockSpec((None, n, cfg.block_d), lambda i, j, s: (i, 0, j))
  one = pl.BlockSpec((None, 1, cfg.block_d), lambda i, j, s: (i, s, j))
  limit = n if limit is None else limit
  kernel = functools.partial(
    _totals_kernel, bt=cfg.block_t, seg=plan.seg, kind=kind, skip=skip, limit=limit
  )
  out = jax.ShapeDtypeStruct((b, n_pad(n_seg), d), jnp.float32)
  return pallas_util.call(
    kernel, cfg, interpret, grid(b, d, plan, n_seg), [col] * len(ins), [one] * 3, [out] * 3, ins
  )
