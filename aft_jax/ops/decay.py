"""AFT with a learned decay (RWKV-4's WKV form of AFT): the op, its step and its chunked XLA
sums; its kernel: ``pallas.triton_decay`` (docs/kernels.md, "How each module computes")."""

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax.ops import common
from aft_jax.ops import logsumexp as lse
from aft_jax.ops.logsumexp import DEN_OK, NEG, Acc, tame
from aft_jax.ops.pallas import triton_decay

FN = "aft_decay"
KERNELS = (common.Kernel("gpu", triton_decay.decay_mean, triton_decay.unsupported),)
# Positions per chunk: matmuls of CHUNK x CHUNK (its speed: benchmarks/results/decay/).
CHUNK = 16
_sg = jax.lax.stop_gradient


def aft_decay(
  q, k, v, decay, bonus=None, *, causal=True, impl="auto", initial_state=None,
  output_final_state=False, segment_ids=None, axis_name=None,
):  # fmt: skip
  """AFT with a decaying bias, w[t, t'] = -decay (t - t') for t' < t and ``bonus`` for t' = t:

      Y[t] = sigma(q[t]) * (sum_{t' < t} exp(k[t'] - decay (t - t')) v[t'] + exp(k[t] + bonus)
             v[t]) / (the same sums without v)

  per channel. With decay 0 and no bonus it is causal ``aft_simple``. A decay per head is the
  caller's ``decay_H`` broadcast to ``[H, C]`` and flattened to D = H C.

  Args:
    q, k, v: ``[..., T, D]``.
    decay: ``[D]``, >= 0 (checked where concrete): the bias falls by this per position of
      distance.
    bonus: ``[D]``, the bias of t' = t; None: 0.
    causal: True (the decay is one-sided: causal=False is refused).
    impl: as ``aft_simple``; the kernel runs the whole sequence and a piece (packed rows: XLA).
    initial_state, output_final_state: as ``aft_simple``: an ``Acc``, the decayed triple of the
      positions before this piece (the state of ``aft_decay_step``).
    segment_ids: ``[..., T]`` ints, packed documents that do not see each other.
    axis_name: in ``jax.shard_map`` with T sharded over this mesh axis (the devices' pieces in
      order, of one length).

  Returns:
    ``[..., T, D]`` (the inputs' dtype), or ``(Y, state)``; O(T D CHUNK) time, O(T D) memory.
  """
  q, k, v = common.check_qkv(FN, q, k, v)
  if isinstance(causal, (bool, np.bool_)) and not causal:
    raise ValueError(
      f"{FN}: causal={causal!r} is not supported: the decay is one-sided (use causal=True)"
    )
  common.check_mode(
    FN, causal, impl, initial_state=initial_state, output_final_state=output_final_state,
    segment_ids=segment_ids, axis_name=axis_name,
  )  # fmt: skip
  common.check_arrays(FN, q.shape[:-1], segment_ids=segment_ids)
  decay, bonus = check_params(FN, decay, bonus, q.shape[-1])
  shape = q.shape[:-2] + q.shape[-1:]
  common.check_state(FN, initial_state, lambda: aft_decay_init(shape))
  return common.eager(
    _run, q=q, k=k, v=v, decay=decay, bonus=bonus, state=initial_state,
    segment_ids=segment_ids, final=output_final_state, impl=impl, axis_name=axis_name,
  )  # fmt: skip


def check_params(fn, decay, bonus, d: int):  # decay [D] >= 0 (where concrete), bonus None or [D]
  decay = common.array(fn, "decay", decay)
  bonus = None if bonus is None else common.array(fn, "bonus", bonus)
  common.check_arrays(fn, decay=decay, **({} if bonus is None else {"bonus": bonus}))
  for name, x in (("decay", decay), ("bonus", bonus)):
    if x is not None and x.shape != (d,):
      raise ValueError(f"{fn}: {name} must be [D] = ({d},); got {name} {x.shape}")
  if not isinstance(decay, jax.core.Tracer) and not bool(np.all(np.asarray(decay) >= 0)):
    raise ValueError(f"{fn}: decay must be >= 0 (and not NaN); got min {np.min(decay)}")
  return decay, bonus


