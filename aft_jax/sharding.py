"""Device meshes (data, fsdp, tensor, sequence) and logical-axis sharding (``DEFAULT_RULES``):
docs/scaling.md, "The mesh"; docs/long_sequences.md, "Context parallelism"."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import flax.linen as nn
from absl import logging
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from aft_jax.typed_config import TypedConfig

MESH_AXES = ("data", "fsdp", "tensor", "sequence")
SEQUENCE = "sequence"  # the mesh axis that splits T (context parallelism)

# Logical axis name -> mesh axis (or axes, or None = replicated).
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
  ("batch", ("data", "fsdp")),
  ("embed", "fsdp"),
  ("mlp", "tensor"),
  ("heads", "tensor"),
  ("kv", None),
  ("vocab", "tensor"),
  ("length", None),
  ("activation_length", SEQUENCE),  # T of the activations (not of the parameters: "length")
  ("length_k", None),
  ("bias_factor", None),
  ("kernel", None),
  ("layers", None),
  ("embed_small", None),
  ("cluster", None),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig(TypedConfig):
  """``config.mesh``: data x fsdp x tensor x sequence = the number of devices."""

  WHERE = "mesh"
  ADDED = {"sequence": ("2bacbb7", 1)}  # T was never split before (TypedConfig.as_written)

  data: int = -1  # data parallelism; -1: all remaining devices
  fsdp: int = 1  # data parallelism with sharded parameters and optimizer state
  tensor: int = 1  # tensor parallelism (MLP units, AFT channels, heads, vocabulary)
  sequence: int = 1  # context parallelism: T split (causal AFT-simple/local/conv1d only)

  def _value_problems(self) -> list[str]:
    sizes = tuple(getattr(self, a) for a in MESH_AXES)
    if sum(s == -1 for s in sizes) > 1 or any(s == 0 or s < -1 for s in sizes):
      return [
        f"mesh: data, fsdp, tensor, sequence = {sizes}: each must be a positive int, and at "
        "most one of them may be -1 (all remaining devices)"
      ]
    return []


@dataclasses.dataclass(frozen=True)
class RulesConfig(TypedConfig):
  """``config.logical_axis_rules``: [logical name, mesh axes] pairs (config files only)."""

  logical_axis_rules: list = dataclasses.field(
    default_factory=lambda: [list(r) for r in DEFAULT_RULES]
  )


def mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> tuple[int, ...]:
  """(data, fsdp, tensor, sequence) of ``mesh_cfg`` over ``num_devices`` (-1: the rest)."""
  sizes = [getattr(mesh_cfg, a) for a in MESH_AXES]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(
        f"mesh: data, fsdp, tensor, sequence = {tuple(sizes)}: {num_devices} devices are "
        f"not divisible by {known}"
      )
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(
      f"mesh: data x fsdp x tensor x sequence = {' x '.join(map(str, sizes))} = "
      f"{math.prod(sizes)} does not match the {num_devices} available devices"
    )
  return tuple(sizes)


def _axis_names(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def uneven_batches(dp: int, **batch_sizes: int) -> list[str]:
  """One line per global batch size (``batch_size=16``) that ``dp`` devices do not divide."""
  return [
    f"{name} = {size} is not divisible by the {dp} data-parallel devices (mesh data x fsdp)"
    for name, size in batch_sizes.items()
    if size % dp
  ]


def check_batch_split(mesh: Mesh | int, **batch_sizes: int) -> None:
  """Each batch size splits over the data x fsdp devices (or their number), those over hosts."""
  dp = mesh if isinstance(mesh, int) else mesh.shape["data"] * mesh.shape["fsdp"]
  uneven = uneven_batches(dp, **batch_sizes)
  if uneven:
    raise ValueError(uneven[0])
  if dp % jax.process_count():
    raise ValueError(
      f"mesh data x fsdp = {dp} is not a multiple of the {jax.process_count()} "
      "processes: each process feeds its own rows of the batch, so give the "
      "data or fsdp axis at least one slot per process"
    )


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The mesh over ``devices`` (default: every host's); on CPUs, how to make enough of them."""
  devices = list(jax.devices() if devices is None else devices)
  try:
    shape = mesh_shape(mesh_cfg, len(devices))
  except ValueError as e:
    if not devices or any(d.platform != "cpu" for d in devices):
      raise
    n = math.prod(s for s in (getattr(mesh_cfg, a) for a in MESH_AXES) if s != -1)
    raise ValueError(
      f"{e}; a CPU host makes {n} devices with --jax_num_cpu_devices={n} (or "
      f"JAX_NUM_CPU_DEVICES={n}; in Python, jax.config.update('jax_num_cpu_devices', {n}) "
      "before jax's first computation)"
    ) from None
  # Auto axes (GSPMD), as flax's logical axis rules expect (jax.make_mesh's default: explicit).
  return jax.make_mesh(shape, MESH_AXES, (AxisType.Auto,) * len(MESH_AXES), devices=devices)


