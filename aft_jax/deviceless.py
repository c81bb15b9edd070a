"""Compiling for an accelerator that is not here (docs/scaling.md, "Does it fit my GPU?"): named
targets, their devices and the compiler plugins, each in its own folder, seen only by a process
started in ``environment(kind)``: python -m aft_jax.deviceless install [cuda] [tpu] [ptxas]"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys

CHILD_ENV = "AFT_JAX_DEVICELESS"  # marks a process started in ``environment``
_SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")


@dataclasses.dataclass(frozen=True)
class CompileTarget:
  name: str
  kind: str  # the plugin it needs
  spec: str  # the GPU description file or TPU generation
  description: str
  memory_bytes: int | None = None


def _gpu(name: str, description: str) -> CompileTarget:
  path = os.path.join(_SPECS, f"{name}.txtpb")
  memory = re.search(r"device_memory_size:\s*(\d+)", open(path).read()).group(1)
  return CompileTarget(name, "cuda", path, description, int(memory))


GIB = 1 << 30
# TPU memory per chip: Google Cloud's published HBM sizes (v5e 16 GiB, v6e Trillium 32 GiB).
TARGETS = {
  t.name: t
  for t in (
    _gpu("t4", "NVIDIA Tesla T4, 16 GB (sm_75; Colab's free GPU)"),
    _gpu("a100-40", "NVIDIA A100 40 GB (sm_80)"),
    _gpu("a100-80", "NVIDIA A100 80 GB (sm_80)"),
    _gpu("h100", "NVIDIA H100 SXM 80 GB (sm_90)"),
    _gpu("h200", "NVIDIA H200 141 GB (sm_90)"),
    CompileTarget("v5e", "tpu", "v5e", "TPU v5e chip, 16 GiB HBM", 16 * GIB),
    CompileTarget("v6e", "tpu", "v6e", "TPU v6e (Trillium) chip, 32 GiB HBM", 32 * GIB),
    CompileTarget("cpu", "cpu", "", "this machine's CPU (host memory)"),
  )
}


def get(name: str) -> CompileTarget:
  if name not in TARGETS:
    known = ", ".join(f"{t.name} ({t.description})" for t in TARGETS.values())
    raise ValueError(f"--target: unknown target {name!r}; the targets are: {known}")
  return TARGETS[name]


def _jaxlib_version() -> str:  # (a function: tests fake it)
  return importlib.metadata.version("jaxlib")


def plugin_packages(kind: str) -> list[str]:
  """pip requirements: the CUDA plugin at jaxlib's version, libtpu as jax's ``tpu`` extra."""
  if kind == "cuda":
    v = _jaxlib_version()
    return [f"jax-cuda12-plugin=={v}", f"jax-cuda12-pjrt=={v}"]
  if kind == "tpu":
    for req in importlib.metadata.requires("jax") or ():
      name, _, marker = req.partition(";")
      if name.strip().startswith("libtpu") and "tpu" in marker:
        return [name.strip().replace(" ", "")]
    return ["libtpu"]
  if kind == "ptxas":  # NVIDIA's PTX assembler, for kernel resources (registers, spills)
    return ["nvidia-cuda-nvcc-cu12"]
  raise ValueError(f"no plugin for {kind!r}: the kinds are 'cuda', 'tpu' and 'ptxas'")


def plugin_dir(kind: str) -> str:
  """$AFT_JAX_PLUGIN_DIR (default ~/.cache/aft_jax/plugins)/jaxlib-<version>/<kind>."""
  root = os.environ.get("AFT_JAX_PLUGIN_DIR") or os.path.expanduser("~/.cache/aft_jax/plugins")
  return os.path.join(root, f"jaxlib-{_jaxlib_version()}", kind)


def _name(requirement: str) -> str:  # a requirement's distribution name, normalised (PEP 503)
  return re.sub(r"[-_.]+", "-", re.split(r"[=<>!~;\[ ]", requirement, maxsplit=1)[0]).lower()


def incomplete(kind: str) -> str | None:
  """Why ``kind``'s plugin folder is no whole install, by pip's RECORD (None: whole or absent)."""
  path = plugin_dir(kind)
  if not os.path.isdir(path) or not os.listdir(path):
    return None
  found = {_name(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=[path])}
  for requirement in plugin_packages(kind):
    dist = found.get(_name(requirement))
    if dist is None:
      return f"{_name(requirement)} is not in it"
    for file in dist.files or ():
      where = dist.locate_file(file)
      if file.size is not None and (
        not os.path.isfile(where) or os.path.getsize(where) != file.size
      ):
        return f"{file} is missing or cut short"
  return None


def installed(kind: str) -> bool:
  path = plugin_dir(kind)
  return os.path.isdir(path) and bool(os.listdir(path)) and incomplete(kind) is None


def install(kind: str, quiet: bool = False) -> str:
  """``plugin_dir(kind)``, pip-installed unless there (a RuntimeError: pip's last lines)."""
  path = plugin_dir(kind)
  if installed(kind):
    return path
  if incomplete(kind) is not None:
    shutil.rmtree(path)  # pip --target would keep what is there
  reqs = plugin_packages(kind)
  if not quiet:
    print(f"Installing {' '.join(reqs)} into {path} (for compiling without the device)", flush=True)
  cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", path, *reqs]
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode:
    tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
    raise RuntimeError(f"pip could not install {' '.join(reqs)} into {path}:\n{tail}")
  return path


def ptxas() -> str:
  path = os.path.join(install("ptxas", quiet=True), "nvidia", "cuda_nvcc", "bin", "ptxas")
  os.chmod(path, os.stat(path).st_mode | 0o111)  # pip --target may drop the executable bit
  return path


def environment(kind: str, num_cpu_devices: int | None = None, base=None) -> dict:
  """A compiling process's environment: the plugin, its switches, ``num_cpu_devices`` hosts."""
  env = dict(os.environ if base is None else base)
  env[CHILD_ENV] = kind
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # the plugin's "no CUDA driver" INFO lines
  if kind in ("cuda", "tpu"):
    # jax's persistent cache cannot load these executables back without the device: none.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if incomplete(kind) is not None:
      raise RuntimeError(
        f"the {kind} compiler plugin in {plugin_dir(kind)} is incomplete ({incomplete(kind)}): "
        f"reinstall: python -m aft_jax.deviceless install {kind}"
      )
    if not installed(kind):
      raise RuntimeError(
        f"compiling for a {kind.upper()} target needs {' '.join(plugin_packages(kind))}: run "
        f"python -m aft_jax.deviceless install {kind}"
      )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (plugin_dir(kind), env.get("PYTHONPATH")) if p)
  if kind == "cuda":
    # Without it the plugin's start-up finds no CUDA libraries and registers nothing.
    env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
  if kind == "tpu":
    env["TPU_WORKER_HOSTNAMES"] = "localhost"  # else libtpu logs an error looking for peers
    env.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # Only its compiler: several processes may load libtpu (else the second stops at its lock).
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
  if num_cpu_devices:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={num_cpu_devices}".strip()
  return env