def _run(q, k, v, decay, bonus, state, segment_ids, final, impl, axis_name):
  out_dt, dt = common.dtypes(q, k, v)
  shape = q.shape[:-2] + q.shape[-1:]
  if q.shape[-2] == 0:
    return lse.nothing(q, k, v, state, final, lambda: aft_decay_init(shape))
  lam = jnp.asarray(decay, dt)
  u = jnp.zeros_like(lam) if bonus is None else jnp.asarray(bonus, dt)
  if axis_name is not None:
    state = _shard_state(k.astype(dt), v.astype(dt), lam, axis_name)
  if segment_ids is None and common.resolve(FN, impl, KERNELS, causal=True, channels=shape[-1]):
    return _by_kernel(q, k, v, jnp.stack([lam, u]), state, final, impl)
  per_row = lambda x: _per_row(x, q.shape[:-2])
  k2, v2 = common.rows(k.astype(dt)), common.rows(v.astype(dt))
  starts = None
  if segment_ids is not None:
    seg = jnp.broadcast_to(segment_ids, q.shape[:-1])
    starts = common.rows(jnp.broadcast_to(lse._starts(seg)[..., None], q.shape))
  carry = lse.empty(k2.shape[1:]) if state is None else Acc(*(common.rows(x[..., None, :])[0]
                                                              for x in state))  # fmt: skip
  carry = Acc(*(x.astype(dt) for x in carry))
  a, carry = decayed_mean(k2, v2, per_row(lam), per_row(u), carry, starts, CHUNK)
  y = lse.gate(q.astype(dt), common.unrows(a, q.shape)).astype(out_dt)
  if not final:
    return y
  back = lambda x: common.unrows(x[None], shape[:-1] + (1, shape[-1]))[..., 0, :]
  return y, Acc(*(back(x) for x in carry))


def _per_row(x, lead):  # [D] -> [R], R = (lead) D as ``common.rows`` lays it out (lead: symbolic)
  return common.rows(jnp.broadcast_to(x, lead + (1, x.shape[-1])))[0]


def _by_kernel(q, k, v, w, state, final, impl):  # the state as a key before the piece
  def xla(k, v, w, _):  # where the kernel does not run (common.run)
    k2, v2, lam, u = common.rows(k), common.rows(v), *(_per_row(x, k.shape[:-2]) for x in w)
    a = decayed_mean(k2, v2, lam, u, lse.empty(k2.shape[1:]), None, CHUNK)[0]
    return common.unrows(a, k.shape)

  run = lambda q, k, v: common.run(FN, KERNELS, impl, xla, q, k, v, w, causal=True)
  y = lse.after_state(run, q, k, v, state)
  if not final:
    return y
  piece = _piece(k.astype(w.dtype), v.astype(w.dtype), w[0])
  return y, piece if state is None else _join(state, piece, w[0] * k.shape[-2])


def _piece(k, v, lam) -> Acc:  # the decayed triple of a piece k, v [..., n, D] at its end
  back = lam * np.arange(k.shape[-2] - 1, -1, -1)[:, None]  # [n, D]: each position's decay to it
  top = _sg(jnp.max(k - back, axis=-2, keepdims=True))
  e = _exp((k - top) - back)
  return Acc(top[..., 0, :], jnp.sum(_mul(e, v), axis=-2), jnp.sum(e, axis=-2))


def _join(before: Acc, after: Acc, gap) -> Acc:  # ``before`` decayed by ``gap``, then ``after``
  m = _sg(jnp.maximum(before.m - gap, after.m))
  f, g = _exp((before.m - m) - gap), _exp(after.m - m)
  return Acc(m, _mul(f, before.num) + _mul(g, after.num), _mul(f, before.den) + _mul(g, after.den))


