"""The dispatch table of the ops: each op's implementations, and the one choice among them.

``TABLE[op]`` lists the op's implementations (``Impl``), XLA first, then its Pallas kernels
(the GPU kernel first: it is the one ``"pallas_interpret"`` runs). ``resolve`` turns an op's
``impl`` argument into a ``Choice``, asking each entry's ``supports(args, device)`` (None, or
why it cannot run); a new kernel is one more entry. The rules:

    "xla"               the jax.numpy code (``banded``, ``causal_mean``, ``conv``).
    "pallas"            the op's kernel compiled for the accelerator: on GPU (Triton) causal
                        AFT-simple (``pallas_simple``) and causal AFT-local (``pallas_local``);
                        on TPU (Mosaic) causal AFT-simple (``pallas_simple_tpu``), channels a
                        multiple of 128.
    "pallas_interpret"  the GPU kernel run by Pallas' interpreter on any backend (slow, for
                        tests; the TPU kernel's interpreted form is
                        ``pallas_simple_tpu.causal_mean(..., interpret=True)``).
    "auto"              Pallas where a kernel exists for the op, the device and the channel
                        count, XLA otherwise.

The device is the one the computation is lowered for (``target.current()``: an abstract mesh's
device kind, a ``with mesh:`` block's devices, else the default backend), not the host: GPU
kernels need compute capability 8.0 (XLA refuses Triton below it: a T4 takes XLA), and
``"auto"`` wraps them in ``jax.lax.platform_dependent`` so a lowering for any other platform
takes XLA (one exported module holds both). On TPU ``"auto"`` is XLA: the TPU kernel lowers and
is tested in interpret mode but has never been timed on a TPU, so ``"pallas"`` opts in to it.
Where jax has no Pallas Triton backend, ``"auto"`` takes XLA with one warning. The choice
changes results only by float rounding. Asking for a kernel that does not exist (an op without
one, ``"pallas"`` on a CPU, AFT-local on a TPU, a GPU below compute capability 8.0, a channel
count the kernel cannot tile) is a ValueError, never a silent switch to XLA.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax

from aft_jax.ops import impls, target
from aft_jax.ops.impls import OpArgs

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")

NO_KERNEL = "there is no Pallas kernel for this op"

# ``jax.lax.platform_dependent``'s name of a platform a kernel compiles for (Triton: CUDA only).
LOWERING = {"gpu": "cuda"}


class Impl(NamedTuple):
  """One implementation of an op.

  run: ``run(args: OpArgs, interpret: bool) -> Y``, the op's output.
  supports: ``supports(args, device) -> None | str``: None where ``run`` can take ``args`` on
    ``device`` (a ``target.DeviceFacts``; None: any device, interpreted), else why not (the
    ValueError of an explicit request says it verbatim).
  platform: the platform it is compiled for ('gpu', 'tpu'); None for XLA (every platform).
  auto: whether ``impl="auto"`` takes it where it is supported.
  missing: why this jax cannot build it, or None (a function); ``"auto"`` warns once when that
    is why it took XLA.
  """

  name: str
  run: Callable
  supports: Callable
  platform: str | None = None
  auto: bool = False
  missing: Callable[[], str | None] | None = None


XLA = {
  op: Impl("xla", run, impls.supports_all)
  for op, run in (
    ("aft_simple", impls.xla_simple),
    ("aft_local", impls.xla_banded),
    ("aft_full", impls.xla_banded),
    ("aft_conv1d", impls.xla_conv1d),
    ("aft_conv2d", impls.xla_conv2d),
  )
}

TRITON_SIMPLE = Impl(
  "triton", impls.triton_simple, impls.triton_simple_supports, "gpu", True, target.triton_missing
)
# Never timed on a TPU, so "auto" does not take it: impl="pallas" opts in.
MOSAIC_SIMPLE = Impl("mosaic", impls.mosaic_simple, impls.mosaic_simple_supports, "tpu")
TRITON_LOCAL = Impl(
  "triton", impls.triton_local, impls.triton_local_supports, "gpu", True, target.triton_missing
)

TABLE: dict[str, tuple[Impl, ...]] = {
  "aft_simple": (XLA["aft_simple"], TRITON_SIMPLE, MOSAIC_SIMPLE),
  "aft_local": (XLA["aft_local"], TRITON_LOCAL),
  "aft_full": (XLA["aft_full"],),
  "aft_conv1d": (XLA["aft_conv1d"],),
  "aft_conv2d": (XLA["aft_conv2d"],),
}


class Choice(NamedTuple):
  """A resolved ``impl``: ``impl`` (interpreted or compiled); with a ``fallback``, ``impl`` on
  its platform and ``fallback`` on any other the program is lowered for (one exported module
  holds both: ``jax.lax.platform_dependent``). ``warning``: what the ops say once, where "auto"
  took XLA because this jax cannot build a kernel (``Impl.missing``)."""

  impl: Impl
  interpret: bool = False
  fallback: Impl | None = None
  warning: str | None = None

  def __call__(self, args: OpArgs):
    """Y, the op's output for ``args``."""
    if self.fallback is None:
      return self.impl.run(args, self.interpret)
    platform = LOWERING.get(self.impl.platform, self.impl.platform)
    return jax.lax.platform_dependent(
      args,
      default=lambda a: self.fallback.run(a, False),
      **{platform: lambda a: self.impl.run(a, False)},
    )


