"""What every op shares besides its maths: its arguments checked, its implementation chosen for
the device the program is lowered for (``resolve``), its kernel or XLA code called, and an eager
call run as one program.

The device (``device_facts``) is the one the computation is lowered for, not the host's: the
abstract mesh in context (``jax.set_mesh``, ``use_abstract_mesh``: its device kind), else the
devices of a ``with mesh:`` block (real, or a deviceless topology's, which know their compute
capability), else the default backend's first device. XLA refuses Triton custom calls below
compute capability 8.0, so a T4, V100 or P100 takes the XLA path; an abstract device carries no
capability, so it is read from ``CAPABILITIES`` by its kind (or a local device of that kind).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")
TRITON_MIN_CAPABILITY = (8, 0)
# The custom call a compiled kernel lowers to, per platform: how a lowered or compiled
# program's text shows that it holds the kernels.
KERNEL_CALLS = {"gpu": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
# Compute capability by a substring of the device kind (NVIDIA's table): first match wins.
CAPABILITIES = (
  *(("GH200", (9, 0)), ("H200", (9, 0)), ("H100", (9, 0)), ("H800", (9, 0))),
  *(("B200", (10, 0)), ("B100", (10, 0)), ("A100", (8, 0)), ("A800", (8, 0))),
  *(("A10", (8, 6)), ("A40", (8, 6)), ("L40", (8, 9)), ("L4", (8, 9))),
  *(("RTX 4090", (8, 9)), ("RTX 3090", (8, 6)), ("V100", (7, 0)), ("T4", (7, 5))),
  ("P100", (6, 0)),
)


# --------------------------------------------------------------------------- the device


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
  """jax's platform ('cpu', 'gpu', 'tpu'), the device kind, and a GPU's compute capability
  (None where not known)."""

  platform: str
  device_kind: str
  compute_capability: tuple[int, int] | None = None

  def __str__(self) -> str:
    cc = self.compute_capability
    return self.device_kind + (f" (compute capability {cc[0]}.{cc[1]})" if cc else "")


def _capability(device) -> tuple[int, int] | None:
  major, _, minor = str(getattr(device, "compute_capability", None) or "").partition(".")
  return (int(major), int(minor or 0)) if major else None


def capability_of_kind(device_kind: str) -> tuple[int, int] | None:
  """A GPU kind's compute capability: a local device of that kind's, else ``CAPABILITIES``'."""
  try:
    local = [_capability(d) for d in jax.local_devices() if d.device_kind == device_kind]
  except RuntimeError:  # no backend could start
    local = []
  if local and local[0]:
    return local[0]
  return next((cc for name, cc in CAPABILITIES if name.lower() in device_kind.lower()), None)


def device_facts(device=None) -> DeviceFacts:
  """The facts of ``device`` (a concrete one), by default of the device the computation being
  traced is for (module docstring)."""
  mesh = jax.sharding.get_abstract_mesh()
  abstract = getattr(mesh, "abstract_device", None)
  if device is None and abstract is not None and not mesh.empty:
    device = abstract
  if device is None:
    try:  # a ``with mesh:`` block's devices (jax keeps them in a private module)
      from jax._src import mesh as mesh_lib

      physical = mesh_lib.thread_resources.env.physical_mesh
      device = None if physical.empty else physical.devices.flat[0]
    except (ImportError, AttributeError):
      pass
  device = jax.devices()[0] if device is None else device
  platform = {"cuda": "gpu", "rocm": "gpu"}.get(device.platform, device.platform)
  cc = None
  if platform == "gpu":
    cc = _capability(device) or capability_of_kind(device.device_kind)
  return DeviceFacts(platform, device.device_kind, cc)


def triton_missing() -> str | None:
  """Why this jax cannot build Pallas Triton kernels (deprecated from jax 0.11), or None."""
  try:
    from jax.experimental.pallas import triton as plt

    plt.CompilerParams  # noqa: B018
  except (ImportError, AttributeError) as e:
    return f"jax {jax.__version__} has no Pallas Triton backend ({type(e).__name__}: {e})"
  return None


