"""Hypothesis: random shapes, dtypes, windows, magnitudes: the reference's; the future ignored."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from aft_jax import ops
from tests.support.op_cases import reference

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


@functools.lru_cache(maxsize=None)
def _jitted(name, kw, dtype):
  op = functools.partial(getattr(ops, name), **dict(kw))
  n_args = 3 if name == "aft_simple" else 4
  return jax.jit(lambda q, k, v, w: op(*(x.astype(dtype) for x in (q, k, v, w)[:n_args])))


@SETTINGS
@given(
  name=st.sampled_from(["aft_full", "aft_local", "aft_simple"]),
  causal=st.booleans(),
  t_len=st.integers(1, 8),
  d=st.sampled_from([1, 3]),
  lead=st.sampled_from([(), (2,)]),
  window=st.integers(1, 10),
  scale=st.sampled_from([0.1, 1.0, 10.0, 60.0]),
  dtype=st.sampled_from(["float32", "bfloat16"]),
  seed=st.integers(0, 2**16),
)
def test_sequence_ops(name, causal, t_len, d, lead, window, scale, dtype, seed):
  rng = np.random.default_rng(seed)
  shape = lead + (t_len, d)
  q, v = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
  k = (rng.normal(size=shape) * scale).astype(np.float32)
  w = (rng.normal(size=(t_len, t_len)) * scale).astype(np.float32)
  kw = dict(causal=causal, **({"window": window} if name == "aft_local" else {}))
  fn = _jitted(name, tuple(kw.items()), dtype)
  out = fn(q, k, v, w)
  assert out.dtype == jnp.dtype(dtype)
  chex.assert_tree_all_finite(out)
  if dtype == "float32":
    want = reference(name, (q, k, v, w)[: 3 if name == "aft_simple" else 4], kw)
    chex.assert_trees_all_close(out, want, rtol=2e-4, atol=2e-5)
  if causal and t_len > 1:
    t0 = int(rng.integers(0, t_len - 1))
    k2, v2, w2 = k.copy(), v.copy(), w.copy()
    k2[..., t0 + 1 :, :] += scale * 3
    v2[..., t0 + 1 :, :] -= 5.0
    w2[:, t0 + 1 :] += scale * 3
    out2 = fn(q, k2, v2, w2)
    # bf16: factors rounded after a shift shared by a block of keys: the past moves by rounding.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    chex.assert_trees_all_close(out2[..., : t0 + 1, :], out[..., : t0 + 1, :], **tol)