def check_impl(fn: str, impl) -> None:
  """ValueError (naming ``fn``) unless ``impl`` is one of ``IMPLS``."""
  if impl not in IMPLS:
    raise ValueError(f"{fn}: impl must be one of {IMPLS}, got {impl!r}")


def resolve(fn: str, impl: str, args: OpArgs) -> Choice:
  """The implementation of op ``fn`` (a key of ``TABLE``) for ``impl`` and ``args`` on the
  device being lowered for (``target.current()``); a ValueError where an explicitly requested
  kernel cannot run, never a silent switch to XLA. No side effects (the caller gives
  ``Choice.warning``)."""
  check_impl(fn, impl)
  xla, *kernels = TABLE[fn]
  if impl == "xla" or (impl == "auto" and not kernels):
    return Choice(xla)
  if impl == "auto" and impls.in_forward_mode(args):
    return Choice(xla)  # the kernels have no forward-mode derivative
  if impl == "auto":
    device, warning = target.current(), None
    for k in kernels:
      if not k.auto or k.platform != device.platform or k.supports(args, None):
        continue
      why = k.supports(args, device)
      if why is None:
        return Choice(k, fallback=xla)
      if k.missing is not None and k.missing():
        warning = f"aft_jax.ops: impl='auto' takes the XLA path: {why}"
    return Choice(xla, warning=warning)
  if not kernels:
    raise ValueError(f"{fn}: impl={impl!r} is not available: {NO_KERNEL}; use impl='xla'")
  device = None if impl == "pallas_interpret" else target.current()
  here = [k for k in kernels if device is None or k.platform == device.platform]
  # No kernel for this platform: the arguments are still checked first (as the GPU kernel's).
  kernel = (here or kernels)[0]
  why = kernel.supports(args, device if here else None)
  if why:
    raise ValueError(f"{fn}: impl={impl!r} is not available: {why}; use impl='xla'")
  if not here:
    platforms = tuple(k.platform for k in kernels)
    raise ValueError(
      f"{fn}: impl='pallas' compiles this op's kernel for {platforms}, not for the "
      f"{device.platform!r} platform ({device}); use impl='xla', or 'pallas_interpret' to run "
      "the GPU kernel in Pallas' interpreter"
    )
  if impls.in_forward_mode(args):
    raise ValueError(f"{fn}: impl={impl!r} has no {impls.NO_FORWARD_MODE}; use impl='xla'")
  return Choice(kernel, interpret=device is None)


def describe_auto(device: target.DeviceFacts | None = None) -> str:
  """One line: what ``impl="auto"`` runs on ``device`` (default ``target.current()``), read
  from ``TABLE``: the ops whose kernel for its platform "auto" takes, and why XLA where none."""
  device = target.current() if device is None else device
  kernels = [(op, k) for op, (_, *ks) in TABLE.items() for k in ks if k.platform == device.platform]
  auto = [op for op, k in kernels if k.auto]
  if not kernels:
    return f"{device}: XLA (no compiled kernels for the {device.platform!r} platform)"
  if not auto:
    opt_in = ", ".join(op for op, _ in kernels)
    return (
      f"{device}: XLA (the {device.platform} kernels of causal {opt_in} are opt-in: impl='pallas')"
    )
  refused = target.gpu_kernels_refused(device) if device.platform == "gpu" else None
  if refused:
    return f"{device}: XLA ({refused})"
  return f"{device}: the Pallas kernels of causal {', '.join(auto)}; XLA for the other ops"