def gpu_kernels_refused(device: DeviceFacts) -> str | None:
  """Why Pallas' Triton kernels cannot run on the GPU ``device``, or None if they can."""
  cc = device.compute_capability
  if cc is None:
    return f"the compute capability of {device.device_kind!r} is not known"
  if cc < TRITON_MIN_CAPABILITY:
    need = ".".join(map(str, TRITON_MIN_CAPABILITY))
    return f"XLA compiles Triton kernels only for compute capability {need} (Ampere) and up"
  return triton_missing()


# --------------------------------------------------------------------------- the implementation


class Kernel(NamedTuple):
  """An op's Pallas kernel: the ``platform`` it compiles for ('gpu': Triton, 'tpu': Mosaic);
  ``mean(k, v, w, window, interpret)`` -> the op's weighted mean ``[B, T, D]`` float32 of k, v
  ``[B, T, D]`` (read in their own dtype; w the bias in the compute dtype, or None);
  ``unsupported(channels, window)``: why it cannot take them, or None; ``auto``: whether
  ``impl="auto"`` takes it (the TPU kernel has never been timed on a TPU: opt-in)."""

  platform: str
  mean: Callable
  unsupported: Callable
  auto: bool = True


_SAID: set[str] = set()  # the warnings given in this process (each once)


def _problem(kernel: Kernel, causal, channels, window, device) -> str | None:
  """Why ``kernel`` cannot run these arguments on ``device`` (None: interpreted), or None."""
  why = None if causal else "the kernel is for causal=True"
  why = why or kernel.unsupported(channels, window)
  if why is None and device is not None and kernel.platform == "gpu":
    refused = gpu_kernels_refused(device)
    why = refused and f"on {device}, {refused}"
  return why


def resolve(fn, impl, kernels, *, causal, channels, window=None, forward=False, device=None):
  """The kernel of ``kernels`` (an op's) that ``impl`` runs, or None for XLA:

      "xla"               the op's jax.numpy code;
      "auto"              the kernel for ``device`` (default ``device_facts()``) where it takes
                          these arguments and is ``auto``, else XLA (and forward mode: XLA);
      "pallas"            that kernel, compiled; "pallas_interpret" the first (GPU) one in
                          Pallas' interpreter on any backend;

  and a ValueError naming why, never a silent switch to XLA, where the kernel asked for cannot
  run (no kernel, the arguments, the device, ``forward`` mode: a kernel is a custom VJP)."""
  check_impl(fn, impl)
  if impl == "xla" or (impl == "auto" and (not kernels or forward)):
    return None
  device = None if impl == "pallas_interpret" else device or device_facts()
  here = [k for k in kernels if device is None or k.platform == device.platform]
  kernel = (here or kernels or [None])[0]
  if impl == "auto":
    if not here or not kernel.auto or _problem(kernel, causal, channels, window, None):
      return None
    why = _problem(kernel, causal, channels, window, device)
    if why and triton_missing() and why not in _SAID:  # this jax cannot build it: said once
      _SAID.add(why)
      warnings.warn(f"aft_jax.ops: impl='auto' takes the XLA path: {why}", RuntimeWarning, 4)
    return None if why else kernel
  why = "there is no Pallas kernel for this op" if kernel is None else None
  why = why or _problem(kernel, causal, channels, window, device if here else None)
  if why:
    raise ValueError(f"{fn}: impl={impl!r} is not available: {why}; use impl='xla'")
  if not here:
    raise ValueError(
      f"{fn}: impl='pallas' compiles this op's kernel for {tuple(k.platform for k in kernels)}, "
      f"not for the {device.platform!r} platform ({device}); use impl='xla', or "
      "'pallas_interpret' to run the GPU kernel in Pallas' interpreter"
    )
  if forward:
    raise ValueError(
      f"{fn}: impl={impl!r} has no forward-mode derivative (jax.jvp, jax.jacfwd, jax.hessian): "
      "its Pallas kernel defines only reverse mode (a custom_vjp); use impl='xla'"
    )
  return kernel


