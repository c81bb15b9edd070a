"""The checkpoint checksums against a NumPy reference of the documented sums."""

import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax.trainer import checkpointing
from aft_jax.trainer.checkpointing import array_checksums


def _reference(x: np.ndarray) -> str:
  """The module doc's two sums, in NumPy (uint64 holding 32-bit values)."""
  words = (x if x.dtype == np.bool_ else x.view(f"uint{8 * x.dtype.itemsize}")).astype(np.uint64)
  i = np.arange(words.size, dtype=np.uint64).reshape(words.shape)
  out = [
    int(np.sum(_mix(words ^ _mix(i ^ np.uint64(s))))) % (1 << 32) for s in checkpointing._SEEDS
  ]
  return f"{out[0]:08x}{out[1]:08x}"


def _mix(h):
  """MurmurHash3's 32-bit finaliser on uint64 arrays holding 32-bit values."""
  h = h ^ (h >> np.uint64(16))
  h = (h * np.uint64(0x85EBCA6B)) % (1 << 32)
  h = h ^ (h >> np.uint64(13))
  h = (h * np.uint64(0xC2B2AE35)) % (1 << 32)
  return h ^ (h >> np.uint64(16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "uint8", "bool"])
def test_the_sums_are_the_documented_ones(dtype):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 4, 5)) * 100
  x = x > 0 if dtype == "bool" else np.asarray(jnp.asarray(x).astype(dtype))
  got = array_checksums({"x": jnp.asarray(x)})["['x']"]
  assert got == f"{jnp.asarray(x).dtype}[3, 4, 5]:{_reference(np.asarray(x))}"
  scalar = array_checksums(jnp.asarray(7, jnp.int32))
  assert scalar == {"": f"int32[]:{_reference(np.asarray(7, np.int32).reshape(()))}"}


def test_every_flipped_bit_and_a_run_of_ff_bytes_changes_the_checksum():
  x = np.random.default_rng(1).normal(size=(4, 6)).astype(np.float32)
  want = array_checksums(jnp.asarray(x))[""]
  bits = x.view(np.uint32).copy()
  seen = set()
  for i in range(bits.size):
    for b in range(32):
      damaged = bits.copy()
      damaged.flat[i] ^= np.uint32(1 << b)
      got = array_checksums(jnp.asarray(damaged.view(np.float32)))[""]
      assert got != want, (i, b)
      seen.add(got)
  assert len(seen) == bits.size * 32  # no two flips collide either
  raw = bytearray(x.tobytes())
  raw[30:38] = b"\xff" * 8  # across three words, as damage lands in a file
  damaged = np.frombuffer(bytes(raw), np.float32).reshape(x.shape)
  assert array_checksums(jnp.asarray(damaged))[""] != want


@pytest.mark.parametrize("w", [jnp.ones((2, 3)).at[1, 2].set(1.0000001), jnp.ones((3, 2))])
def test_mismatches_name_the_array_and_a_lost_json_item(w):
  saved = array_checksums({"params": {"w": jnp.ones((2, 3))}, "step": jnp.asarray(3)})
  checkpointing._raise_mismatches(saved, dict(saved))
  now = array_checksums({"params": {"w": w}, "step": jnp.asarray(3)})
  with pytest.raises(checkpointing.DamagedCheckpointError, match=r"\(\['params'\]\['w'\]\)"):
    checkpointing._raise_mismatches(saved, now)
  with pytest.raises(checkpointing.DamagedCheckpointError, match=r"\(config\)"):
    checkpointing._raise_mismatches({"config": "a", "data": "b"}, {"data": "b"})
