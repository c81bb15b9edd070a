"""Causal AFT as a recurrence, for incremental (token-by-token) decoding.

The causal sums of ``aft_jax.ops`` are prefix sums, so they can be carried as a state
(m, num, den): m the running maximum of the logits, num = sum exp(logit - m) v and
den = sum exp(logit - m) (DESIGN.md section 1). Adding a term is a stable log-sum-exp update;
the output is sigma(q) * num / den.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG = -1e30


class State(NamedTuple):
  """m, num, den: ``[..., D]`` (num may carry one more trailing axis, e.g. ``[..., H, C]``)."""

  m: jax.Array
  num: jax.Array
  den: jax.Array


def _bcast(scale, num):
  return scale[..., None] if num.ndim > scale.ndim else scale


def empty(m_shape, num_shape, dtype=jnp.float32) -> State:
  """The state of an empty sum."""
  return State(
    jnp.full(m_shape, _NEG, dtype), jnp.zeros(num_shape, dtype), jnp.zeros(m_shape, dtype)
  )


def combine(a: State, b: State) -> State:
  """The state of the union of two disjoint sets of terms."""
  m = jnp.maximum(a.m, b.m)
  sa, sb = jnp.exp(a.m - m), jnp.exp(b.m - m)
  return State(m, a.num * _bcast(sa, a.num) + b.num * _bcast(sb, b.num), a.den * sa + b.den * sb)


def add(state: State, logit, value, valid=True) -> State:
  """Adds one term exp(logit) * value (skipped where ``valid`` is False)."""
  valid = jnp.asarray(valid)
  term = State(
    jnp.where(valid, logit, _NEG),
    jnp.where(_bcast(valid, value), value, 0.0),
    jnp.where(valid, 1.0, 0.0).astype(state.den.dtype) * jnp.ones_like(logit),
  )
  return combine(state, term)


def from_terms(logits, values, valid, axis: int) -> State:
  """The state of a set of terms laid out along ``axis`` (non-negative; ``valid`` masks them).

  logits, valid: ``[..., n, ..., D]``; values: the same, possibly with one more trailing axis.
  """
  logits = jnp.where(valid, logits, _NEG)
  m = jnp.max(logits, axis=axis)
  p = jnp.where(valid, jnp.exp(logits - jnp.expand_dims(m, axis)), 0.0)
  return State(m, jnp.sum(_bcast(p, values) * values, axis=axis), jnp.sum(p, axis=axis))


def output(q, state: State):
  """sigma(q) * num / den."""
  return jax.nn.sigmoid(q) * (state.num / _bcast(state.den, state.num))