def forward_mode(*xs) -> bool:
  """Whether any of ``xs`` is being differentiated in forward mode (a ``jax.jvp`` tracer among
  its tracers, under vmap, jit or grad too), which a kernel's custom VJP cannot serve."""

  def jvp(x):
    while isinstance(x, jax.core.Tracer):
      if isinstance(x, ad.JVPTracer):
        return True
      x = getattr(x, "primal", getattr(x, "val", None))
    return False

  return any(jvp(x) for x in xs)


def mean(kernel: Kernel | None, impl: str, xla, k, v, w=None, window=None):
  """The op's weighted mean: ``xla(k, v, w)``, or ``kernel``'s of k, v ``[..., T, D]``
  flattened to ``[B, T, D]``; for ``impl="auto"`` both, the kernel on its platform
  (``jax.lax.platform_dependent``: one exported module holds both, a lowering for another
  platform takes XLA)."""
  if kernel is None:
    return xla(k, v, w)

  def pallas(k, v, w):
    flat = lambda x: x.reshape((-1,) + x.shape[-2:])
    out = kernel.mean(flat(k), flat(v), w, window, impl == "pallas_interpret")
    return out.reshape(k.shape)

  if impl != "auto":
    return pallas(k, v, w)
  platform = {"gpu": "cuda"}.get(kernel.platform, kernel.platform)
  return jax.lax.platform_dependent(k, v, w, default=xla, **{platform: pallas})


def dtypes(*xs):
  """(output dtype, compute dtype): bfloat16 and float16 are computed in float32."""
  dt = jnp.result_type(*xs)
  return dt, jnp.promote_types(dt, jnp.float32)


# --------------------------------------------------------------------------- the arguments


