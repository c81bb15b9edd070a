"""Context parallelism: the causal ops with T sharded over a mesh axis (``axis_name=``, inside
``jax.shard_map``), each device holding n consecutive positions.

A device's outputs need only the state of every position before its shard (``state``): the
same state a piece of a sequence is handed, built here from the other devices' shards with
two small collectives instead of from the previous call:

    AFT-simple   the (m, num, den) total of each shard, ``all_gather``-ed ([devices, D]
                 triples); device i combines those of devices < i.
    AFT-local    the same for the prefix (the keys older than the window), and the last s keys
    AFT-conv1d   and values before the shard by ``ppermute`` from the ceil(s / n) devices
                 before (one when s <= n).

then the op runs on its shard after that state (``pieces``). Gradients flow back through the
collectives (their transposes), so they are exact too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aft_jax.ops import logsumexp as lse
from aft_jax.ops import state as st


def _rank(axis_name):
  return jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)


def simple_state(k, v, axis_name) -> lse.Acc:
  """AFT-simple's state before this device's shard, k, v ``[..., n, D]``."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  total = st.reduce(f32(k), f32(v), k.ndim - 2)
  i, size = _rank(axis_name)
  return st.reduce_over(jax.lax.all_gather(total, axis_name), 0, jnp.arange(size) < i)


def window_state(k, v, size: int, axis_name) -> st.WindowState:
  """AFT-local's / AFT-conv1d's state before this device's shard: k ``[..., n, H]`` and v
  (``[..., n, H]`` or ``[..., n, H, C]``), T on axis k.ndim - 2."""
  axis = k.ndim - 2
  n = k.shape[axis]
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  k, v = f32(k), f32(v)
  back = -(-size // n)  # the shards the last ``size`` keys come from
  i, devices = _rank(axis_name)
  # Shards i - back .. i - 1 (zeros before shard 0: positions < 0, which the ring ignores).
  prev = lambda x, j: jax.lax.ppermute(x, axis_name, [(d, d + j) for d in range(devices - j)])
  cat = lambda x: jnp.concatenate([prev(x, j) for j in range(back, 0, -1)], axis)
  span_k, span_v = cat(k), cat(v)
  last = lambda x: jax.lax.slice_in_dim(x, back * n - size, back * n, axis=axis)
  # The keys of shard i - back before the ring join the prefix with every earlier shard: from
  # each device the total of its shard and of its first back * n - size keys.
  head = jnp.reshape(jnp.arange(n) < back * n - size, (-1,) + (1,) * (k.ndim - axis - 1))
  parts = (st.reduce(k, v, axis), st.reduce(k, v, axis, head))
  gathered = jax.lax.all_gather(lse.Acc(*(jnp.stack(x) for x in zip(*parts))), axis_name)
  j = jnp.arange(devices)
  before = st.reduce_over(lse.Acc(*(x[:, 0] for x in gathered)), 0, j < i - back)
  edge = st.reduce_over(lse.Acc(*(x[:, 1] for x in gathered)), 0, j == i - back)
  index = (i * n).astype(jnp.int32)
  roll = lambda x: jnp.roll(x, index % size, axis=axis)  # slot p % s holds position p
  return st.WindowState(lse.combine(before, edge), roll(last(span_k)), roll(last(span_v)), index)
