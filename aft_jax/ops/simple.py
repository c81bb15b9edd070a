"""AFT-simple (paper Eq. 5, w = 0): the op, its step and its XLA maths; kernels in ``pallas``
(docs/kernels.md, "How each module computes")."""

import functools

import jax
import jax.numpy as jnp

from aft_jax.ops import common
from aft_jax.ops import logsumexp as lse
from aft_jax.ops.logsumexp import DEN_OK, NEG, keep, matmul, set_aside, tame
from aft_jax.ops.pallas import mosaic_simple, triton_simple

FN = "aft_simple"
KERNELS = (
  common.Kernel("gpu", triton_simple.causal_mean, triton_simple.unsupported),
  common.Kernel("tpu", mosaic_simple.causal_mean, mosaic_simple.unsupported, auto=False),
)
CHUNK = 16  # positions per chunk: on CPU faster than 32 and 64, forward and backward


def aft_simple(
  q, k, v, *, causal=False, impl="auto", initial_state=None, output_final_state=False,
  segment_ids=None, axis_name=None,
):  # fmt: skip
  """AFT-simple: Y[t] = sigma(q[t]) * sum_t' softmax_t'(k)[t'] v[t']  (t' <= t when causal).

  Args:
    q, k, v: ``[..., T, D]``.
    causal: sum over ``t' <= t`` only (a bool).
    impl: "auto", "xla", "pallas" or "pallas_interpret" (docs/kernels.md).
    initial_state: causal: the ``Acc`` of the positions before this piece.
    output_final_state: causal: also return the state after the piece.
    segment_ids: causal: ``[..., T]`` ints, packed documents that do not see each other.
    axis_name: causal, in ``jax.shard_map`` with T sharded over this mesh axis.

  Returns:
    ``[..., T, D]`` (the inputs' dtype), or ``(Y, state)``; O(T D).
  """
  q, k, v = common.check_qkv(FN, q, k, v)
  mode = common.check_mode(
    FN, causal, impl, initial_state=initial_state, output_final_state=output_final_state,
    segment_ids=segment_ids, axis_name=axis_name,
  )  # fmt: skip
  common.check_arrays(FN, q.shape[:-1], segment_ids=segment_ids)
  common.check_state(FN, initial_state, lambda: aft_simple_init(q.shape[:-2] + q.shape[-1:]))
  return common.eager(
    _run, q=q, k=k, v=v, state=initial_state, segment_ids=segment_ids, mode=mode,
    causal=bool(causal), impl=impl, final=output_final_state, axis_name=axis_name,
  )  # fmt: skip


def _run(q, k, v, state, segment_ids, mode, causal, impl, final, axis_name):
  if mode == "packed":
    return lse.packed(q, k, v, segment_ids, 0, None)
  if mode == "sharded":
    state, final = lse.shard_state(k, v, None, axis_name), False
  elif mode == "whole":
    return _whole(q, k, v, causal, impl)
  if k.shape[-2] == 0:
    return lse.nothing(q, k, v, state, final, lambda: aft_simple_init(k.shape[:-2] + k.shape[-1:]))
  y = lse.after_state(lambda *qkv: _whole(*qkv, True, impl), q, k, v, state)
  return (y, lse.final(state, k, v)) if final else y


def _whole(q, k, v, causal, impl):
  def xla(k, v, _, low):
    if not causal:  # w = 0: one shift per channel is exact
      return jnp.sum(jax.nn.softmax(k, axis=-2) * v, axis=-2, keepdims=True)
    return common.unrows(causal_mean(common.rows(k), common.rows(v), CHUNK, low), k.shape)

  return common.run(FN, KERNELS, impl, xla, q, k, v, causal=causal)


def aft_simple_init(shape) -> lse.Acc:
  """The state before any token, for q_t, k_t, v_t of ``shape`` [..., D]."""
  return lse.empty(shape)


