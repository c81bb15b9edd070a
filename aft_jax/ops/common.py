"""What every op shares besides its maths: argument checks, the implementation chosen for the
device, the kernel or XLA call, eager calls as one program (docs/kernels.md, "impl")."""

import functools
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from aft_jax.ops import logsumexp as lse

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")
TRITON_MIN_CAPABILITY = (8, 0)
# The custom call a compiled kernel lowers to, per platform: how a program shows its kernels.
KERNEL_CALLS = {"gpu": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
# Compute capability by a substring of the device kind (NVIDIA's table): the first match wins.
CAPABILITIES = (
  ("GH200", (9, 0)), ("H200", (9, 0)), ("H100", (9, 0)), ("H800", (9, 0)), ("B200", (10, 0)),
  ("B100", (10, 0)), ("A100", (8, 0)), ("A800", (8, 0)), ("A10", (8, 6)), ("A40", (8, 6)),
  ("L40", (8, 9)), ("L4", (8, 9)), ("RTX 4090", (8, 9)), ("RTX 3090", (8, 6)), ("V100", (7, 0)),
  ("T4", (7, 5)), ("P100", (6, 0)),
)  # fmt: skip


class DeviceFacts(NamedTuple):
  """jax's platform ('cpu', 'gpu', 'tpu'), the device kind, a GPU's compute capability."""

  platform: str
  device_kind: str
  compute_capability: tuple[int, int] | None = None

  def __str__(self) -> str:
    cc = self.compute_capability
    return self.device_kind + (f" (compute capability {cc[0]}.{cc[1]})" if cc else "")


def capability_of_kind(device_kind: str, device=None) -> tuple[int, int] | None:
  try:
    local = [d for d in jax.local_devices() if d.device_kind == device_kind]
  except RuntimeError:  # no backend could start
    local = []
  for d in ([device] if device is not None else []) + local[:1]:
    major, _, minor = str(getattr(d, "compute_capability", None) or "").partition(".")
    if major:
      return int(major), int(minor or 0)
  return next((cc for name, cc in CAPABILITIES if name.lower() in device_kind.lower()), None)


def device_facts(device=None) -> DeviceFacts:
  """``device``'s facts; by default, of the device the traced computation is for."""
  mesh = jax.sharding.get_abstract_mesh()
  device = device or (None if mesh.empty else mesh.abstract_device) or jax.devices()[0]
  platform = {"cuda": "gpu", "rocm": "gpu"}.get(device.platform, device.platform)
  cc = capability_of_kind(device.device_kind, device) if platform == "gpu" else None
  return DeviceFacts(platform, device.device_kind, cc)


def triton_missing() -> str | None:  # why this jax cannot build Triton kernels (jax 0.11 on)
  try:
    from jax.experimental.pallas import triton as plt

    plt.CompilerParams  # noqa: B018
  except (ImportError, AttributeError) as e:
    return f"jax {jax.__version__} has no Pallas Triton backend ({type(e).__name__}: {e})"
  return None


def gpu_kernels_refused(device: DeviceFacts) -> str | None:
  cc = device.compute_capability
  if cc is None:
    return f"the compute capability of {device.device_kind!r} is not known"
  if cc < TRITON_MIN_CAPABILITY:
    need = ".".join(map(str, TRITON_MIN_CAPABILITY))
    return f"XLA compiles Triton kernels only for compute capability {need} (Ampere) and up"
  return triton_missing()


class Kernel(NamedTuple):  # an op's kernel
  platform: str
  mean: Callable  # (k, v[, w, window], interpret=...) -> [B, T, D] float32
  unsupported: Callable  # (channels, window) -> why not, or None
  auto: bool = True  # whether impl="auto" takes it


_SAID: set[str] = set()  # the warnings given in this process (each once)


def _problem(kernel: Kernel, causal, channels, window, device) -> str | None:
  why = None if causal else "the kernel is for causal=True"
  why = why or kernel.unsupported(channels, window)
  if why is None and device is not None and kernel.platform == "gpu":
    refused = gpu_kernels_refused(device)
    why = refused and f"on {device}, {refused}"
  return why


def resolve(fn, impl, kernels, *, causal, channels, window=None, forward=False, device=None):
  """The kernel ``impl`` runs on ``device`` (None: XLA); a ValueError where the one asked can't."""
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
  if not why and not here:
    why = (
      f"this op's kernel compiles for {tuple(k.platform for k in kernels)}, not for the "
      f"{device.platform!r} platform ({device}); 'pallas_interpret' runs the GPU kernel in "
      "Pallas' interpreter"
    )
  if not why and forward:
    why = (
      "it has no forward-mode derivative (jax.jvp, jax.jacfwd, jax.hessian): its Pallas kernel "
      "defines only reverse mode (a custom_vjp)"
    )
  if why:
    raise ValueError(f"{fn}: impl={impl!r} is not available: {why}; use impl='xla'")
  return kernel


def _has_jvp(x) -> bool:  # whether x carries a jax.jvp tracer (a kernel's custom VJP has none)
  while isinstance(x, jax.core.Tracer):
    if isinstance(x, ad.JVPTracer):
      return True
    x = getattr(x, "primal", getattr(x, "val", None))
  return False


def run(fn, kernels, impl, xla, q, k, v, w=None, *, causal, window=None):
  """Y = sigma(q) * the mean by ``xla(k, v, w, low)`` or ``impl``'s kernel ("auto": by platform)."""
  out_dt, dt = dtypes(q, k, v)
  if q.size == 0 or k.size == 0:
    return jnp.zeros(q.shape, out_dt)
  forward = any(_has_jvp(x) for x in (k, v, w))
  kernel = resolve(
    fn, impl, kernels, causal=causal, channels=q.shape[-1], window=window, forward=forward
  )
  w = None if w is None else jnp.asarray(w, dt)
  by_xla = lambda k, v, w: xla(k.astype(dt), v.astype(dt), w, out_dt == jnp.bfloat16)
  flat = lambda x: x.reshape((-1,) + x.shape[-2:])
  bias = lambda w: () if w is None else (w, window)
  interpret = impl == "pallas_interpret"
  mean = lambda k, v, w: kernel.mean(flat(k), flat(v), *bias(w), interpret=interpret)
  pallas = lambda k, v, w: mean(k, v, w).reshape(k.shape)
  if kernel is None:
    a = by_xla(k, v, w)
  elif impl != "auto":
    a = pallas(k, v, w)
  else:
    platform = {"gpu": "cuda"}.get(kernel.platform, kernel.platform)
    a = jax.lax.platform_dependent(k, v, w, default=by_xla, **{platform: pallas})
  return lse.gate(q.astype(dt), a.astype(dt)).astype(out_dt)


def rows(x):  # [..., T, D] -> [T, R], R = prod(...) D (free when there is no batch dim)
  return jnp.swapaxes(x.reshape((-1,) + x.shape[-2:]), 0, 1).reshape(x.shape[-2], -1)


def unrows(a, shape):  # ``rows``' inverse, back to ``shape`` [..., T, D]
  return jnp.swapaxes(a.reshape(shape[-2], -1, shape[-1]), 0, 1).reshape(shape)


def dtypes(*xs):  # (output dtype, compute dtype): bfloat16 and float16 are computed in float32
  dt = jnp.result_type(*xs)
  return dt, jnp.promote_types(dt, jnp.float32)


def array(fn, name, x):  # x as an array, else a ValueError naming ``name``
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return x
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError) as e:
    why = (str(e).splitlines() or [type(e).__name__])[0][:120]
    raise ValueError(f"{fn}: {name} must be an array; got {type(x).__name__} ({why})") from None


