"""Causal softmax-weighted means, the core of causal AFT-simple, in one pass over chunks.

For k, v ``[T, R]``:

    a[t] = sum_{t' <= t} exp(k[t'] - L[t]) v[t'],   L[t] = log sum_{t' <= t} exp(k[t'])

Forward. Chunks of c positions are visited in order, carrying the exact (max, num, den) of
everything before. Within chunk j the prefix sums are one lower-triangular [c, c] matrix
product of exp(k - m_j) [v, 1] (m_j: the max of the carry and of k at the chunk's first row,
what every row of the chunk sees), added to the carry rescaled to m_j: each chunk is read once
and stays in cache, so the op runs at about the speed of one ``cumsum`` over [T, R]. The shared
shift m_j is exact unless a row's own running sum lies ~57 nats below it (a denominator below
1e-25) or a term it sees exceeds e^60 or is not finite (``logsumexp.set_aside``: such terms
are zeroed before the product); those rows (only those) are recomputed sequentially with a
running maximum. So a later position never reaches an earlier row, not even a NaN, and the
earlier rows' values are bit-identical whatever the later inputs are.

Derivative. A custom JVP (forward mode works; reverse mode is its transpose):

    da[t] = sum_{t' <= t} exp(k[t'] - L[t]) (dv[t'] + dk[t'] (v[t'] - a[t]))

the same chunked products applied to dv + dk v and dk, with the saved a and L: the only
[T, R] residuals are a and L, and the chunk bodies are rematerialized in the backward pass.
A row whose a or L is not finite has tangent 0, its factors ``tame``d (``logsumexp.tame``), and
the exact recomputations are ``branch.cond``s, whose predicate vmap shares across the batch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from aft_jax.ops import branch
from aft_jax.ops.logsumexp import DEN_OK, NEG, keep, matmul, set_aside, tame

# Measured on CPU (2 cores, fwd+bwd, R = 512 at T = 16384 and R = 4096 at T = 2048): 16
# positions per chunk is the fastest (~15-20% faster than 32, which is ~20% faster than 64);
# larger chunks spend more on the triangular product, smaller on loop steps.
CHUNK = 16


class _Chunk(NamedTuple):
  """One chunk's slice of everything the tangent pass reads: k, v, a, L ``[c, R]``; the chunk's
  max m, the previous chunk's max and L at its end ``[R]``; whether the forward pass recomputed
  the chunk (``bool``); the tangents dk, dv ``[c, R]``."""

  k: jax.Array
  v: jax.Array
  a: jax.Array
  lse: jax.Array
  m: jax.Array
  m_prev: jax.Array
  lse_prev: jax.Array
  bad: jax.Array
  dk: jax.Array
  dv: jax.Array


def _chunked(x, c: int, fill=0.0):
  """[T, R] -> [n, c, R], padding T up to n c with ``fill``."""
  n = -(-x.shape[0] // c)
  x = jnp.pad(x, ((0, n * c - x.shape[0]), (0, 0)), constant_values=fill)
  return x.reshape(n, c, x.shape[1])


def _tril_matmul(x, low: bool):
  """Inclusive prefix sums along axis 0 of x [c, X], as one matrix product
  (``logsumexp.matmul``'s precision policy)."""
  c = x.shape[0]
  return matmul("ij,jx->ix", jnp.tril(jnp.ones((c, c), x.dtype)), x, low)


def _forward(kc, vc, low: bool):
  """a, L [n, c, R] for k, v in chunks [n, c, R]; the chunk maxima m [n, R] and the
  recomputed chunks [n]."""
  r = kc.shape[2]

  def sequential(carry, kk, vv):  # exact: a running maximum per position
    def add(acc, kv):
      m0, num0, den0 = acc
      k1, v1 = kv
      m = jnp.maximum(m0, k1)
      s0, s1 = jnp.exp(m0 - m), jnp.exp(k1 - m)
      acc = (m, num0 * s0 + v1 * s1, den0 * s0 + s1)
      return acc, (acc[1] / acc[2], m + jnp.log(acc[2]))

    return jax.lax.scan(add, carry, (kk, vv))

  def step(carry, kv):
    m0, num0, den0 = carry
    kk, vv = kv
    # The shift is what the chunk's first row sees (the carry and its own key), never a later
    # key: a later key (finite or not) cannot change an earlier row's rounding.
    m = jnp.maximum(m0, kk[0])
    ok, e, vs = set_aside(jnp.exp(kk - m), vv)
    s0 = jnp.exp(m0 - m)
    nd = _tril_matmul(jnp.concatenate([e * vs, e], axis=1), low)
    num, den = num0 * s0 + nd[:, :r], den0 * s0 + nd[:, r:]
    # The rows (and channels) that see a set-aside term, or whose shift lost their terms.
    redo = (jax.lax.cummax(jnp.where(ok, 0, 1), axis=0) > 0) | ~(den >= DEN_OK)

    def fast():
      return (m, num[-1], den[-1]), (num / den, m + jnp.log(den), m)

    def exact():  # the flagged rows only: the others keep the fast path's values, bit for bit
      (m1, num1, den1), (a1, lse1) = sequential(carry, kk, vv)
      a, lse = jnp.where(redo, a1, num / den), jnp.where(redo, lse1, m + jnp.log(den))
      return (m1, num1, den1), (a, lse, m1)  # the carry is in the scale of m1

    carry, (a, lse, m) = branch.cond(jnp.any(redo), exact, fast)
    return carry, (a, lse, m, jnp.any(redo))

  # Of k's type: inside shard_map, varying over the mesh axes k varies over, as a scan's carry
  # must be (its output carry is).
  zero = jnp.zeros_like(kc[0, 0])
  _, (a, lse, m, bad) = jax.lax.scan(step, (zero + NEG, zero, zero), (kc, vc))
  return a, lse, m, bad


def _tangent(low: bool, kc, vc, a, lse, m, bad, dk, dv):
  """da [n, c, R] for k, v, a, L in chunks, linear in dk, dv [T, R]; the rest is recomputed
  from the primals."""
  c = a.shape[1]
  empty = jnp.full_like(m[:1], NEG)
  m_prev = jnp.concatenate([empty, m[:-1]])
  lse_prev = jnp.concatenate([empty, lse[:-1, -1]])  # L at the previous chunk's end

  # Every factor that carries a row's cotangent to other positions is ``tame``: a row after a
  # NaN or an infinity (not finite) has derivative 0, and its zero cotangent stays zero.
  def step(gh, ch: _Chunk):
    x, y = ch.dv + ch.dk * ch.v, ch.dk
    a = tame(ch.a)

    def fast():  # sums of exp(k - m) x and exp(k - m) y, in the scale of the chunk's max
      e = jnp.exp(ch.k - ch.m)
      s0 = tame(jnp.exp(ch.m_prev - ch.m))
      nd = _tril_matmul(jnp.concatenate([e * x, e * y], axis=1), low)
      g, h = gh[0] * s0 + nd[:, : x.shape[1]], gh[1] * s0 + nd[:, x.shape[1] :]
      return (g[-1], h[-1]), tame(jnp.exp(ch.m - ch.lse)) * (g - a * h)

    def exact():  # S[t] = sum exp(k - L[t]) x: every factor <= 1
      def add(s, xs1):
        k1, l0, l1, x1, y1 = xs1
        decay, r = tame(jnp.exp(l0 - l1)), tame(jnp.exp(k1 - l1))
        s = (s[0] * decay + r * x1, s[1] * decay + r * y1)
        return s, s

      scale = tame(jnp.exp(ch.m_prev - ch.lse_prev))
      l_before = jnp.concatenate([ch.lse_prev[None], ch.lse[:-1]])
      (g, h), (sg, sh) = jax.lax.scan(
        add, (gh[0] * scale, gh[1] * scale), (ch.k, l_before, ch.lse, x, y)
      )
      back = tame(jnp.exp(ch.lse[-1] - ch.m))
      return (g * back, h * back), sg - a * sh

    carry, da = branch.cond(ch.bad, exact, fast)
    return carry, jnp.where(keep(ch.a, ch.lse), da, 0.0)

  zero = jnp.zeros_like(kc[0, 0])
  xs = _Chunk(kc, vc, a, lse, m, m_prev, lse_prev, bad, _chunked(dk, c), _chunked(dv, c))
  return jax.lax.scan(jax.checkpoint(step), (zero, zero), xs)[1]


def _rows(x, t_len):
  return x.reshape(-1, x.shape[-1])[:t_len]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def causal_mean(k, v, chunk: int = CHUNK, low: bool = False):
  """a [T, R] (module docstring) for k, v [T, R]; ``low``: bfloat16 factors in the chunk
  products (``logsumexp.matmul``)."""
  c = min(chunk, k.shape[0])
  return _rows(_forward(_chunked(k, c, NEG), _chunked(v, c), low)[0], k.shape[0])


@causal_mean.defjvp
def _causal_mean_jvp(chunk, low, primals, tangents):
  k, v = primals
  c = min(chunk, k.shape[0])
  kc, vc = _chunked(k, c, NEG), _chunked(v, c)  # shared by both passes: no second copy
  a, lse, m, bad = _forward(kc, vc, low)
  da = jax.checkpoint(functools.partial(_tangent, low))(kc, vc, a, lse, m, bad, *tangents)
  return _rows(a, k.shape[0]), _rows(da, k.shape[0])
