"""The plain mode: an op on a whole sequence (no state, segments or sequence axis), run by the
implementation ``registry.resolve`` picks for it (``registry``'s docstring).

``run(call)`` is the mode; ``causal(fn, impl, ...)`` is the op on plain causal arguments,
which the other modes (``pieces``, ``sharded``) run on a piece with the state prepended, so
every implementation serves them too. An empty input (T, D or a batch dim 0) gives the empty
output, without running anything.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp

from aft_jax.ops import registry
from aft_jax.ops.registry import OpArgs

_SAID: set[str] = set()  # the warnings given in this process (each once)


def resolve(fn: str, impl: str, args: OpArgs) -> registry.Choice:
  """``registry.resolve``, and its warning given once per process."""
  choice = registry.resolve(fn, impl, args)
  if choice.warning is not None and choice.warning not in _SAID:
    _SAID.add(choice.warning)
    warnings.warn(choice.warning, RuntimeWarning, stacklevel=5)
  return choice


def _empty(args: OpArgs):
  """The result of an op with an empty input (T, D or a batch dim 0): an empty output of q's
  shape, or None when there is work to do."""
  if args.q.size and args.k.size:
    return None
  return jnp.zeros(args.q.shape, jnp.result_type(args.q, args.k, args.v))


def _run(fn: str, impl: str, args: OpArgs):
  empty = _empty(args)
  return resolve(fn, impl, args)(args) if empty is None else empty


def run(call):
  """Y of the op on a whole sequence (``arguments.Call``, mode "plain")."""
  window = call.size if call.fn == "aft_local" else None
  return _run(call.fn, call.impl, OpArgs(call.q, call.k, call.v, call.w, call.causal, window))


def causal(fn: str, impl: str, window: int | None = None, kernel=None):
  """``run(q, k, v, w=None) -> Y``: op ``fn`` (causal, no state) on plain arguments, by its
  resolved implementation; AFT-local's ``window``; AFT-conv1d's ``kernel`` (then w is it)."""

  def run(q, k, v, w=None):
    return _run(fn, impl, OpArgs(q, k, v, kernel if w is None else w, True, window))

  return run
