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


def _params(w_ref, bt: int):  # decay, bonus [1, bd]; the chunk's rows [bt, 1] (int, float)
  i = jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
  return load(w_ref, pl.ds(0, 1)), load(w_ref, pl.ds(1, 1)), i, _f32(i)


def _fwd_kernel(k_ref, v_ref, w_ref, a_ref, *res_refs, bt: int):
  """Per chunk, each row's terms (its keys in the chunk, the carried state) shifted by their
  max m: a [and the residuals log(den), m: the backward's P = exp(k + bias - m - log(den)))]."""
  lam, u, i, fi = _params(w_ref, bt)

  def chunk(j, carry):
    m0, num0, den0 = carry  # the decayed triple after the previous row

    def key(r):  # key r against rows i >= r: (seen, k[r], bias -decay (i - r), + bonus at r)
      return i >= r, load(k_ref, pl.ds(j * bt + r, 1)), jnp.where(i == r, u, 0.0) - lam * (fi - r)

    def top(r, m):
      seen, k_r, bias = key(r)
      return jnp.maximum(m, jnp.where(seen, k_r + bias, NEG))

    m = jax.lax.fori_loop(0, bt, top, m0 - lam * (fi + 1))
    # exp((logit - max) + bias): a decay below the rounding of a large logit still counts.
    s0 = jnp.exp((m0 - m) - lam * (fi + 1))

    def add(r, nd):
      seen, k_r, bias = key(r)
      p = jnp.where(seen, jnp.exp((k_r - m) + bias), 0.0)
      return nd[0] + p * jnp.where(seen, load(v_ref, pl.ds(j * bt + r, 1)), 0.0), nd[1] + p

    num, den = jax.lax.fori_loop(0, bt, add, (s0 * num0, s0 * den0))
    idx = rows(j, bt)
    a_ref[idx, :] = num / den
    for ref, x in zip(res_refs, (jnp.log(den), m)):
      ref[idx, :] = x
    kc, vc, to_end = load(k_ref, idx), load(v_ref, idx), lam * (bt - 1 - fi)
    m1 = jnp.maximum(m0 - lam * bt, jnp.max(kc - to_end, axis=0, keepdims=True))
    e, s1 = jnp.exp((kc - m1) - to_end), jnp.exp((m0 - m1) - lam * bt)
    return m1, s1 * num0 + colsum(e * vc), s1 * den0 + colsum(e)

  jax.lax.fori_loop(0, k_ref.shape[0] // bt, chunk, triton.empty(k_ref.shape[1]))


def _bwd_kernel(k_ref, v_ref, w_ref, a_ref, ld_ref, g_ref, m_ref, dk_ref, dv_ref, dw_ref, *, bt):
  """Chunks last to first; pairs (query t, key t' <= t) of weight P, from the forward's shift m
  and log(den): dv[t'] = sum P g, dk[t'] = sum P g (v[t'] - a[t]), d decay = -sum P g (t - t')
  (v[t'] - a[t]). Later chunks' queries arrive as C = sum exp(-decay (t - t0) - L[t] - mc)
  (g, g a) and E, C times (t - t0): t0 the next chunk's first row, mc their max of -m - decay
  (t - t0), so that exp(k + mc) <= 1."""
  lam, u, r, fr = _params(w_ref, bt)
  n_chunks = k_ref.shape[0] // bt

  def chunk(n, carry):
    mc, c1, c2, e1, e2, dlam, du = carry
    j = n_chunks - 1 - n
    idx = rows(j, bt)
    kc, vc = load(k_ref, idx), load(v_ref, idx)
    f = jnp.exp((kc + mc) - lam * (bt - fr))  # key r is bt - r before t0
    acc = (f * c1, f * c2, f * (e1 + (bt - fr) * c1), f * (e2 + (bt - fr) * c2))

    def query(q, acc):  # this chunk's query q against its keys r <= q
      pg_sum, pga_sum, pgd_sum, pgad_sum, du = acc
      rq = pl.ds(j * bt + q, 1)
      gq, aq, d = load(g_ref, rq), load(a_ref, rq), q - fr
      bias = jnp.where(r == q, u, 0.0) - lam * d - load(ld_ref, rq)
      pg = jnp.where(r <= q, jnp.exp((kc - load(m_ref, rq)) + bias), 0.0) * gq
      du = du + colsum(jnp.where(r == q, pg * (vc - aq), 0.0))
      return pg_sum + pg, pga_sum + pg * aq, pgd_sum + pg * d, pgad_sum + pg * aq * d, du

    pg, pga, pgd, pgad, du = jax.lax.fori_loop(0, bt, query, (*acc, du))
    dv_ref[idx, :] = pg.astype(dv_ref.dtype)
    dk_ref[idx, :] = (vc * pg - pga).astype(dk_ref.dtype)
    # The carry at this chunk's first row: its queries at distance r, the later ones at bt.
    g, mq = load(g_ref, idx), load(m_ref, idx)
    ga = g * load(a_ref, idx)
    m = jnp.maximum(mc - lam * bt, jnp.max(-mq - lam * fr, axis=0, keepdims=True))
    s, e = jnp.exp((mc - m) - lam * bt), jnp.exp(((-mq - m) - lam * fr) - load(ld_ref, idx))
    e1, e2 = s * (e1 + bt * c1) + colsum(e * g * fr), s * (e2 + bt * c2) + colsum(e * ga * fr)
    dlam = dlam - colsum(vc * pgd - pgad)
    return m, s * c1 + colsum(e * g), s * c2 + colsum(e * ga), e1, e2, dlam, du

  zero = jnp.zeros((1, k_ref.shape[1]), jnp.float32)
  out = jax.lax.fori_loop(0, n_chunks, chunk, (zero + NEG, *(zero,) * 6))
  dw_ref[pl.ds(0, 1), :], dw_ref[pl.ds(1, 1), :] = out[-2], out[-1]


def _call(kernel, cfg: TritonConfig, interpret: bool, ins, outs):
  """Over (batch, D / block_d): ins k, v, w [2, D], then [B, T, D]; outs (rows, dtype)."""
  (b, t_len, d), bd = ins[0].shape, cfg.block_d
  spec = lambda n: pl.BlockSpec((None, n, bd), lambda i, j: (i, 0, j))
  in_specs = [spec(t_len)] * 2 + [pl.BlockSpec((2, bd), lambda i, j: (0, j))]
  in_specs += [spec(t_len)] * (len(ins) - 3)
  out_shape = [jax.ShapeDtypeStruct((b, n, d), dt) for n, dt in outs]
  kernel = functools.partial(kernel, bt=cfg.block_t)
  out_specs = [spec(n) for n, _ in outs]
  return triton.call(kernel, cfg, interpret, (b, d // bd), in_specs, out_specs, out_shape, ins)


def _forward(k, v, w, static, with_res: bool):  # a [, log(den), m] over T padded to chunks
  cfg, interpret = static
  ins = (*triton.padded_to_chunks(k, v, cfg.block_t), w.astype(jnp.float32))
  outs = [(ins[0].shape[1], jnp.float32)] * (1 + 2 * with_res)
  return _call(_fwd_kernel, cfg, interpret, ins, outs)


def _backward(k, v, w, a, log_den, g, static, m):
  cfg, interpret = static
  k2, v2 = triton.padded_to_chunks(tame(k), tame(v), cfg.block_t)
  ins = (k2, v2, w.astype(jnp.float32), a, log_den, g, tame(m))
  t_pad, t_len = k2.shape[1], k.shape[1]
  outs = [(t_pad, k.dtype), (t_pad, v.dtype), (2, jnp.float32)]
  dk, dv, dw = _call(_bwd_kernel, cfg, interpret, ins, outs)
  return dk[:, :t_len], dv[:, :t_len], jnp.sum(dw, axis=0).astype(w.dtype)


_mean = triton.mean_with_vjp(_forward, _backward)


def decay_mean(k_BTD, v_BTD, w_2D, window=None, cfg: TritonConfig | None = None, interpret=False):
  """a ``[B, T, D]`` float32 of k, v and w = (decay, bonus) ``[2, D]``, differentiable in all
  three; default configuration ``triton.config_for``'s (``window``: unused, ``common.run``'s)."""
  cfg = cfg or triton.config_for(k_BTD.shape[2], k_BTD.shape[0])
  return _mean(k_BTD, v_BTD, w_2D, (cfg, interpret))


unsupported = triton.unsupported_channels
