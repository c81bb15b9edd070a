"""What each implementation of an op runs, and what it supports: the entries of ``registry``.

Every entry runs ``run(args, interpret) -> Y`` for the op's arguments ``args`` (``OpArgs``) and
answers ``supports(args, device) -> None | str``: None where it can run them, else why not.
``device`` is the ``target.DeviceFacts`` the program is lowered for, or None for "any device, in
Pallas' interpreter" (the arguments alone: channel tiles, causality, window).

The kernels read k and v in their own dtype (bfloat16: half the memory traffic) and return the
weighted mean a [B, T, D] in float32; Y = sigma(q) * a in the compute dtype, cast to the output
dtype (precision policy: the ``aft_jax.ops`` docstring).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from aft_jax.ops import logsumexp as lse
from aft_jax.ops import (
  banded,
  causal_mean,
  conv,
  pallas_local,
  pallas_simple,
  pallas_simple_tpu,
  pallas_split,
  target,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OpArgs:
  """An op's arguments, checked: q, k, v ``[..., T, D]`` (AFT-conv: q, v ``[..., *S, H, C]``,
  k ``[..., *S, H]``); ``w`` the ``[T, T]`` bias (AFT-full, AFT-local), the ``[H, *s]`` kernel
  (AFT-conv) or None (AFT-simple). A pytree whose leaves are the arrays (``causal`` and
  ``window`` are static), so ``jax.lax.platform_dependent`` can carry it into each branch."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  w: jax.Array | None = None
  causal: bool = dataclasses.field(default=False, metadata={"static": True})
  window: int | None = dataclasses.field(default=None, metadata={"static": True})


# --------------------------------------------------------------------------- shared parts


def _dtypes(args: OpArgs):
  """(output dtype, compute dtype): bfloat16 and float16 are computed in float32."""
  dt = jnp.result_type(args.q, args.k, args.v)
  return dt, jnp.promote_types(dt, jnp.float32)


def _low(out_dtype) -> bool:
  """The precision policy: bfloat16 inputs take bfloat16 matrix-product factors with float32
  accumulation; float32 inputs keep float32 products (``logsumexp.matmul``)."""
  return out_dtype == jnp.bfloat16


def _cast(dt, *xs):
  return tuple(jnp.asarray(x, dt) for x in xs)


def _gated(args: OpArgs, mean, dt, out_dt):
  """Y = sigma(q) * mean, in the compute dtype ``dt``, returned as ``out_dt``."""
  return lse.gate(jnp.asarray(args.q, dt), mean.astype(dt)).astype(out_dt)


def _to_rows(x):
  """[..., T, D] -> [T, R] with R = prod(...) * D (free when there is no batch dim)."""
  t_len, d = x.shape[-2:]
  x = x.reshape((-1, t_len, d))
  return jnp.swapaxes(x, 0, 1).reshape(t_len, -1)


def _from_rows(x, shape):
  t_len, d = shape[-2:]
  x = jnp.swapaxes(x.reshape(t_len, -1, d), 0, 1)
  return x.reshape(shape)


def _kernel(args: OpArgs, mean):
  """Y from a kernel's ``mean(k, v, w)`` of k, v flattened to its [B, T, D] layout (read in
  their own dtype) and w in the compute dtype."""
  out_dt, dt = _dtypes(args)
  w = None if args.w is None else jnp.asarray(args.w, dt)
  flat = lambda x: x.reshape((-1,) + x.shape[-2:])
  a = mean(flat(args.k), flat(args.v), w)
  return _gated(args, a.reshape(args.k.shape), dt, out_dt)


def _causal(args: OpArgs) -> str | None:
  return None if args.causal else "the kernel is for causal=True"


def _compiled_for(platform: str, device) -> str | None:
  """Why a kernel compiled for ``platform`` cannot run on ``device`` (None: any device)."""
  if device is None or device.platform == platform:
    return None
  return (
    f"the kernel compiles for the {platform!r} platform, not for {device.platform!r} ({device})"
  )


def _triton_on(device) -> str | None:
  """Why a Triton kernel cannot run on ``device``: another platform, a GPU below compute
  capability 8.0, or a jax without Pallas' Triton backend (``target.gpu_kernels_refused``)."""
  why = _compiled_for("gpu", device)
  if why or device is None:
    return why
  refused = target.gpu_kernels_refused(device)
  return refused and f"on {device}, {refused}"


# Why a kernel cannot be differentiated in forward mode: its derivative is a custom VJP.
NO_FORWARD_MODE = (
  "forward-mode derivative (jax.jvp, jax.jacfwd, jax.hessian): its Pallas kernel defines "
  "only reverse mode (a custom_vjp)"
)


