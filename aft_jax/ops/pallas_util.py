"""What the Pallas GPU kernels (``pallas_simple``, ``pallas_local``) share: the block
configurations, the choice among them, the Triton call, and small in-kernel helpers
(``pad_time`` also serves the TPU kernel, ``pallas_simple_tpu``).

Every kernel runs one program per (batch row, block of ``block_d`` channels) and walks the
sequence in chunks of ``block_t`` positions, so one configuration type serves them all.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from aft_jax.ops.logsumexp import HIGHEST


class Config(NamedTuple):
  """A kernel configuration: positions per chunk, channels per program, Triton warps and
  pipeline stages. Triton's matrix products need both block sizes >= 16 (powers of two)."""

  block_t: int = 16
  block_d: int = 64
  num_warps: int = 4
  num_stages: int = 1


# Every configuration ``config_for`` can choose (the cross-lowering tests export each).
CONFIGS = tuple(Config(block_d=bd) for bd in (64, 32, 16))


def unsupported_channels(d: int) -> str | None:
  """Why a kernel cannot tile D = d channels, or None if it can."""
  if d % CONFIGS[-1].block_d:
    return f"the channel dim D = {d} is not a multiple of {CONFIGS[-1].block_d} (the kernel's tile)"
  return None


def config_for(d: int, batch: int = 1, min_programs: int = 256) -> Config:
  """The configuration for ``batch`` rows of D = d channels: the widest channel block that
  divides d and still gives ``min_programs`` programs (each walks T sequentially, so a GPU
  needs many of them: a few per streaming multiprocessor), else the narrowest that divides d."""
  fits = [cfg for cfg in CONFIGS if d % cfg.block_d == 0]
  if not fits:
    raise ValueError(f"Pallas kernel: {unsupported_channels(d)}")
  for cfg in fits:
    if batch * (d // cfg.block_d) >= min_programs:
      return cfg
  return fits[-1]


def call(kernel, cfg: Config, interpret: bool, grid, in_specs, out_specs, out_shape, ins):
  """``pl.pallas_call``, with Triton's compiler parameters unless interpreted (without them
  the GPU lowering would be Mosaic GPU, which lacks the kernels' cumsum and dot_general)."""
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton as plt

    params["compiler_params"] = plt.CompilerParams(
      num_warps=cfg.num_warps, num_stages=cfg.num_stages
    )
  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    interpret=interpret,
    **params,
  )(*ins)


def all_true(cond):
  """True where every element of the 2-D bool ``cond`` is (Triton has no reduce_and)."""
  return jnp.min(jnp.min(jnp.where(cond, 1.0, 0.0), axis=1), axis=0) > 0.5


def dot(x, y, trans_x: bool = False, trans_y: bool = False):
  """float32 matrix product x @ y, of x^T or y^T where asked (no TF32 passes: the factors of
  exact sums)."""
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
