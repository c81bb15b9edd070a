"""Causal AFT-local's banded softmax-weighted mean as a Pallas kernel (GPU: Triton lowering).

For k, v ``[B, T, D]`` (bfloat16 or float32; all arithmetic in float32), w ``[T, T]`` and the
window s:

    a[t] = sum_{t' <= t} exp(k[t'] + b[t, t']) v[t'] / sum_{t' <= t} exp(k[t'] + b[t, t'])

with b[t, t'] = w[t, t'] for t - t' < s and 0 for the older keys (which still count).

Layout. One program per (batch row, block of ``block_d`` channels) walks the queries in chunks
of ``block_t`` = c rows. Chunk j sees its band, the keys [j c - S, j c + c) with S = s - 1
rounded up to a multiple of c (a "slab" of S + c keys, read as (S + c) / c key blocks of c),
and every older key, whose bias is 0 for all its rows: those are carried as one exact running
triple (max, num, den) per channel, as in ``pallas_simple``. The slab's sums are matrix
products, per key block, of exp(b - row max) [c, c] and exp(k - channel max) [v, 1] [c, 2 bd],
exactly as ``banded`` does in XLA; b is gathered beforehand (in XLA) into a ``[T, S + c]``
array of the slab's biases (w on the band, 0 for older keys, -inf beyond t or before 0). The
split shift is exact unless a row's largest term underflows, which shows as a denominator
below ``DEN_OK``; such a chunk is redone row by row with a per-channel running maximum, so the
result is exact for logits of any size.

Backward. A custom VJP whose backward pass is the XLA path's derivative (``jax.vjp`` of
``banded.banded_mean``: it recomputes the forward in XLA and runs its hand-written tangent,
transposed); only the forward is a kernel for now. Residuals: the inputs k, v, w.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from aft_jax.ops import banded, pallas_util
from aft_jax.ops.logsumexp import DEN_OK, NEG
from aft_jax.ops.pallas_util import CONFIGS, Config, all_true, config_for, dot, load, rows

__all__ = ["CONFIGS", "MAX_WINDOW", "Config", "config_for", "local_mean", "unsupported"]

# The slab a chunk reads grows with the window (O(T (s + c) D) work, a [T, s + c] bias array):
# beyond this the band is most of the sequence, which is AFT-full's job.
MAX_WINDOW = 1024


def unsupported(d: int, window: int) -> str | None:
  """Why the kernel cannot take D = d channels and this window, or None if it can."""
  if window > MAX_WINDOW:
    return f"the window {window} is larger than the kernel's {MAX_WINDOW}"
  return pallas_util.unsupported_channels(d)


def _slab_width(s: int, bt: int) -> int:
  """Keys a chunk reads: its own bt plus s - 1 earlier ones, rounded up to key blocks of bt."""
  return bt * (-(-(s - 1) // bt) + 1)


def _slab_bias(w, s: int, t_pad: int, bt: int):
  """[t_pad, W] float32: row t, column u is the bias of key t' = (t // bt) bt - (W - bt) + u
  for query t: w[t, t'] where 0 <= t - t' < s, 0 for older keys, NEG beyond t or before 0."""
  t_len = w.shape[0]
  width = _slab_width(s, bt)
  t = jnp.arange(t_pad)[:, None]
  tk = (t // bt) * bt - (width - bt) + jnp.arange(width)[None, :]
  band = w[jnp.minimum(t, t_len - 1), jnp.clip(tk, 0, t_len - 1)].astype(jnp.float32)
  bias = jnp.where(t - tk < s, band, 0.0)
  return jnp.where((tk <= t) & (tk >= 0), bias, NEG)


def _fwd_kernel(bias_ref, k_ref, v_ref, a_ref, *, bt: int, t_len: int):
  """One (batch row, channel block): a [t_pad, bd] for the slab biases [t_pad, W] and k, v
  [W - bt + t_pad, bd] (front-padded by W - bt keys, so chunk j's slab starts at key row j bt)."""
  t_pad, width = bias_ref.shape
  n_chunks, n_keys = t_pad // bt, width // bt
  bd = k_ref.shape[1]
  eye = jnp.where(
    jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    == jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1),
    1.0,
    0.0,
  )

  def keys(j, u):
    """Key block u of chunk j's slab: biases [bt rows, bt keys], keys and values [bt, bd]."""
    idx = rows(j + u, bt)
    return bias_ref[rows(j, bt), rows(u, bt)], load(k_ref, idx), load(v_ref, idx)

  def chunk(j, carry):
    m0, num0, den0 = carry  # [1, bd]: the keys before the slab (bias 0 for every row)

    def maxima(u, mm):
      b, kb, _ = keys(j, u)
      return (
        jnp.maximum(mm[0], jnp.max(b, axis=1, keepdims=True)),
        jnp.maximum(mm[1], jnp.max(kb, axis=0, keepdims=True)),
      )

    mw, mk = jax.lax.fori_loop(
      0, n_keys, maxima, (jnp.full((bt, 1), NEG, jnp.float32), jnp.full((1, bd), NEG, jnp.float32))
    )

    def sums(u, nd):
      b, kb, vb = keys(j, u)
      p, e = jnp.exp(b - mw), jnp.exp(kb - mk)
      return nd[0] + dot(p, e * vb), nd[1] + dot(p, e)

    zero = jnp.zeros((bt, bd), jnp.float32)
    num, den = jax.lax.fori_loop(0, n_keys, sums, (zero, zero))
    out = rows(j, bt)

    def fast():
      m = jnp.maximum(mw + mk, m0)
      s1, s0 = jnp.exp(mw + mk - m), jnp.exp(m0 - m)
      a_ref[out, :] = (num * s1 + num0 * s0) / (den * s1 + den0 * s0)

    def exact():  # row by row, the maximum per (row, channel) carried over the key blocks
      def row(i, _):
        r = pl.ds(j * bt + i, 1)

        def block(u, c):
          m1, num1, den1 = c
          _, kb, vb = keys(j, u)
          b_col = jnp.sum(eye * bias_ref[r, rows(u, bt)], axis=1, keepdims=True)  # [bt, 1]
          logits = b_col + kb
          m2 = jnp.maximum(m1, jnp.max(logits, axis=0, keepdims=True))
          e, s1 = jnp.exp(logits - m2), jnp.exp(m1 - m2)
          return (
            m2,
            num1 * s1 + jnp.sum(e * vb, axis=0, keepdims=True),
            den1 * s1 + jnp.sum(e, axis=0, keepdims=True),
          )

        _, num1, den1 = jax.lax.fori_loop(0, n_keys, block, carry)
        a_ref[r, :] = num1 / den1
        return 0

      jax.lax.fori_loop(0, bt, row, 0)

    real = j * bt + jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0) < t_len  # not padding
    jax.lax.cond(all_true((den >= DEN_OK) | ~real), fast, exact)

    # The slab's first key block is older than every row of the next chunk's band (bias 0).
    kb, vb = load(k_ref, rows(j, bt)), load(v_ref, rows(j, bt))
    seen = j * bt + jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0) >= width - bt  # not padding
    m = jnp.maximum(m0, jnp.max(kb, axis=0, keepdims=True))
    e, s0 = jnp.where(seen, jnp.exp(kb - m), 0.0), jnp.exp(m0 - m)
    return (
      m,
      num0 * s0 + jnp.sum(e * vb, axis=0, keepdims=True),
      den0 * s0 + jnp.sum(e, axis=0, keepdims=True),
    )

  zero = jnp.zeros((1, bd), jnp.float32)
  jax.lax.fori_loop(0, n_chunks, chunk, (zero + NEG, zero, zero))