def in_forward_mode(args: OpArgs) -> bool:
  """Whether the kernel's inputs (k, v, w) are being differentiated in forward mode: a
  ``jax.jvp`` tracer among the tracers they are (under vmap, jit or grad as well), which a
  custom VJP cannot serve. (Forward mode applied to an already-traced ``jax.jit`` never
  reaches the op: JAX's own "can't apply forward-mode autodiff (jvp) to a custom_vjp
  function" says it then.)"""

  def forward(x):
    while isinstance(x, jax.core.Tracer):
      if isinstance(x, ad.JVPTracer):
        return True
      x = getattr(x, "primal", getattr(x, "val", None))  # grad's, vmap's inner value
    return False

  return any(forward(x) for x in (args.k, args.v, args.w))


def supports_all(args: OpArgs, device) -> None:
  """XLA runs every op's arguments on every device."""
  return None


# --------------------------------------------------------------------------- XLA


def xla_simple(args: OpArgs, interpret: bool):
  """AFT-simple: causal, the chunked prefix sums of ``causal_mean``; else w = 0, so one shift
  per channel (the max of k over T) is exact, which is what softmax does."""
  out_dt, dt = _dtypes(args)
  k, v = _cast(dt, args.k, args.v)
  if args.causal:
    mean = causal_mean.causal_mean(_to_rows(k), _to_rows(v), causal_mean.CHUNK, _low(out_dt))
    mean = _from_rows(mean, k.shape)
  else:
    mean = jnp.sum(jax.nn.softmax(k, axis=-2) * v, axis=-2, keepdims=True)
  return _gated(args, mean, dt, out_dt)


def xla_banded(args: OpArgs, interpret: bool):
  """AFT-local (``window``) or AFT-full (window None: every key) as ``banded.banded_mean``."""
  out_dt, dt = _dtypes(args)
  k, v, w = _cast(dt, args.k, args.v, args.w)
  k2, v2 = _to_rows(k), _to_rows(v)
  window = args.window or k2.shape[0]
  plan = banded.make_plan(k2.shape[0], k2.shape[1], window, args.causal, low=_low(out_dt))
  return _gated(args, _from_rows(banded.banded_mean(plan, k2, v2, w), k.shape), dt, out_dt)


def xla_conv1d(args: OpArgs, interpret: bool):
  out_dt, dt = _dtypes(args)
  return conv.conv1d(*_cast(dt, args.q, args.k, args.v, args.w), args.causal).astype(out_dt)


def xla_conv2d(args: OpArgs, interpret: bool):
  out_dt, dt = _dtypes(args)
  return conv.conv2d(*_cast(dt, args.q, args.k, args.v, args.w)).astype(out_dt)


# --------------------------------------------------------------------------- Pallas kernels


def triton_simple(args: OpArgs, interpret: bool):
  """Causal AFT-simple, ``pallas_simple`` (GPU, Triton)."""

  def mean(k, v, _):
    plan = pallas_split.plan_for(*k.shape)  # sequential or chunk-parallel
    return pallas_simple.causal_mean(k, v, plan.cfg, interpret, plan.seg)

  return _kernel(args, mean)


def triton_simple_supports(args: OpArgs, device) -> str | None:
  return _causal(args) or pallas_simple.unsupported(args.q.shape[-1]) or _triton_on(device)


def mosaic_simple(args: OpArgs, interpret: bool):
  """Causal AFT-simple, ``pallas_simple_tpu`` (TPU, Mosaic)."""

  def mean(k, v, _):
    # Compiled: the kernel's own configuration (the two-argument call, which tests spy on).
    tpu = pallas_simple_tpu
    return tpu.causal_mean(k, v, interpret=True) if interpret else tpu.causal_mean(k, v)

  return _kernel(args, mean)


def mosaic_simple_supports(args: OpArgs, device) -> str | None:
  return (
    _causal(args) or pallas_simple_tpu.unsupported(args.q.shape[-1]) or _compiled_for("tpu", device)
  )


def triton_local(args: OpArgs, interpret: bool):
  """Causal AFT-local, ``pallas_local`` (GPU, Triton)."""

  def mean(k, v, w):
    plan = pallas_local.plan_for(*k.shape, args.window)  # sequential or chunk-parallel
    return pallas_local.local_mean(k, v, w, args.window, plan.cfg, interpret, plan.seg)

  return _kernel(args, mean)


def triton_local_supports(args: OpArgs, device) -> str | None:
  return (
    _causal(args) or pallas_local.unsupported(args.q.shape[-1], args.window) or _triton_on(device)
  )