def check_arrays(fn, lead=None, **arrays):  # real floating point, or (lead) None or ints [..., T]
  for name, x in arrays.items():
    if x is None and lead is not None:
      continue
    dt, shape = jnp.result_type(x), jnp.shape(x)
    if lead is None and not jnp.issubdtype(dt, jnp.floating):
      raise ValueError(f"{fn}: {name} must be a real floating-point array; got {name} {dt} {shape}")
    if lead is not None and (not jnp.issubdtype(dt, jnp.integer) or shape != tuple(lead)):
      what = f"an int array [..., T] = {tuple(lead)}"
      raise ValueError(f"{fn}: {name} must be {what}; got {name} {dt} {shape}")


def check_qkv(fn, q, k, v):  # q, k, v ``[..., T, D]`` of one shape, real floating point; as arrays
  q, k, v = (array(fn, n, x) for n, x in (("q", q), ("k", k), ("v", v)))
  check_arrays(fn, q=q, k=k, v=v)
  if q.ndim < 2:
    raise ValueError(f"{fn}: q must be [..., T, D], got shape {q.shape}")
  if k.shape != q.shape or v.shape != q.shape:
    raise ValueError(
      f"{fn}: q, k and v must have the same shape [..., T, D]; got q {q.shape}, "
      f"k {k.shape}, v {v.shape}"
    )
  return q, k, v


def check_window(fn: str, window) -> int:
  """``window`` as an int; a ValueError unless it is an int >= 1 (a NumPy int is; a bool not)."""
  if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 1:
    raise ValueError(f"{fn}: window must be an int >= 1, got {window!r}")
  return int(window)


def check_impl(fn: str, impl) -> None:
  if impl not in IMPLS:
    raise ValueError(f"{fn}: impl must be one of {IMPLS}, got {impl!r}")


def check_mode(fn, causal, impl, **given) -> str:  # "sharded", "packed", "piece" or "whole"
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"{fn}: causal must be a bool (True or False), got {causal!r}")
  check_impl(fn, impl)
  zero = lambda x: isinstance(x, int) and not isinstance(x, bool) and x == 0
  used = [n for n, x in given.items() if x is not None and x is not False and not zero(x)]
  if used and not causal:
    raise ValueError(
      f"{fn}: {', '.join(used)} need causal=True (a non-causal output depends on every "
      "position: there is no state of the past to carry)"
    )
  piece = [n for n in ("initial_state", "output_final_state", "offset") if n in used]
  rows = [n for n in ("segment_ids", "positions") if n in used]
  if "axis_name" in used and piece + rows:
    raise ValueError(
      f"{fn}: axis_name (T sharded over devices) does not take {', '.join(piece + rows)}: the "
      "devices' shards are one whole sequence"
    )
  if rows and piece:
    raise ValueError(
      f"{fn}: segment_ids/positions (packed rows) do not take initial_state, "
      "output_final_state or offset: a packed row is whole documents"
    )
  return "sharded" if "axis_name" in used else "packed" if rows else "piece" if piece else "whole"


def check_state(fn, initial_state, init):  # ValueError unless None or shaped, typed as init()'s
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


def eager(run, traced=(), **kwargs):  # run(**kwargs); concrete arrays: one jit per static args
  static = lambda n, x: x is None or (n not in traced and isinstance(x, (bool, int, str)))
  data = {n: x for n, x in kwargs.items() if not static(n, x)}
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(data)):
    return run(**kwargs)
  fixed = tuple((n, x) for n, x in kwargs.items() if static(n, x))
  return _program(run, fixed, device_facts(), data)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _program(run, static, _device, data):
  return run(**dict(static), **data)