def array(fn, name, x):
  """x as an array: an array (or tracer) as it is, an array-like (a nested list) converted; a
  ValueError naming ``name`` where it is not one."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return x
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError) as e:
    why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
    raise ValueError(f"{fn}: {name} must be an array; got {type(x).__name__} ({why})") from None


def check_float(fn, **arrays):
  """ValueError unless every array is real floating point (an int, bool or complex input would be
  computed in float32 and cast back)."""
  for name, x in arrays.items():
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise ValueError(
        f"{fn}: {name} must be a real floating-point array; got {name} "
        f"{jnp.result_type(x).name} {jnp.shape(x)}"
      )


def check_qkv(fn, q, k, v):
  """q, k, v ``[..., T, D]`` of one shape, real floating point; as arrays."""
  q, k, v = (array(fn, n, x) for n, x in (("q", q), ("k", k), ("v", v)))
  check_float(fn, q=q, k=k, v=v)
  if q.ndim < 2:
    raise ValueError(f"{fn}: q must be [..., T, D], got shape {q.shape}")
  if k.shape != q.shape or v.shape != q.shape:
    raise ValueError(
      f"{fn}: q, k and v must have the same shape [..., T, D]; got q {q.shape}, "
      f"k {k.shape}, v {v.shape}"
    )
  return q, k, v


def check_window(fn: str, window) -> None:
  """ValueError (naming ``fn``) unless ``window`` is an int >= 1 (a bool is not a window)."""
  if not isinstance(window, int) or isinstance(window, bool) or window < 1:
    raise ValueError(f"{fn}: window must be an int >= 1, got {window!r}")


def check_impl(fn: str, impl) -> None:
  if impl not in IMPLS:
    raise ValueError(f"{fn}: impl must be one of {IMPLS}, got {impl!r}")


def _zero(offset) -> bool:
  return offset is None or (
    isinstance(offset, int) and not isinstance(offset, bool) and offset == 0
  )


def check_mode(fn, causal, impl, **given) -> str:
  """The mode of a call: "sharded" (``axis_name``), "packed" (``segment_ids``, ``positions``),
  "piece" (causal, with ``initial_state``, ``output_final_state`` or a non-zero ``offset``) or
  "whole"; a ValueError where ``causal`` is not a bool, ``impl`` is not one of ``IMPLS``, those
  arguments go to a non-causal op, or packed rows or a sharded call get a state or an offset."""
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"{fn}: causal must be a bool (True or False), got {causal!r}")
  check_impl(fn, impl)
  used = [
    n
    for n, x in given.items()
    if x is not None and x is not False and (n != "offset" or not _zero(x))
  ]
  if used and not causal:
    raise ValueError(
      f"{fn}: {', '.join(used)} need causal=True (a non-causal output depends on every "
      "position: there is no state of the past to carry)"
    )
  piece = {"initial_state", "output_final_state", "offset"}
  if given.get("axis_name") is not None:
    if piece & set(used) - {"offset"} or "segment_ids" in used:
      raise ValueError(
        f"{fn}: axis_name (T sharded over devices) does not take initial_state, "
        "output_final_state or segment_ids: the devices' shards are one whole sequence"
      )
    if "positions" in used or "offset" in used:
      raise ValueError(f"{fn}: axis_name does not take positions or an offset")
    return "sharded"
  if "segment_ids" in used or "positions" in used:
    if piece & set(used):
      raise ValueError(
        f"{fn}: segment_ids/positions (packed rows) do not take initial_state, "
        "output_final_state or offset: a packed row is whole documents"
      )
    return "packed"
  return "piece" if piece & set(used) else "whole"


def check_segments(fn, lead, **ids):
  """ValueError unless each of ``ids`` (segment_ids, positions) is None or an int ``[..., T]``
  array of shape ``lead`` (q's without its channels)."""
  for name, x in ids.items():
    if x is not None and (
      not jnp.issubdtype(jnp.result_type(x), jnp.integer) or jnp.shape(x) != tuple(lead)
    ):
      raise ValueError(
        f"{fn}: {name} must be an int array [..., T] = {tuple(lead)}; got {name} "
        f"{jnp.result_type(x).name} {jnp.shape(x)}"
      )


def check_state(fn, initial_state, init):
  """ValueError unless ``initial_state`` (None: nothing to check) has the structure, shapes and
  dtypes of the state ``init()`` returns: floating-point leaves, an int (not bool) ``index``."""
  if initial_state is None:
    return
  expected = jax.eval_shape(init)
  want = jax.tree.map(lambda x: x.shape, expected)
  try:
    got = jax.tree.map(jnp.shape, initial_state)
    same = jax.tree.structure(got) == jax.tree.structure(want) and got == want
  except (TypeError, ValueError):
    same, got = False, type(initial_state).__name__
  if not same:
    raise ValueError(
      f"{fn}: initial_state must be the state of these inputs, {type(expected).__name__} with "
      f"shapes {want}; got {got}"
    )
  paths = jax.tree_util.tree_flatten_with_path(expected)[0]
  for (path, spec), leaf in zip(paths, jax.tree.leaves(initial_state)):
    kind = jnp.floating if jnp.issubdtype(spec.dtype, jnp.floating) else jnp.integer
    if not jnp.issubdtype(jnp.result_type(leaf), kind):  # (a bool is neither)
      raise ValueError(
        f"{fn}: initial_state{jax.tree_util.keystr(path)} must be "
        f"{'floating-point' if kind is jnp.floating else 'an int'} (as the op's state, "
        f"{spec.dtype.name}); got {jnp.result_type(leaf).name}"
      )


# --------------------------------------------------------------------------- the eager call


def _static(x) -> bool:
  return x is None or isinstance(x, (bool, int, str))


def eager(run, **kwargs):
  """``run(**kwargs)``. Called on concrete arrays (not inside jit, grad, vmap or shard_map), as
  one jitted program per shape, static argument and device (``device_facts()``, what
  ``impl="auto"`` reads) instead of one compile per primitive."""
  data = {n: x for n, x in kwargs.items() if not _static(x)}
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(data)):
    return run(**kwargs)
  static = tuple((n, x) for n, x in kwargs.items() if _static(x))
  return _program(run, static, device_facts(), data)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _program(run, static, _device, data):
  return run(**dict(static), **data)