def reexec(kind: str, num_cpu_devices: int | None = None, argv=None) -> None:
  """Restarts this command in ``environment(kind)`` unless there."""
  if os.environ.get(CHILD_ENV) == kind:
    return
  if kind in ("cuda", "tpu") and incomplete(kind) is None:
    install(kind)  # (an incomplete folder is not repaired unasked: ``environment`` refuses it)
  argv = list(sys.argv if argv is None else argv)
  sys.stdout.flush()
  os.execve(sys.executable, [sys.executable, *argv], environment(kind, num_cpu_devices))


# The most devices a dry run compiles for: host devices cost with their number (a million hung
# before any check); a TPU slice has at most 256 chips (``_tpu_layout``).
MAX_DEVICES = {"cpu": 512, "cuda": 65_536, "tpu": 256}


def check_num_devices(target: CompileTarget, num_devices: int) -> None:
  if num_devices < 1:
    raise ValueError(f"--num_devices must be >= 1, got {num_devices}")
  limit = MAX_DEVICES[target.kind]
  if num_devices > limit:
    raise ValueError(
      f"--num_devices {num_devices:,}: a dry run for {target.name} compiles for at most "
      f"{limit:,} devices"
    )
  if target.kind == "tpu":
    _tpu_layout(num_devices)


def _tpu_layout(n: int) -> tuple[str, int]:
  """A TPU slice name with at least n chips (a 1x1 is refused) and n."""
  side = {1: "2x2", 2: "2x2", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16"}
  if n not in side and n != 256:
    raise ValueError(f"--num_devices: a TPU slice has 1, 2, 4, ... 256 chips, not {n}")
  return side.get(n, "16x16"), n


def devices(target: CompileTarget | str, num_devices: int = 1) -> list:
  import jax
  from jax.experimental import topologies

  target = get(target) if isinstance(target, str) else target
  if target.kind == "cpu":
    found = jax.devices("cpu")
    if len(found) < num_devices:
      raise ValueError(
        f"--num_devices {num_devices}: this process has {len(found)} CPU devices (start it "
        f"in aft_jax.deviceless.environment('cpu', {num_devices}))"
      )
    return found[:num_devices]
  if os.environ.get(CHILD_ENV) != target.kind:
    raise RuntimeError(
      f"compiling for {target.name} needs a process started in "
      f"aft_jax.deviceless.environment({target.kind!r})"
    )
  if target.kind == "cuda":
    topo = topologies.get_topology_desc(
      platform="cuda",
      topology_name="",
      target_config=open(target.spec).read(),
      topology=f"1x1x{num_devices}",
    )
    return list(topo.devices)
  layout, n = _tpu_layout(num_devices)
  topo = topologies.get_topology_desc(topology_name=f"{target.spec}:{layout}", platform="tpu")
  return list(topo.devices)[:n]


def _main(argv) -> int:
  if argv[:1] != ["install"] or any(k not in ("cuda", "tpu", "ptxas") for k in argv[1:]):
    print("usage: python -m aft_jax.deviceless install [cuda] [tpu] [ptxas]", file=sys.stderr)
    return 2
  for kind in argv[1:] or ("cuda", "tpu", "ptxas"):
    print(f"{kind}: {install(kind)}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(_main(sys.argv[1:]))