def rules_from_config(rules) -> tuple[tuple[str, Any], ...]:  # (lists from JSON) as tuples
  if rules is None:
    return DEFAULT_RULES
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)


def logical_shardings(abstract_tree, mesh: Mesh, rules):
  """NamedShardings of ``nn.Partitioned`` boxes; a dimension not divisible: replicated, warned."""
  specs = nn.get_partition_spec(abstract_tree)
  shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
  replicated_dims = []

  def divisible(path, sh, leaf):
    if not isinstance(sh, NamedSharding) or not hasattr(leaf, "shape"):
      return sh
    spec, changed = list(sh.spec), False
    for i, (dim, axes) in enumerate(zip(leaf.shape, spec)):
      if dim % math.prod(mesh.shape[a] for a in _axis_names(axes)):
        replicated_dims.append(
          f"{jax.tree_util.keystr(path)} {tuple(leaf.shape)} dim {i} over {axes}"
        )
        spec[i], changed = None, True
    return NamedSharding(mesh, P(*spec)) if changed else sh

  shardings = jax.tree_util.tree_map_with_path(divisible, shardings, nn.unbox(abstract_tree))
  if replicated_dims and jax.process_index() == 0:
    logging.warning(
      "replicated (not divisible by the mesh axes of their logical names): %s",
      "; ".join(replicated_dims),
    )
  return shardings


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(("data", "fsdp")))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def put_batch(batch: dict, mesh: Mesh) -> dict:
  """Each process's local rows (as many in each) as global arrays over the batch axes."""
  sh = batch_sharding(mesh)
  out = {}
  for k, v in batch.items():
    v = np.asarray(v)
    out[k] = jax.make_array_from_process_local_data(
      sh, v, (v.shape[0] * jax.process_count(),) + v.shape[1:]
    )
  return out


def axis_sizes(mesh: Mesh) -> dict[str, int]:
  """The mesh's axis sizes as runs report them: the sequence axis only where it splits T."""
  return {a: n for a, n in mesh.shape.items() if a != SEQUENCE or n > 1}


def in_mesh_shards(fn, args, names, splits_t: bool = True):
  """``fn(*args, axis_name=...)`` per device's shard (logical axes ``names``) in ``shard_map``,
  or on the whole arrays: no mesh, an uneven split, or T split and not ``splits_t``."""
  # Also where T is whole: XLA's partitioner would reshard inside the causal ops' loop over T.
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or math.prod(dict(mesh.shape).values()) == 1:
    return fn(*args, axis_name=None)
  sizes = dict(mesh.shape)
  specs = tuple(nn.logical_to_mesh_axes(n) for n in names)

  def splits(arg, spec) -> bool:
    return not any(
      dim % math.prod(sizes[a] for a in _axis_names(axes))
      for dim, axes in zip(jax.numpy.shape(arg), spec)
    )

  def mentioned(spec) -> set:
    return {a for axes in spec for a in _axis_names(axes)}

  split = {a for a in mentioned(specs[0]) if sizes[a] > 1}  # what the result varies over
  splits_seq = SEQUENCE in split
  if not split or not all(map(splits, args, specs)) or (splits_seq and not splits_t):
    return fn(*args, axis_name=None)  # (no split: no logical axis rules map these names)
  axis_name = SEQUENCE if splits_seq else None
  # An array replicated over axes the result is split over (a bias w) is marked varying on the
  # way in: its gradient summed over those devices once, here, not in the op's loop per chunk.
  cast = [tuple(sorted(mentioned(specs[0]) - mentioned(spec))) for spec in specs]

  def per_shard(*a):
    a = [jax.lax.pcast(x, axes, to="varying") if axes else x for x, axes in zip(a, cast)]
    return fn(*a, axis_name=axis_name)

  return jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=specs[0])(*args)
