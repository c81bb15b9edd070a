"""AFT with a learned decay (RWKV-4's WKV form of AFT): the op, its step and its chunked XLA
sums; no kernel yet (docs/kernels.md, "How each module computes")."""

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax.ops import common
from aft_jax.ops import logsumexp as lse
from aft_jax.ops.logsumexp import NEG, Acc

FN = "aft_decay"
CHUNK = 8  # positions per chunk: on CPU the fastest of 4 to 32, forward and backward
FAST = True  # chunks summed with one shift per channel first (``_fast_chunk``)
# A one-shift denominator below this is redone: its lost terms (< ~1e-38) could matter, and the
# derivative of num / den takes den squared (1e-15 squared is still a normal float32).
DEN_FAST = 1e-15
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
    impl: "auto" or "xla" (XLA, the only implementation for now).
    initial_state, output_final_state: as ``aft_simple``: an ``Acc``, the decayed triple of the
      positions before this piece (the state of ``aft_decay_step``).
    segment_ids: ``[..., T]`` ints, packed documents that do not see each other.
    axis_name: not supported yet (a ValueError).

  Returns:
    ``[..., T, D]`` (the inputs' dtype), or ``(Y, state)``; O(T D CHUNK) time, O(T D) memory.
  """
  q, k, v = common.check_qkv(FN, q, k, v)
  if isinstance(causal, (bool, np.bool_)) and not causal:
    raise ValueError(
      f"{FN}: causal={causal!r} is not supported: the decay is one-sided (use causal=True)"
    )
  if impl in ("pallas", "pallas_interpret"):
    raise ValueError(f"{FN}: impl={impl!r} is not available: there is no Pallas kernel for this "
                     "op yet; use impl='xla'")  # fmt: skip
  if axis_name is not None:
    raise ValueError(f"{FN}: axis_name (T sharded over devices) is not supported yet; got "
                     f"axis_name={axis_name!r}")  # fmt: skip
  common.check_mode(
    FN, causal, impl, initial_state=initial_state, output_final_state=output_final_state,
    segment_ids=segment_ids,
  )  # fmt: skip
  common.check_arrays(FN, q.shape[:-1], segment_ids=segment_ids)
  decay, bonus = check_params(FN, decay, bonus, q.shape[-1])
  shape = q.shape[:-2] + q.shape[-1:]
  common.check_state(FN, initial_state, lambda: aft_decay_init(shape))
  return common.eager(
    _run, q=q, k=k, v=v, decay=decay, bonus=bonus, state=initial_state,
    segment_ids=segment_ids, final=output_final_state,
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


def _run(q, k, v, decay, bonus, state, segment_ids, final):
  out_dt, dt = common.dtypes(q, k, v)
  shape = q.shape[:-2] + q.shape[-1:]
  if q.shape[-2] == 0:
    return lse.nothing(q, k, v, state, final, lambda: aft_decay_init(shape))
  lam = jnp.asarray(decay, dt)
  u = jnp.zeros_like(lam) if bonus is None else jnp.asarray(bonus, dt)
  n = int(np.prod(q.shape[:-2], dtype=np.int64))
  per_row = lambda x: jnp.tile(x, n)  # [D] -> [R], R = (batch) D as ``common.rows`` lays it out
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


def aft_decay_init(shape) -> Acc:
  """The state before any token, for q_t, k_t, v_t of ``shape`` [..., D]."""
  return lse.empty(shape)


def aft_decay_step(state: Acc, q_t, k_t, v_t, decay, bonus=None):
  """One token: Y[t] = sigma(q[t]) * (exp(-decay) S + exp(k[t] + bonus) v[t]) / (the same
  without v), S the decayed sum of the past (``state``); then S = exp(-decay) S + exp(k[t]) v[t].
  q_t, k_t, v_t ``[..., D]``; decay, bonus ``[D]``. Returns ``(Y[t], state)`` (float32)."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  dt = jnp.result_type(q_t, k_t, v_t)
  k_t, v_t = f32(k_t), f32(v_t)
  past = Acc(state.m - f32(decay), state.num, state.den)
  new = lse.combine(past, lse.leaf(k_t, v_t))
  seen = new if bonus is None else lse.combine(past, lse.leaf(k_t + f32(bonus), v_t))
  return lse.output(f32(q_t), seen).astype(dt), new


def _chunk_tables(c: int):
  """Rows 0..c-1: the chunk's outputs; row c: its final state. (distance of key j from row i,
  j counts, j is row i's own position, the carried state's distance) as NumPy constants."""
  i, j = np.arange(c + 1)[:, None], np.arange(c)[None, :]
  last = i == c
  dist = np.where(last, c - 1 - j, i - j)
  counts = np.where(last, True, j <= i)
  own = (i == j) & ~last
  carried = np.minimum(np.arange(c + 1) + 1, c)
  return dist, counts, own, carried, np.minimum(np.arange(c + 1), c - 1)


def _chunk(carry: Acc, kc, vc, lam, u, start, sc):
  """One chunk of c positions from ``start``: a [c, R], the state after it. Exact: every row's
  terms, the carried state's among them, are shifted by that row's own maximum."""
  c = kc.shape[0]
  dist, counts, own, carried, row_pos = _chunk_tables(c)
  logits = kc[None] - lam * dist[..., None] + jnp.where(own[..., None], u, 0.0)  # [c+1, c, R]
  ok = jnp.broadcast_to(counts[..., None], logits.shape)
  carried_ok = True
  if sc is not None:  # a key counts from its row's segment start on; the state only before it
    row_start = sc[row_pos]  # [c+1, R]
    ok = ok & (row_start[:, None, :] <= start + np.arange(c)[None, :, None])
    carried_ok = row_start < start
  logits = jnp.where(ok, logits, NEG)
  old = jnp.where(carried_ok, carry.m[None] - lam * carried[:, None], NEG)  # [c+1, R]
  m = _sg(jnp.maximum(old, jnp.max(logits, axis=1)))
  p, p_old = jnp.where(ok, jnp.exp(logits - m[:, None]), 0.0), jnp.exp(old - m)
  num = p_old * carry.num + jnp.sum(p * vc[None], axis=1)
  den = p_old * carry.den + jnp.sum(p, axis=1)
  return num[:c] / den[:c], Acc(m[c], num[c], den[c])


def _fast_chunk(carry: Acc, kc, vc, lam, u, start, sc, powers):
  """``_chunk`` with one shift per channel, the chunk's largest logit (the carried state's
  included): every factor is <= 1, so a term loses precision only below ~1e-38 of the shift, and
  rows whose denominator stays above ``DEN_FAST`` are exact. ``bad``: some row's is not."""
  c = kc.shape[0]
  dist, counts, own, carried, row_pos = _chunk_tables(c)
  w, w_old = powers  # exp(-lam dist) where a key counts (the own one apart) [c+1, c, R]; [c+1, R]
  old_ok = True
  if sc is not None:
    row_start = sc[row_pos]
    w = jnp.where(row_start[:, None, :] <= start + np.arange(c)[None, :, None], w, 0.0)
    old_ok = row_start < start
  shift = _sg(jnp.maximum(jnp.maximum(jnp.max(kc, 0), jnp.max(kc + u, 0)), carry.m - lam))
  e, e_own = jnp.exp(kc - shift), jnp.exp(kc + u - shift)
  e_old = jnp.where(old_ok, jnp.exp(carry.m - lam - shift) * w_old, 0.0)  # [c+1, R]
  num = e_old * carry.num + jnp.sum(w * (e * vc)[None], axis=1)
  den = e_old * carry.den + jnp.sum(w * e[None], axis=1)
  num, den = num.at[:c].add(e_own * vc), den.at[:c].add(e_own)
  m = _sg(shift + jnp.log(jnp.maximum(den[c], DEN_FAST)))
  scale = _sg(jnp.exp(shift - m))
  ok = den >= DEN_FAST
  den = jnp.where(ok, den, 1.0)  # (a bad chunk's values are redone: no 0 / 0, even in a gradient)
  return num[:c] / den[:c], Acc(m, num[c] * scale, den[c] * scale), ~jnp.all(ok)


def _powers(c: int, lam):  # exp(-lam dist) of the keys that count (not the own one), [c+1, c, R]
  dist, counts, own, carried, _ = _chunk_tables(c)
  keys = counts & ~own
  w = jnp.where(keys[..., None], jnp.exp(-lam * np.where(keys, dist, 0)[..., None]), 0.0)
  return w, jnp.exp(-lam * (carried[:, None] - 1))


def decayed_mean(k, v, lam, u, carry: Acc, starts, chunk: int):
  """The weighted means a [T, R] of k, v [T, R] (decay ``lam``, bonus ``u`` [R]) after ``carry``
  (the state before position 0), and the state after T; ``starts`` [T, R]: each position's
  segment start (None: one segment). Chunks of ``chunk`` positions in a scan, the rest after:
  each by ``_fast_chunk`` unless one of its rows needs ``_chunk``'s exact shifts."""
  t_len, r = k.shape
  c = min(chunk, t_len)
  whole = t_len // c * c

  def one(acc, kc, vc, start, sc, powers):
    a, new, bad = _fast_chunk(acc, kc, vc, lam, u, start, sc, powers)
    exact = lambda: _chunk(acc, kc, vc, lam, u, start, sc)
    return lse.cond(bad, exact, lambda: (a, new)) if FAST else exact()

  body = jax.checkpoint(lambda acc, xs, powers: one(acc, *xs, powers)[::-1])
  outs = []
  if whole:
    split = lambda x: None if x is None else x[:whole].reshape(-1, c, r)
    xs = (split(k), split(v), jnp.arange(0, whole, c), split(starts))
    powers = _powers(c, lam)  # outside the scan: once, not per chunk
    carry, a = jax.lax.scan(lambda acc, xs: body(acc, xs, powers), carry, xs)
    outs.append(a.reshape(whole, r))
  if whole < t_len:
    rest = lambda x: None if x is None else x[whole:]
    a, carry = one(carry, rest(k), rest(v), whole, rest(starts), _powers(t_len - whole, lam))
    outs.append(a)
  return (outs[0] if len(outs) == 1 else jnp.concatenate(outs)), carry