def _shard_state(k, v, lam, axis_name):  # in shard_map: the state before this device's piece
  n, piece = k.shape[-2], _piece(k, v, lam)
  # Each earlier piece's state decays by lam n per piece between them.
  pieces = jax.lax.all_gather(piece, axis_name)  # [devices, ..., D]
  i, j = jax.lax.axis_index(axis_name), np.arange(jax.lax.axis_size(axis_name))
  before = jnp.reshape(j < i, (-1,) + (1,) * piece.m.ndim)
  gap = lam * jnp.reshape((i - 1 - j) * n, before.shape).astype(lam.dtype)
  top = _sg(jnp.max(jnp.where(before, pieces.m - gap, NEG), axis=0))
  f = jnp.where(before, _exp((pieces.m - top) - gap), 0.0)
  return Acc(top, jnp.sum(_mul(f, pieces.num), axis=0), jnp.sum(_mul(f, pieces.den), axis=0))


def aft_decay_init(shape) -> Acc:
  """The state before any token, for q_t, k_t, v_t of ``shape`` [..., D]."""
  return lse.empty(shape)


def aft_decay_step(state: Acc, q_t, k_t, v_t, decay, bonus=None):
  """One token: Y[t] = sigma(q[t]) * (exp(-decay) S + exp(k[t] + bonus) v[t]) / (the same
  without v), S the decayed sum of the past (``state``); then S = exp(-decay) S + exp(k[t]) v[t].
  q_t, k_t, v_t ``[..., D]``; decay, bonus ``[D]``. Returns ``(Y[t], state)`` (float32)."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  a, after = _step(state, f32(k_t), f32(v_t), f32(decay), f32(0.0 if bonus is None else bonus))
  return lse.gate(f32(q_t), a).astype(jnp.result_type(q_t, k_t, v_t)), after


# exp, a * b and a / b whose derivatives' factors are ``tame``d: a later NaN's zero cotangent
# times its NaN factor is 0, not NaN, so earlier positions' derivatives stay finite (as the
# other ops' custom derivatives). Values and finite derivatives are unchanged.
_exp, _mul, _div = (jax.custom_jvp(f) for f in (jnp.exp, jnp.multiply, jnp.divide))
_exp.defjvp(lambda x, t: (jnp.exp(x[0]), tame(jnp.exp(x[0])) * t[0]))
_mul.defjvp(lambda x, t: (x[0] * x[1], tame(x[1]) * t[0] + tame(x[0]) * t[1]))
_div.defjvp(lambda x, t: (x[0] / x[1], _div_tangent(x[0], 1 / x[1], *t)))
# Products of 1 / b: XLA would rewrite a / b / b as a / (b * b), which overflows past 1e19.
_div_tangent = lambda a, r, ta, tb: tame(r) * ta - tame(a * r * r) * tb


def _step(state: Acc, k, v, lam, u):  # (the mean at this position, the state after it)
  # exp(-lam) S + exp(k) [v, 1]: lam is subtracted from m - max, not from m (at m = 60,
  # m - 1e-6 rounds to m), the max rounded as it may be.
  m = _sg(jnp.maximum(state.m - lam, k))
  old, new = _exp((state.m - m) - lam), _exp(k - m)
  # The bonus' factor exp(u) on the new term, or exp(-u) on the past: every factor <= 1.
  scale = jnp.exp(-jnp.abs(u))
  past, now = old * jnp.where(u >= 0, scale, 1.0), new * jnp.where(u >= 0, 1.0, scale)
  seen = _div(_mul(state.num, past) + _mul(v, now), _mul(state.den, past) + now)
  return seen, Acc(m, _mul(state.num, old) + _mul(v, new), _mul(state.den, old) + new)


def _chunk(carry: Acc, kc, vc, lam, u, start, sc):
  """One chunk of c positions from ``start``: the means a [c, R], the state after it. Fast: every
  term scaled to the chunk's end (a row factor that cancels) and shifted by one max per channel,
  the first row's, exp((k[j] - max) - lam (c - 1 - j)), summed by matmuls. The steps' instead
  from a term set aside (over ``EXP_MAX``, non-finite), a sum that may have lost its terms to
  underflow and a document that starts inside the chunk on."""
  c, r = kc.shape
  fresh = None if sc is None else sc == start + np.arange(c)[:, None]  # documents' first rows
  carried = True if sc is None else ~fresh[0]
  back = lam * np.arange(c - 1, -1, -1)[:, None]  # [c, R]: each position's decay to the end
  m = _sg(jnp.maximum(jnp.where(carried, carry.m - lam, NEG), kc[0]))
  ok, e, vs = lse.set_aside(_exp((kc - m) - back), vc)
  okd, ed, _ = lse.set_aside(_mul(e, jnp.exp(u)), vs)
  s0 = jnp.where(carried, _exp((carry.m - m) - lam * c), 0.0)
  ev, tri = e * vs, np.tril(np.ones((c, c), np.float32), -1)  # tri: the sums of j < i
  num = _mul(carry.num, s0) + lse.matmul("ij,jx->ix", tri, ev, False)
  den = _mul(carry.den, s0) + lse.matmul("ij,jx->ix", tri, e, False)
  a = _div(num + ed * vs, den + ed)
  # The state after the chunk in the scale of its own largest term (else its den, at exp(60)
  # after rising keys, would meet a factor exp(-100) that underflows).
  top = _sg(jnp.maximum(jnp.where(carried, carry.m - lam * c, NEG), jnp.max(kc - back, axis=0)))
  scale = _exp(m - top)
  after = Acc(top, _mul(num[-1] + ev[-1], scale), _mul(den[-1] + e[-1], scale))
  bad = ~(ok & okd)
  small = ~(jnp.minimum(den + ed, den + e) >= DEN_OK)
  inside = False if sc is None else sc != sc[0]  # rows of a document that starts in the chunk

  def steps():  # the flagged rows only: the others keep the fast values, bit for bit
    def one(acc, xs):
      k1, v1, new_doc = xs
      if new_doc is not None:
        acc = Acc(*(jnp.where(new_doc, f, x) for x, f in zip(acc, (NEG, 0.0, 0.0))))
      return _step(acc, k1, v1, lam, u)[::-1]

    end, exact = jax.lax.scan(one, carry, (kc, vc, fresh))
    redo = (jax.lax.cummax(bad.astype(jnp.int32), axis=0) > 0) | small | inside
    return jnp.where(redo, exact, a), end

  return lse.cond(jnp.any(bad | small | inside), steps, lambda: (a, after))


def decayed_mean(k, v, lam, u, carry: Acc, starts, chunk: int):
  """The weighted means a [T, R] of k, v [T, R] (decay ``lam``, bonus ``u`` [R]) after ``carry``
  (the state before position 0), and the state after T; ``starts`` [T, R]: each position's
  segment start (None: one segment). Chunks of ``chunk`` positions in a scan, the rest after."""
  t_len, r = k.shape
  carry = Acc(*(x + jnp.zeros_like(k[0]) for x in carry))  # k's type: varying in shard_map
  c = min(chunk, t_len)
  whole = t_len // c * c
  body = jax.checkpoint(lambda acc, xs: _chunk(acc, *xs[:2], lam, u, *xs[2:])[::-1])
  outs = []
  if whole:
    split = lambda x: None if x is None else x[:whole].reshape(-1, c, r)
    xs = (split(k), split(v), jnp.arange(0, whole, c), split(starts))
    carry, a = jax.lax.scan(body, carry, xs)
    outs.append(a.reshape(whole, r))
  if whole < t_len:
    rest = lambda x: None if x is None else x[whole:]
    a, carry = _chunk(carry, rest(k), rest(v), lam, u, whole, rest(starts))
    outs.append(a)
  return (outs[0] if len(outs) == 1 else jnp.concatenate(outs)), carry
