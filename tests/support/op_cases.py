"""Inputs, tolerances and float64 references that the op tests (tests/ops/) share."""

import jax
import jax.numpy as jnp
import numpy as np

# Outputs are weighted averages of v ~ N(0, 1): 2e-4 relative, a small absolute floor near 0.
RTOL, ATOL = 2e-4, 2e-5


def rand(seed, *shapes, scale=1.0):
  rng = np.random.default_rng(seed)
  return [np.asarray(rng.normal(size=s) * scale, np.float32) for s in shapes]


def qkvw(seed, lead, t_len, d, scale):
  q, v = rand(seed, lead + (t_len, d), lead + (t_len, d))
  k, w = rand(seed + 1, lead + (t_len, d), (t_len, t_len), scale=scale)
  return q, k, v, w


def kernel_inputs(t_len, d, seed=0):  # q, k, v, ct [2, T, d]; k's rows of std 1 and 40
  rng = np.random.default_rng(seed)
  q, k, v, ct = (rng.normal(size=(2, t_len, d)) for _ in range(4))
  k = k * np.array([1.0, 40.0])[:, None, None]
  return tuple(np.asarray(x, np.float32) for x in (q, k, v, ct))


def reference(name, args, kw):  # the float64 loop reference of op ``name`` given its kwargs
  from tests.support import numpy_reference as ref

  window = (kw["window"],) if "window" in kw else ()
  causal = () if name == "aft_conv2d" else (kw.get("causal", False),)
  return getattr(ref, name)(*args, *window, *causal)


def scan_simple(q, k, v):  # causal AFT-simple as a lax.scan (float64 under enable_x64)
  from benchmarks.bench_ops import scan_simple as scan

  return scan(q, k, v)


_simple_out = jax.jit(scan_simple)


@jax.jit
def _simple_out_and_grads(q, k, v, ct):
  out, vjp = jax.vjp(scan_simple, q, k, v)
  return out, vjp(ct)


def simple_reference(q, k, v, ct):
  """Causal AFT-simple's output [and gradients of sum(out * ct)] in float64."""
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(x, jnp.float64) for x in (q, k, v))
    if ct is None:
      return np.asarray(_simple_out(*args)), None
    out, grads = _simple_out_and_grads(*args, jnp.asarray(ct, jnp.float64))
    return jax.tree.map(np.asarray, (out, grads))


def tpu_simple(q, k, v):
  """Causal AFT-simple on the TPU kernel, interpreted, as impl="pallas" runs it on a TPU."""
  from aft_jax.ops import common, simple

  tpu = (simple.KERNELS[1],)
  return common.run("aft_simple", tpu, "pallas_interpret", None, q, k, v, causal=True)


def cotangent(shape):  # a fixed random cotangent (for ``output_and_grads``)
  return np.random.default_rng(9).normal(size=shape).astype(np.float32)


def output_and_grads(fn):  # (q, k, v, bias, ct) -> fn's output and the grads of <fn, ct>

  def run(q, k, v, bias, ct):
    out, vjp = jax.vjp(fn, q, k, v, bias)
    return out, vjp(jnp.asarray(ct, out.dtype))

  return run


def close(got, want, rel):  # within rel of want's largest magnitude (leaf by leaf), finite
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=0, atol=rel * float(np.max(np.abs(w))) + 1e-30)


def segments(t_len):  # two packed documents' ids and positions [T]
  cut = t_len // 3
  return np.repeat([0, 1], [cut, t_len - cut]), np.r_[np.arange(cut), np.arange(t_len - cut)]


def dense_mean(k, v, bias, mask, conv=False):
  """sum_t' softmax_t'(k[t'] + bias) v[t'] over the keys ``mask`` admits ([T, T', D or H])."""
  logits = jnp.where(mask, k[..., None, :, :] + bias, -jnp.inf)
  p = jax.nn.softmax(logits, axis=-2)
  return jnp.einsum("...tsh,...shc->...thc" if conv else "...tsd,...sd->...td", p, v)


def key_mask(t_len, causal, packed):
  t, tp = np.arange(t_len)[:, None], np.arange(t_len)[None, :]
  mask = (tp <= t) if causal else np.ones((t_len, t_len), bool)
  if packed:
    seg = segments(t_len)[0]
    mask &= seg[:, None] == seg[None, :]
  return mask


def _band_bias(w, window, packed):  # w where |t - t'| < window, else 0 (packed: own positions)
  t_len = w.shape[0]
  lag = np.arange(t_len)[:, None] - np.arange(t_len)[None, :]
  if packed:
    pos = segments(t_len)[1]
    w = w[pos[:, None], pos[None, :]]
  return jnp.where(np.abs(lag) < window, w, 0.0)


def dense_op(window, causal, packed=False):  # AFT-full (window None), -local, -simple (0)

  def dense(q, k, v, w):
    t_len = q.shape[-2]
    bias = 0.0 if window == 0 else _band_bias(w, window or t_len, packed)[..., None]
    return jax.nn.sigmoid(q) * dense_mean(k, v, bias, key_mask(t_len, causal, packed)[..., None])

  return dense
