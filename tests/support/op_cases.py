"""Inputs, tolerances and float64 references that the op tests (tests/ops/) share."""

import jax
import jax.numpy as jnp
import numpy as np

# Output values are weighted averages of v ~ N(0, 1): 2e-4 relative, with a small absolute floor
# for outputs that happen to be near 0.
RTOL, ATOL = 2e-4, 2e-5


def rand(seed, *shapes, scale=1.0):
  rng = np.random.default_rng(seed)
  return [np.asarray(rng.normal(size=s) * scale, np.float32) for s in shapes]


def qkvw(seed, lead, t_len, d, scale):
  q, v = rand(seed, lead + (t_len, d), lead + (t_len, d))
  k, w = rand(seed + 1, lead + (t_len, d), (t_len, t_len), scale=scale)
  return q, k, v, w


def kernel_inputs(t_len, d, seed=0):
  """q, k, v, cotangent [2, T, d] float32; batch row 0 has logits of std 1, row 1 std 40."""
  rng = np.random.default_rng(seed)
  q, k, v, ct = (rng.normal(size=(2, t_len, d)) for _ in range(4))
  k = k * np.array([1.0, 40.0])[:, None, None]
  return tuple(np.asarray(x, np.float32) for x in (q, k, v, ct))


def reference(name, args, kw):
  """The float64 loop reference (numpy_reference) of op ``name`` on ``args`` with the op's
  keyword arguments ``kw`` (window, causal)."""
  from tests.support import numpy_reference as ref

  window = (kw["window"],) if "window" in kw else ()
  causal = () if name == "aft_conv2d" else (kw.get("causal", False),)
  return getattr(ref, name)(*args, *window, *causal)


def scan_simple(q, k, v):
  """Causal AFT-simple as a ``lax.scan`` with a carried maximum (float64 under enable_x64)."""
  from benchmarks.bench_ops import scan_simple as scan

  return scan(q, k, v)


_simple_out = jax.jit(scan_simple)


@jax.jit
def _simple_out_and_grads(q, k, v, ct):
  out, vjp = jax.vjp(scan_simple, q, k, v)
  return out, vjp(ct)


def simple_reference(q, k, v, ct):
  """Causal AFT-simple's output and gradients (q, k, v) of sum(out * ct), in float64 (one
  program per shape; ``ct`` None: the output alone)."""
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(x, jnp.float64) for x in (q, k, v))
    if ct is None:
      return np.asarray(_simple_out(*args)), None
    out, grads = _simple_out_and_grads(*args, jnp.asarray(ct, jnp.float64))
    return jax.tree.map(np.asarray, (out, grads))


def tpu_simple(q, k, v):
  """Causal AFT-simple on the TPU kernel (``simple.KERNELS``' TPU entry) in Pallas'
  interpreter, as impl="pallas" runs it on a TPU: sigma(q) * its mean, the inputs' dtype."""
  from aft_jax.ops import common, simple

  tpu = (simple.KERNELS[1],)
  return common.run("aft_simple", tpu, "pallas_interpret", None, q, k, v, causal=True)


def cotangent(shape):
  """A fixed random cotangent of an output of ``shape`` (for ``output_and_grads``)."""
  return np.random.default_rng(9).normal(size=shape).astype(np.float32)


def output_and_grads(fn):
  """(q, k, v, bias, ct) -> fn's output and the gradients of <fn, ct> w.r.t. q, k, v and bias
  (to be jitted, alone or with others in one program)."""

  def run(q, k, v, bias, ct):
    out, vjp = jax.vjp(fn, q, k, v, bias)
    return out, vjp(jnp.asarray(ct, out.dtype))

  return run


def close(got, want, rel):
  """Within ``rel`` of the largest magnitude of ``want`` (leaf by leaf), every leaf finite."""
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=0, atol=rel * float(np.max(np.abs(w))) + 1e-30)


# ---------------------------------------------------------------- dense jax.numpy references


def segments(t_len):
  """Two packed documents (ids) and each one's positions from 0, [T]."""
  cut = t_len // 3
  return np.repeat([0, 1], [cut, t_len - cut]), np.r_[np.arange(cut), np.arange(t_len - cut)]


def dense_mean(k, v, bias, mask, conv=False):
  """sum_t' softmax_t'(k[t'] + bias) v[t'] over the keys ``mask`` admits: k, v [..., T, D]
  (AFT-conv: k [..., T, H], v [..., T, H, C]); bias, mask broadcast against
  [T (query), T (key), D or H]."""
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


def _band_bias(w, window, packed):
  """w where the lag t - t' (two-sided: |t - t'|) is below ``window``, 0 for the other keys;
  packed: w at each document's own positions."""
  t_len = w.shape[0]
  lag = np.arange(t_len)[:, None] - np.arange(t_len)[None, :]
  if packed:
    pos = segments(t_len)[1]
    w = w[pos[:, None], pos[None, :]]
  return jnp.where(np.abs(lag) < window, w, 0.0)


def dense_op(window, causal, packed=False):
  """AFT-full (window None), AFT-local or AFT-simple (window 0) by plain jax.numpy."""

  def dense(q, k, v, w):
    t_len = q.shape[-2]
    bias = 0.0 if window == 0 else _band_bias(w, window or t_len, packed)[..., None]
    return jax.nn.sigmoid(q) * dense_mean(k, v, bias, key_mask(t_len, causal, packed)[..., None])

  return dense
