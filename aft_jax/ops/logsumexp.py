"""Exact partial softmax sums, carried as (max, numerator, denominator) triples.

``exp`` overflows float32 above ~88, and a single shift per row of a bias and per channel of
the keys is not enough when the two maxima sit at different positions (every shifted term
underflows). So partial sums are carried as triples ``(m, num, den)`` = (max logit,
sum exp(logit - m) v, sum exp(logit - m)) and combined like a stable log-sum-exp.

The same triple is the state of incremental decoding: the causal sums of the ops are prefix
sums, so a causal AFT layer is a recurrence whose state is the triple of everything seen so far
(``add`` one term per token, ``from_terms`` for a window of keys, ``output`` = sigma(q) num/den;
the steps of ``step``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# The max of an empty sum, and the logit of an excluded term: the lowest float32. Finite (not
# -inf) so that exp(NEG - NEG) = 1 multiplies zeros and no inf - inf = NaN can reach a gradient;
# the lowest float32, so that no finite logit is below it (a real logit of -1e30 or -1e35 is still
# larger than every excluded term: exp(NEG - m) = 0 for every other finite maximum m).
NEG = float(np.finfo(np.float32).min)
# The largest finite float32 (``finite``).
_F32_MAX = float(np.finfo(np.float32).max)

# Causal fast paths shift a block's terms by what its first row sees (never by a later key, so
# that a later key cannot change an earlier row's rounding): a later term may then exceed its
# shift. Terms up to e^60 are summed as they are (a block's sum of them stays far below float32
# overflow); larger, non-finite or with a non-finite value, a term is set aside (``set_aside``)
# and the rows that see it are recomputed exactly.
EXP_MAX = 1e26

# Fast paths share one shift across many terms (a sum of products of factors <= 1). A fast
# denominator below this may have lost its largest terms to underflow, and the rows are
# recomputed exactly; terms below 1e-38 then weigh < 1e-13 of den, far below float32
# resolution. (Above it the shift is at most ~57 nats from the true maximum.)
DEN_OK = 1e-25
# Matrix products of exact sums: float32 on GPUs/TPUs too (no TF32/bf16 passes).
HIGHEST = jax.lax.Precision.HIGHEST


def finite(x):
  """Whether x is finite (NaN and +-inf: False), from a comparison, which every Pallas lowering
  has."""
  return jnp.abs(x) <= _F32_MAX


def tame(x):
  """x where it is finite, else 0: a factor of a causal op's derivative.

  A derivative's factors from a row whose output or normaliser is not finite (the row sees a
  NaN, or a key of +inf) are NaN or infinite. Reverse mode multiplies them by that row's
  cotangent even where it is zero (the row is not in the loss), and 0 * NaN = NaN would then
  reach every earlier input through the sums. Zeroed, rows with finite outputs keep their exact
  derivative and the others have derivative 0 (``keep``)."""
  return jnp.where(finite(x), x, 0.0)


def keep(a, lse):
  """Where a causal op's row has a derivative: its output a and normaliser L are finite
  (``tame``; elsewhere the tangent is 0)."""
  return finite(a) & finite(lse)


def set_aside(e, v):
  """(ok, e, v) for shifted terms e = exp(k - shift) and their values v, of one shape: ok where
  e <= ``EXP_MAX`` and v is finite; e and v zeroed elsewhere, *before* any product, so that a
  set-aside term is an exact 0 in every sum (0 * NaN would be NaN)."""
  ok = (e <= EXP_MAX) & finite(v)
  return ok, jnp.where(ok, e, 0.0), jnp.where(ok, v, 0.0)


def matmul(spec: str, a, b, low: bool):
  """``jnp.einsum(spec, a, b)`` of the factors of exact sums (exponentials <= 1, values).

  The precision policy: float32 (and float64) inputs multiply at ``HIGHEST`` (no TF32 or bf16
  passes on accelerators); ``low`` (the op's inputs were bfloat16) multiplies bfloat16 factors
  with float32 accumulation (``preferred_element_type``), the tensor cores' rate.
  """
  if low:
    bf = jnp.bfloat16
    return jnp.einsum(spec, a.astype(bf), b.astype(bf), preferred_element_type=jnp.float32)
  return jnp.einsum(spec, a, b, precision=HIGHEST)


class Acc(NamedTuple):
  """A partial softmax-weighted sum: m, den ``[..., D]``; num ``[..., D]`` or ``[..., D, C]``.

  ``m`` never carries a gradient: every result is a ratio num / den in which m cancels, so
  holding m fixed (``stop_gradient``) gives the exact derivative and keeps max() out of the
  backward pass.
  """

  m: jax.Array
  num: jax.Array
  den: jax.Array


def empty(shape, num_shape=None) -> Acc:
  """The float32 triple of no terms: m = NEG, num = den = 0; m, den ``shape``, num
  ``num_shape`` (default ``shape``)."""
  zeros = lambda s: jnp.zeros(s, jnp.float32)
  return Acc(
    jnp.full(shape, NEG, jnp.float32),
    zeros(shape if num_shape is None else num_shape),
    zeros(shape),
  )


def bcast(scale, num):
  """``scale`` [..., D] broadcast against ``num`` [..., D] or [..., D, C]."""
  return scale[..., None] if num.ndim > scale.ndim else scale


def combine(a: Acc, b: Acc) -> Acc:
  """(m, num, den) of the union of two disjoint sets of terms (stable log-sum-exp)."""
  m = jnp.maximum(a.m, b.m)
  # One exp: the larger side is scaled by 1, the smaller by exp(-|a.m - b.m|).
  x = jnp.exp(-jnp.abs(a.m - b.m))
  a_big = a.m >= b.m
  sa, sb = jnp.where(a_big, 1.0, x), jnp.where(a_big, x, 1.0)
  return Acc(m, a.num * bcast(sa, a.num) + b.num * bcast(sb, b.num), a.den * sa + b.den * sb)


def add(acc: Acc, logit, value, valid=True) -> Acc:
  """``acc`` plus one term exp(logit) * value (skipped where ``valid`` is False).

  logit: ``[..., D]``; value: ``[..., D]`` or ``[..., D, C]``.
  """
  valid = jnp.asarray(valid)
  term = Acc(
    jnp.where(valid, logit, NEG),
    jnp.where(bcast(valid, value), value, 0.0),
    jnp.where(valid, 1.0, 0.0).astype(acc.den.dtype) * jnp.ones_like(logit),
  )
  return combine(acc, term)


def from_terms(logits, values, valid, axis: int) -> Acc:
  """The triple of a set of terms laid out along ``axis`` (non-negative; kept out of the
  result; ``valid``, broadcast against the logits, masks them: a masked value never reaches a
  product, so a non-finite one is ignored too).

  logits: ``[..., n, ..., D]``; values: the same, possibly with one more trailing axis. The
  maximum carries no gradient (``Acc``).
  """
  valid = jnp.broadcast_to(valid, logits.shape)
  logits = jnp.where(valid, logits, NEG)
  m = jax.lax.stop_gradient(jnp.max(logits, axis=axis))
  p = jnp.where(valid, jnp.exp(logits - jnp.expand_dims(m, axis)), 0.0)
  values = jnp.where(bcast(valid, values), values, 0.0)
  return Acc(m, jnp.sum(bcast(p, values) * values, axis=axis), jnp.sum(p, axis=axis))


@jax.custom_jvp
def gate(q, mean):
  """Y = sigma(q) * mean (broadcast against q). Its derivative's factors are ``tame``: a NaN
  q at one position (Y NaN there) leaves the derivative of every other position finite."""
  return jax.nn.sigmoid(q) * mean


@gate.defjvp
def _gate_jvp(primals, tangents):
  (q, mean), (dq, dmean) = primals, tangents
  s = jax.nn.sigmoid(q)
  return s * mean, tame(s * (1.0 - s) * mean) * dq + tame(s) * dmean


def output(q, acc: Acc):
  """sigma(q) * num / den (``gate``)."""
  return gate(q, acc.num / bcast(acc.den, acc.num))