def _forward(k, v, w, window: int, cfg: Config, interpret: bool):
  """a [B, T, D] float32 from the kernel."""
  b, t_len, d = k.shape
  bt = cfg.block_t
  s = min(window, t_len)
  t_pad = t_len + (-t_len % bt)
  width = _slab_width(s, bt)
  bias = _slab_bias(w, s, t_pad, bt)
  # Front padding: the slabs of the first chunks reach before key 0; end padding: ragged T.
  # Padded keys are NEG (weight exp(NEG - m) = 0), values 0.
  pad = lambda x, fill: pallas_util.pad_time(x, width - bt, t_pad - t_len, fill)
  k, v = pad(k, NEG), pad(v, 0.0)
  kv_spec = pl.BlockSpec((None, k.shape[1], cfg.block_d), lambda i, j: (i, 0, j))
  a = pallas_util.call(
    functools.partial(_fwd_kernel, bt=bt, t_len=t_len),
    cfg,
    interpret,
    (b, d // cfg.block_d),
    [pl.BlockSpec((t_pad, width), lambda i, j: (0, 0)), kv_spec, kv_spec],
    pl.BlockSpec((None, t_pad, cfg.block_d), lambda i, j: (i, 0, j)),
    jax.ShapeDtypeStruct((b, t_pad, d), jnp.float32),
    (bias, k, v),
  )
  return a[:, :t_len]


def _xla_mean(k, v, w, window: int):
  """The same a [B, T, D] from the XLA path (``banded.banded_mean`` on [T, B D] columns)."""
  b, t_len, d = k.shape
  low = k.dtype == jnp.bfloat16
  plan = banded.make_plan(t_len, b * d, window, True, low=low)
  cols = lambda x: jnp.swapaxes(x.astype(jnp.float32), 0, 1).reshape(t_len, b * d)
  a = banded.banded_mean(plan, cols(k), cols(v), w.astype(jnp.float32))
  return jnp.swapaxes(a.reshape(t_len, b, d), 0, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def local_mean(k_BTD, v_BTD, w_TT, window: int, cfg: Config, interpret: bool):
  """a ``[B, T, D]`` float32 (module docstring) for k, v ``[B, T, D]`` (bfloat16 or float32),
  w ``[T, T]`` and window s >= 1, causal."""
  return _forward(k_BTD, v_BTD, w_TT, window, cfg, interpret)


def _local_mean_fwd(k, v, w, window, cfg, interpret):
  return _forward(k, v, w, window, cfg, interpret), (k, v, w)


def _local_mean_bwd(window, cfg, interpret, res, g):
  _, vjp = jax.vjp(functools.partial(_xla_mean, window=window), *res)
  return vjp(g.astype(jnp.float32))


local_mean.defvjp(_local_mean_fwd, _local_mean_bwd)