def aft_simple_step(state: lse.Acc, q_t, k_t, v_t):
  """One token: Y[t] = sigma(q[t]) * sum_{t' <= t} exp(k[t']) v[t'] / sum_{t' <= t} exp(k[t']);
  q_t, k_t, v_t ``[..., D]``. Returns ``(Y[t], state)``, the op's state (float32)."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  state = lse.combine(state, lse.leaf(f32(k_t), f32(v_t)))
  return lse.output(f32(q_t), state).astype(jnp.result_type(q_t, k_t, v_t)), state


def _chunked(x, c: int, fill=0.0):  # [T, R] -> [n, c, R], T padded with ``fill``
  n = -(-x.shape[0] // c)
  x = jnp.pad(x, ((0, n * c - x.shape[0]), (0, 0)), constant_values=fill)
  return x.reshape(n, c, x.shape[1])


def _tril_matmul(x, low: bool):  # inclusive prefix sums along axis 0 of x [c, X]
  c = x.shape[0]
  return matmul("ij,jx->ix", jnp.tril(jnp.ones((c, c), x.dtype)), x, low)


def _forward(kc, vc, low: bool):  # a, L [n, c, R], chunk maxima [n, R], recomputed chunks [n]
  r = kc.shape[2]

  def add(acc, kv):  # exact: a running maximum per position
    m0, num0, den0 = acc
    k1, v1 = kv
    m = jnp.maximum(m0, k1)
    s0, s1 = jnp.exp(m0 - m), jnp.exp(k1 - m)
    acc = (m, num0 * s0 + v1 * s1, den0 * s0 + s1)
    return acc, (acc[1] / acc[2], m + jnp.log(acc[2]))

  def step(carry, kv):
    m0, num0, den0 = carry
    kk, vv = kv
    m = jnp.maximum(m0, kk[0])  # what the chunk's first row sees, never a later key
    ok, e, vs = set_aside(jnp.exp(kk - m), vv)
    s0 = jnp.exp(m0 - m)
    nd = _tril_matmul(jnp.concatenate([e * vs, e], axis=1), low)
    num, den = num0 * s0 + nd[:, :r], den0 * s0 + nd[:, r:]
    bad = jnp.any(~ok) | jnp.any(~(den >= DEN_OK))  # a set-aside term, or a shift lost terms

    def fast():
      return (m, num[-1], den[-1]), (num / den, m + jnp.log(den), m)

    def exact():  # the flagged rows only: the others keep the fast values, bit for bit
      # The rows (and channels) that see a set-aside term, or whose shift lost their terms.
      redo = (jax.lax.cummax(jnp.where(ok, 0, 1), axis=0) > 0) | ~(den >= DEN_OK)
      (m1, num1, den1), (a1, lse1) = jax.lax.scan(add, carry, (kk, vv))
      a, lse_ = jnp.where(redo, a1, num / den), jnp.where(redo, lse1, m + jnp.log(den))
      return (m1, num1, den1), (a, lse_, m1)  # the carry in the scale of m1

    carry, (a, lse_, m) = lse.cond(bad, exact, fast)
    return carry, (a, lse_, m, bad)

  zero = jnp.zeros_like(kc[0, 0])  # k's type: in shard_map, varying where k does
  _, (a, lse_, m, bad) = jax.lax.scan(step, (zero + NEG, zero, zero), (kc, vc))
  return a, lse_, m, bad


def _tangent(low: bool, kc, vc, a, lse_, m, bad, dk, dv):  # da [n, c, R], linear in dk, dv [T, R]
  c = a.shape[1]
  empty = jnp.full_like(m[:1], NEG)
  m_prev = jnp.concatenate([empty, m[:-1]])
  lse_prev = jnp.concatenate([empty, lse_[:-1, -1]])  # L at the previous chunk's end

  def step(gh, chunk):
    k, v, a_raw, lse_c, m, m_prev, lse_prev, bad_c, dk, dv = chunk
    x, y = dv + dk * v, dk
    a = tame(a_raw)

    def fast():  # sums of exp(k - m) x and exp(k - m) y in the scale of the chunk's max
      e = jnp.exp(k - m)
      s0 = tame(jnp.exp(m_prev - m))
      nd = _tril_matmul(jnp.concatenate([e * x, e * y], axis=1), low)
      g, h = gh[0] * s0 + nd[:, : x.shape[1]], gh[1] * s0 + nd[:, x.shape[1] :]
      return (g[-1], h[-1]), tame(jnp.exp(m - lse_c)) * (g - a * h)

    def exact():  # S[t] = sum exp(k - L[t]) x: every factor <= 1
      def add(s, xs1):
        k1, l0, l1, x1, y1 = xs1
        decay, r = tame(jnp.exp(l0 - l1)), tame(jnp.exp(k1 - l1))
        s = (s[0] * decay + r * x1, s[1] * decay + r * y1)
        return s, s

      scale = tame(jnp.exp(m_prev - lse_prev))
      l_before = jnp.concatenate([lse_prev[None], lse_c[:-1]])
      xs = (k, l_before, lse_c, x, y)
      (g, h), (sg, sh) = jax.lax.scan(add, (gh[0] * scale, gh[1] * scale), xs)
      back = tame(jnp.exp(lse_c[-1] - m))
      return (g * back, h * back), sg - a * sh

    carry, da = lse.cond(bad_c, exact, fast)
    return carry, jnp.where(keep(a_raw, lse_c), da, 0.0)

  zero = jnp.zeros_like(kc[0, 0])
  xs = (kc, vc, a, lse_, m, m_prev, lse_prev, bad, _chunked(dk, c), _chunked(dv, c))
  return jax.lax.scan(jax.checkpoint(step), (zero, zero), xs)[1]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def causal_mean(k, v, chunk: int = CHUNK, low: bool = False):  # a [T, R]; low: bfloat16 factors
  c = min(chunk, k.shape[0])
  a = _forward(_chunked(k, c, NEG), _chunked(v, c), low)[0]
  return a.reshape(-1, a.shape[-1])[: k.shape[0]]


@causal_mean.defjvp
def _causal_mean_jvp(chunk, low, primals, tangents):
  k, v = primals
  c = min(chunk, k.shape[0])
  kc, vc = _chunked(k, c, NEG), _chunked(v, c)  # shared by both passes
  a, lse_, m, bad = _forward(kc, vc, low)
  da = jax.checkpoint(functools.partial(_tangent, low))(kc, vc, a, lse_, m, bad, *tangents)
  unchunked = lambda x: x.reshape(-1, x.shape[-1])[: k.shape[0]]
  return unchunked(a), unchunked(da)
