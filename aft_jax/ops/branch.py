"""``lax.cond`` whose predicate ``vmap`` never batches: the rare exact paths of the XLA ops.

The XLA ops take a fast path and recompute the rare rows it cannot hold exactly (``banded``,
``causal_mean``) behind a ``lax.cond``. Under ``vmap`` a predicate that differs per example
turns the cond into a ``select`` of both branches, each branch's operands wrapped in
``stop_gradient`` (so that reverse mode through the unselected branch is zero). That costs
the exact path for every block, and in a custom JVP the operands are tangents, and
``stop_gradient`` has no transpose: ``grad`` of ``vmap`` fails.

So the predicate is first made one value for the whole batch (``shared``: any example needs
the exact path, then every example takes it). The exact branches only replace the rows that
need it (a ``where`` per row), so an example that did not need it keeps its fast values bit
for bit; the batched call then does what one call on the folded batch does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_batching.custom_vmap
def shared(flag):
  """``flag`` (a bool array); under ``vmap``, OR-ed over the mapped axis and not batched."""
  return flag


@shared.def_vmap
def _shared_vmap(axis_size, in_batched, flag):
  del axis_size
  (batched,) = in_batched
  # ``shared`` again: under a nested vmap, flag is also batched over the outer axes.
  return (shared(jnp.any(flag, axis=0)) if batched else flag), False


def cond(flag, true_fn, false_fn):
  """``jax.lax.cond(shared(flag), true_fn, false_fn)`` for a bool scalar ``flag``."""
  return jax.lax.cond(shared(jnp.asarray(flag)), true_fn, false_fn)
