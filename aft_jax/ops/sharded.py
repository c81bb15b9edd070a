"""The sharded mode: causal AFT-simple, AFT-local and AFT-conv1d with T split over a mesh axis
(``axis_name=``, inside ``jax.shard_map``), each device holding consecutive positions.

A device's outputs are those of a piece of the whole sequence after the state of every
position before its shard: ``context`` builds that state from the other devices' shards (one
all-gather of the shards' triples, and a ppermute of the last keys and values), and the piece
runs as in the state mode (``pieces``), by the op's own implementation. AFT-local's w is the
whole sequence's bias ``[L, L]`` (L >= T times the devices) or its factors; the state's index
is the shard's first position.
"""

from __future__ import annotations

from aft_jax.ops import context, pieces, plain


def run(call):
  """This device's shard of the op's output on the whole sequence (``arguments.Call``, mode
  "sharded")."""
  fn, q, k, v, w, axis = call.fn, call.q, call.k, call.v, call.w, call.axis_name
  if fn == "aft_simple":
    state = context.simple_state(k, v, axis)
    return pieces.simple(plain.causal(fn, call.impl), q, k, v, state, False)
  state = context.window_state(k, v, call.size, axis)
  if fn == "aft_conv1d":
    return pieces.conv1d(plain.causal(fn, call.impl, kernel=w), q, k, v, w, state, False)
  run_local = plain.causal(fn, call.impl, window=call.size)
  return pieces.local(run_local, q, k, v, w, call.size, state.index, state, False)
