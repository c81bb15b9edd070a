"""Causal AFT with a learned decay (``ops.decay``): its mean as Pallas Triton kernels for k, v
``[B, T, D]`` and w = (decay, bonus) ``[2, D]``, forward and custom VJP (docs/kernels.md)."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from aft_jax.ops.logsumexp import NEG, tame
from aft_jax.ops.pallas import triton
from aft_jax.ops.pallas.triton import TritonConfig, colsum, load, rows

_f32 = lambda x: x.astype(jnp.float32)


def _row_iota(bt: int):
  return jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0)


def _fwd_kernel(k_ref, v_ref, w_ref, a_ref, *lse_ref, bt: int):
  """Per chunk: each row's terms (the chunk's keys, the carried state) shifted by its own max."""
  lam, u = load(w_ref, pl.ds(0, 1)), load(w_ref, pl.ds(1, 1))  # [1, bd]
  i = _row_iota(bt)

  def chunk(j, carry):
    m0, num0, den0 = carry  # the decayed triple after the previous row

    def key(r):  # key r of the chunk against rows i: (seen, k_r, its bias -lam (i - r) [+ u])
      k_r = load(k_ref, pl.ds(j * bt + r, 1))
      return i >= r, k_r, jnp.where(i == r, u, 0.0) - lam * _f32(i - r)

    def top(r, m):
      seen, k_r, bias = key(r)
      return jnp.maximum(m, jnp.where(seen, k_r + bias, NEG))

    m = jax.lax.fori_loop(0, bt, top, m0 - lam * _f32(i + 1))
    # exp((logit - max) + bias): a decay below the rounding of a large logit still counts.
    s0 = jnp.exp((m0 - m) - lam * _f32(i + 1))

    def add(r, nd):
      seen, k_r, bias = key(r)
      p = jnp.where(seen, jnp.exp((k_r - m) + bias), 0.0)
      v_r = jnp.where(seen, load(v_ref, pl.ds(j * bt + r, 1)), 0.0)
      return nd[0] + p * v_r, nd[1] + p

    num, den = jax.lax.fori_loop(0, bt, add, (s0 * num0, s0 * den0))
    idx = rows(j, bt)
    a_ref[idx, :] = num / den
    if lse_ref:
      lse_ref[0][idx, :] = m + jnp.log(den)
    kc, vc, to_end = load(k_ref, idx), load(v_ref, idx), lam * _f32(bt - 1 - i)
    m1 = jnp.maximum(m0 - lam * bt, jnp.max(kc - to_end, axis=0, keepdims=True))
    e, s1 = jnp.exp((kc - m1) - to_end), jnp.exp((m0 - m1) - lam * bt)
    return m1, s1 * num0 + colsum(e * vc), s1 * den0 + colsum(e)

  jax.lax.fori_loop(0, k_ref.shape[0] // bt, chunk, triton.empty(k_ref.shape[1]))


def _bwd_kernel(k_ref, v_ref, w_ref, a_ref, lse_ref, g_ref, dk_ref, dv_ref, dw_ref, *, bt: int):
  """Chunks last to first. Pairs (query t, key t'): P = exp(k[t'] + bias - L[t]) <= 1, and
  dv[t'] = sum P g, dk[t'] = sum P g (v[t'] - a[t]), d decay = -sum P g (t - t') (v[t'] - a[t]).
  The later chunks' queries arrive as C = sum exp(-decay (t - t0) - L[t] - mc) (g, g a) and E,
  the same times (t - t0), t0 the next chunk's first row, mc their max (so exp(k + mc) <= 1)."""
  lam, u = load(w_ref, pl.ds(0, 1)), load(w_ref, pl.ds(1, 1))
  r, n_chunks = _row_iota(bt), k_ref.shape[0] // bt
  rf = _f32(r)

  def chunk(n, carry):
    mc, c1, c2, e1, e2, dlam, du = carry
    j = n_chunks - 1 - n
    idx = rows(j, bt)
    kc, vc = load(k_ref, idx), load(v_ref, idx)
    dist = _f32(bt - r)  # from key r to the next chunk's first row
    f = jnp.exp((kc + mc) - lam * dist)
    acc = (f * c1, f * c2, f * (e1 + dist * c1), f * (e2 + dist * c2))

    def query(q, acc):  # this chunk's query q against its keys r <= q
      pg_sum, pga_sum, pgd_sum, pgad_sum, du = acc
      rq = pl.ds(j * bt + q, 1)
      lq, gq, aq, d = load(lse_ref, rq), load(g_ref, rq), load(a_ref, rq), _f32(q - r)
      bias = jnp.where(r == q, u, 0.0) - lam * d
      pg = jnp.where(r <= q, jnp.exp((kc - lq) + bias), 0.0) * gq
      du = du + colsum(jnp.where(r == q, pg * (vc - aq), 0.0))
      return pg_sum + pg, pga_sum + pg * aq, pgd_sum + pg * d, pgad_sum + pg * aq * d, du

    pg, pga, pgd, pgad, du = jax.lax.fori_loop(0, bt, query, (*acc, du))
    dv_ref[idx, :] = pg.astype(dv_ref.dtype)
    dk_ref[idx, :] = (vc * pg - pga).astype(dk_ref.dtype)
    dlam = dlam - colsum(vc * pgd - pgad)
    # The carry at this chunk's first row: its queries at distance r, the later ones at bt.
    lse, g = load(lse_ref, idx), load(g_ref, idx)
    ga = g * load(a_ref, idx)
    m = jnp.maximum(mc - lam * bt, jnp.max(-lse - lam * rf, axis=0, keepdims=True))
    s, e = jnp.exp((mc - m) - lam * bt), jnp.exp((-lse - m) - lam * rf)
    e1, e2 = s * (e1 + bt * c1) + colsum(e * g * rf), s * (e2 + bt * c2) + colsum(e * ga * rf)
    return m, s * c1 + colsum(e * g), s * c2 + colsum(e * ga), e1, e2, dlam, du

  zero = jnp.zeros((1, k_ref.shape[1]), jnp.float32)
  out = jax.lax.fori_loop(0, n_chunks, chunk, (zero + NEG, *(zero,) * 6))
  dw_ref[pl.ds(0, 1), :], dw_ref[pl.ds(1, 1), :] = out[-2], out[-1]


def _call(kernel, cfg: TritonConfig, interpret: bool, ins, outs):
  """pallas_call over (batch, D / block_d): columns of T, w's [2, block_d]; ``outs``: (shape
  of one program's block, dtype), a [2, ...] block for d(decay, bonus)."""
  (b, t_len, d), bd = ins[0].shape, cfg.block_d
  spec = lambda n: pl.BlockSpec((None, n, bd), lambda i, j: (i, 0, j))
  in_specs = [spec(t_len), spec(t_len), pl.BlockSpec((2, bd), lambda i, j: (0, j))]
  in_specs += [spec(t_len)] * (len(ins) - 3)
  out_shape = [jax.ShapeDtypeStruct((b, n, d), dt) for n, dt in outs]
  kernel = functools.partial(kernel, bt=cfg.block_t)
  out_specs = [spec(n) for n, _ in outs]
  return triton.call(kernel, cfg, interpret, (b, d // bd), in_specs, out_specs, out_shape, ins)


def _forward(k, v, w, static, with_lse: bool):  # over T padded to whole chunks
  cfg, interpret = static
  ins = (*triton.padded_to_chunks(k, v, cfg.block_t), w.astype(jnp.float32))
  t_pad = ins[0].shape[1]
  return _call(_fwd_kernel, cfg, interpret, ins, [(t_pad, jnp.float32)] * (1 + with_lse))


def _backward(k, v, w, a, lse, g, static):
  cfg, interpret = static
  k2, v2 = triton.padded_to_chunks(tame(k), tame(v), cfg.block_t)
  t_pad, t_len = k2.shape[1], k.shape[1]
  outs = [(t_pad, k.dtype), (t_pad, v.dtype), (2, jnp.float32)]
  dk, dv, dw = _call(_bwd_kernel, cfg, interpret, (k2, v2, w.astype(jnp.float32), a, lse, g), outs)
  return dk[:, :t_len], dv[:, :t_len], jnp.sum(dw, axis=0).astype(w.dtype)


_mean = triton.mean_with_vjp(_forward, _backward)


def decay_mean(k_BTD, v_BTD, w_2D, window=None, cfg: TritonConfig | None = None, interpret=False):
  """a ``[B, T, D]`` float32 of k, v and w = (decay, bonus) ``[2, D]``, differentiable in all
  three; default configuration ``triton.config_for``'s (``window``: unused, ``common.run``'s)."""
  return _mean(k_BTD, v_BTD, w_2D, (cfg or triton.config_for(k_BTD.shape[2], k_BTD.shape[0]), interpret))


unsupported = triton.unsupported_channels
