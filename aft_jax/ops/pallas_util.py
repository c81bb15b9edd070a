"""What the Pallas GPU kernels (``pallas_simple``, ``pallas_local``) share: the block
configurations, the choice among them, the Triton call, and small in-kernel helpers. The two
AFT-simple kernels (GPU ``pallas_simple``, TPU ``pallas_simple_tpu``) also share the choice of
the widest channel block (``widest_config``), the padding of T to whole chunks and the custom
VJP around their forward and backward halves (``mean_with_vjp``).

Every kernel walks its positions in chunks of ``block_t``, one program per (batch row, block
of ``block_d`` channels[, segment of T]: the chunk-parallel form, ``pallas_split``, which also
chooses between the forms), so one configuration type serves them all.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from aft_jax.ops.logsumexp import HIGHEST, NEG, keep


class TritonConfig(NamedTuple):
  """A kernel configuration: positions per chunk, channels per program, Triton warps and
  pipeline stages. Triton's matrix products need both block sizes >= 16 (powers of two)."""

  block_t: int = 16
  block_d: int = 64
  num_warps: int = 4
  num_stages: int = 1


# Every configuration ``config_for`` can choose (the cross-lowering tests export each).
CONFIGS = tuple(TritonConfig(block_d=bd) for bd in (64, 32, 16))


def unsupported_channels(d: int) -> str | None:
  """Why a kernel cannot tile D = d channels, or None if it can."""
  if d % CONFIGS[-1].block_d:
    return f"the channel dim D = {d} is not a multiple of {CONFIGS[-1].block_d} (the kernel's tile)"
  return None


def widest_config(configs, d: int, batch: int, min_programs: int, why_not: str):
  """Of ``configs`` (widest ``block_d`` first), the widest whose channel block divides d and
  still gives ``min_programs`` (batch row, channel block) programs, else the narrowest that
  divides d; a ValueError saying ``why_not`` where none does."""
  fits = [cfg for cfg in configs if d % cfg.block_d == 0]
  if not fits:
    raise ValueError(why_not)
  for cfg in fits:
    if batch * (d // cfg.block_d) >= min_programs:
      return cfg
  return fits[-1]


def config_for(d: int, batch: int = 1, min_programs: int = 256) -> TritonConfig:
  """The sequential form's configuration for ``batch`` rows of D = d channels
  (``widest_config``): each program walks T sequentially, so a GPU needs many of them, a few
  per streaming multiprocessor (where B * D is too small for that, ``pallas_split.plan_for``
  splits T instead)."""
  why = f"Pallas kernel: {unsupported_channels(d)}"
  return widest_config(CONFIGS, d, batch, min_programs, why)


def mean_with_vjp(forward, backward):
  """The custom-VJP weighted mean of the AFT-simple kernels (GPU and TPU), a [B, T, D] of k, v
  (and the static cfg, interpret), from the kernels' two halves over T padded up to their
  chunks: ``forward(k, v, cfg, interpret, with_lse)`` -> a [and L]; ``backward(k, v, a, lse,
  g, cfg, interpret)`` -> dk, dv, g the cotangent padded with zeros. The residuals are a and L
  (padded) besides k and v."""

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
  """The normaliser L kept as a residual: the largest float32 on the rows that have no
  derivative (``logsumexp.keep``: after a NaN or an infinity), a weight exp(k - L) of 0 as the
  kernels' padding rows have, so that the backward kernels' sums over those rows are exact
  zeros (0 * NaN would reach every earlier input). Replaces L: no more memory."""
  return jnp.where(keep(a, lse), lse, -NEG)


def tamed_cotangent(a, lse, g):
  """(a, g) for the backward kernels, L from ``tamed_lse``: 0 on the rows without derivative
  (their output a may be NaN, and g * a enters the sums)."""
  ok = lse < -NEG
  return jnp.where(ok, a, 0.0), jnp.where(ok, g, 0.0)


def call(kernel, cfg: TritonConfig, interpret: bool, grid, in_specs, out_specs, out_shape, ins):
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
    out_shape=varying_like(out_shape, ins, interpret),
    interpret=interpret,
    **params,
  )(*ins)


def varying_like(out_shape, ins, interpret: bool):
  """``out_shape`` (ShapeDtypeStructs) varying over every manual mesh axis one of ``ins``
  varies over: inside ``jax.shard_map`` (``check_vma=True``, its default) a ``pallas_call`` is
  told how its outputs vary; elsewhere there are no such axes.

  Pallas' interpreter (jax 0.10.2) cannot run there: its loops over the grid and the kernels'
  own loops start from buffers that vary over no mesh axis, and the loop's type check refuses
  them. That is a ValueError here, in one line, instead of a scan error from inside Pallas."""
  axes = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in ins))
  if axes and interpret:
    raise ValueError(
      f"Pallas' interpreter cannot run inside jax.shard_map with check_vma=True (inputs vary "
      f"over mesh axes {sorted(axes)}); use impl='xla' there, or check_vma=False"
    )
  mat = jax.sharding.ManualAxisType(varying=axes)
  return [jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat) for s in out_shape]


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


def padded_to_chunks(k, v, block_t: int):
  """k, v [B, T, D] with T padded up to a multiple of block_t: keys ``pad_key`` (exp(key - m)
  = 0, so they change no sum), values 0."""
  t_pad = -k.shape[1] % block_t
  return pad_time(k, 0, t_pad, pad_key(k.dtype)), pad_time(v, 0, t_pad, 0.0)


def pad_key(dtype) -> float:
  """The key of a padding position: NEG where the keys' dtype holds it, else that dtype's lowest
  (in bfloat16, NEG, the lowest float32, would round to -inf, and -inf - -inf = NaN)."""
  return max(NEG, float(jnp.finfo(dtype).min))
