"""The device a computation is lowered for, and whether Pallas' GPU kernels can run on it.

``impl="auto"`` must choose for the device the program will run on, which is not always the
host's: ``jax.export(..., platforms=["cuda"])`` and a deviceless compile for a named GPU
(``aft_jax.deviceless``) both run on a CPU machine. ``current()`` looks, in order, at

1. the abstract mesh in context (``jax.set_mesh(mesh)``, ``jax.sharding.use_abstract_mesh``),
   whose ``AbstractDevice`` names a device kind ("NVIDIA H200", "Tesla T4", "TPU v5 lite");
2. the mesh of a ``with mesh:`` block (the trainer's), whose devices are concrete: real ones,
   or a deviceless topology's, which know their compute capability;
3. the default backend's first device.

A GPU's compute capability decides the rest: XLA refuses Triton custom calls below 8.0
(``FAILED_PRECONDITION: Triton support is only enabled for Ampere GPUs (compute capability 8.0)
and up``; jax-ml/jax#26799), so a T4, V100 or P100 (Colab's free tier, many lab GPUs) must take
the XLA path. An abstract device carries no capability, so it is read from ``CAPABILITIES`` by
its device kind, or from a local device of the same kind.
"""

from __future__ import annotations

import dataclasses

import jax

# Pallas' Triton kernels need this compute capability or newer (XLA's rule, module docstring).
TRITON_MIN_CAPABILITY = (8, 0)
# The custom call a Pallas Triton kernel lowers to (jaxlib 0.10): how a lowered or compiled
# program's text shows that it holds the kernels.
TRITON_CALL = "__gpu$xla.gpu.triton"

# Compute capability by a substring of the device kind (NVIDIA's published table), for abstract
# devices, which name a kind but carry no capability. First match wins: longer names first.
CAPABILITIES = (
  ("GH200", (9, 0)),
  ("H200", (9, 0)),
  ("H100", (9, 0)),
  ("H800", (9, 0)),
  ("B200", (10, 0)),
  ("B100", (10, 0)),
  ("A100", (8, 0)),
  ("A800", (8, 0)),
  ("A10", (8, 6)),
  ("A40", (8, 6)),
  ("L40", (8, 9)),
  ("L4", (8, 9)),
  ("RTX 4090", (8, 9)),
  ("RTX 3090", (8, 6)),
  ("V100", (7, 0)),
  ("T4", (7, 5)),
  ("P100", (6, 0)),
)


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
  """What ``impl="auto"`` decides from about the device a program is lowered for: jax's
  platform ('cpu', 'gpu', 'tpu'), the device kind, and for GPUs the compute capability (None
  where it is not known)."""

  platform: str
  device_kind: str
  compute_capability: tuple[int, int] | None = None

  def __str__(self) -> str:
    cc = self.compute_capability
    return self.device_kind + (f" (compute capability {cc[0]}.{cc[1]})" if cc else "")


def _capability(device) -> tuple[int, int] | None:
  cc = getattr(device, "compute_capability", None)
  if not cc:
    return None
  major, _, minor = str(cc).partition(".")
  return int(major), int(minor or 0)


def capability_of_kind(device_kind: str) -> tuple[int, int] | None:
  """The compute capability of a GPU named ``device_kind``: a local device of that kind's, else
  ``CAPABILITIES``'; None for a kind neither knows."""
  try:
    local = [d for d in jax.local_devices() if d.device_kind == device_kind]
  except RuntimeError:  # no backend could start: only the table can answer
    local = []
  if local and _capability(local[0]):
    return _capability(local[0])
  for name, cc in CAPABILITIES:
    if name.lower() in device_kind.lower():
      return cc
  return None


def _platform(name: str) -> str:
  return "gpu" if name in ("cuda", "rocm", "gpu") else name


def of_device(device) -> DeviceFacts:
  """The DeviceFacts of a concrete device (a real one or a deviceless topology's)."""
  platform = _platform(device.platform)
  cc = _capability(device) if platform == "gpu" else None
  if platform == "gpu" and cc is None:
    cc = capability_of_kind(device.device_kind)
  return DeviceFacts(platform, device.device_kind, cc)


def _context_mesh_device():
  """The first device of a ``with mesh:`` block, or None (jax keeps it in a private module,
  so any change there means: no such block)."""
  try:
    from jax._src import mesh as mesh_lib

    mesh = mesh_lib.thread_resources.env.physical_mesh
  except (ImportError, AttributeError):
    return None
  return None if mesh.empty else mesh.devices.flat[0]


def current() -> DeviceFacts:
  """The device the computation being traced is for (module docstring: the order)."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  # (jax < 0.9's abstract device has no platform: the concrete mesh's device says it there)
  if device is not None and not mesh.empty and hasattr(device, "platform"):
    platform = _platform(device.platform)
    cc = capability_of_kind(device.device_kind) if platform == "gpu" else None
    return DeviceFacts(platform, device.device_kind, cc)
  concrete = _context_mesh_device()
  return of_device(concrete if concrete is not None else jax.devices()[0])


def triton_missing() -> str | None:
  """Why this jax cannot build Pallas Triton kernels, or None if it can (the backend is
  deprecated from jax 0.11 and is to be removed)."""
  try:
    from jax.experimental.pallas import triton as plt

    plt.CompilerParams  # noqa: B018 (the attribute the kernels need)
  except (ImportError, AttributeError) as e:
    return f"jax {jax.__version__} has no Pallas Triton backend ({type(e).__name__}: {e})"
  return None


def gpu_kernels_refused(target: DeviceFacts) -> str | None:
  """Why Pallas' Triton kernels cannot run on the GPU ``target``, or None if they can."""
  cc = target.compute_capability
  if cc is None:
    return f"the compute capability of {target.device_kind!r} is not known"
  if cc < TRITON_MIN_CAPABILITY:
    need = ".".join(map(str, TRITON_MIN_CAPABILITY))
    return f"XLA compiles Triton kernels only for compute capability {need} (Ampere) and up"
  return triton_missing()
