"""Packed rows: with ``segment_ids`` (and ``positions``), each document of a row gets what the
op gives on it alone, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import ops
from tests.support import numpy_reference as ref

T, WINDOW = 9, 3
SPLITS = (5, 4)  # row 0: [doc of 5 | doc of 4]; row 1: [doc of 4 | doc of 5]


def _layout():
  """segment_ids and positions [2, T], each document's positions from 0."""
  seg = np.array([[1] * n + [2] * (T - n) for n in SPLITS], np.int32)
  pos = np.array([list(range(n)) + list(range(T - n)) for n in SPLITS], np.int32)
  return seg, pos


def _inputs(op, scale):
  rng = np.random.default_rng(1)
  f = lambda *s, sc=1.0: np.asarray(rng.normal(size=s) * sc, np.float32)
  if op == "conv1d":
    return f(2, T, 2, 2), f(2, T, 2, sc=scale), f(2, T, 2, 2), f(2, WINDOW, sc=scale)
  return f(2, T, 3), f(2, T, 3, sc=scale), f(2, T, 3), f(T, T, sc=scale)


def _op(op, q, k, v, bias, seg=None, pos=None):
  """The op on q, k, v [..., T, ...]; packed when seg is given; w's top-left block alone."""
  t_len = q.shape[-3] if op == "conv1d" else q.shape[-2]
  packed = {} if seg is None else {"segment_ids": seg}
  if op == "simple":
    return ops.aft_simple(q, k, v, causal=True, **packed)
  if op == "conv1d":
    return ops.aft_conv1d(q, k, v, bias, causal=True, **packed)
  if seg is not None:
    packed["positions"] = pos
  else:
    bias = bias[:t_len, :t_len]
  if op == "full":
    return ops.aft_full(q, k, v, bias, causal=True, **packed)
  return ops.aft_local(q, k, v, bias, window=WINDOW, causal=True, **packed)


# Logits of std 40 where the bias-0 prefix scan and the band meet at large logits; AFT-full's
# band is every key.
@pytest.mark.parametrize(
  "op, scale", [("simple", 40.0), ("local", 40.0), ("full", 1.0), ("conv1d", 40.0)]
)
def test_each_document_as_if_alone(op, scale):
  seg, pos = _layout()
  ct = np.random.default_rng(2).normal(size=_inputs(op, 1.0)[0].shape).astype(np.float32)

  def packed(q, k, v, bias):
    return jnp.sum(_op(op, q, k, v, bias, seg, pos) * ct), _op(op, q, k, v, bias, seg, pos)

  def alone(q, k, v, bias):
    """Each document on its own (the two of length 5 as one batch, the two of 4 as another),
    put back in place."""
    docs = lambda x: (jnp.stack([x[0, :5], x[1, 4:]]), jnp.stack([x[0, 5:], x[1, :4]]))
    (q5, q4), (k5, k4), (v5, v4), (c5, c4) = (docs(x) for x in (q, k, v, ct))
    y5, y4 = _op(op, q5, k5, v5, bias), _op(op, q4, k4, v4, bias)
    y = jnp.stack([jnp.concatenate([y5[0], y4[0]]), jnp.concatenate([y4[1], y5[1]])])
    return jnp.sum(y5 * c5) + jnp.sum(y4 * c4), y

  args = _inputs(op, scale)
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(*args)
  (_, y1), g1 = grad(packed)
  (_, y2), g2 = grad(alone)
  np.testing.assert_allclose(y1, y2, rtol=0, atol=1e-5 * float(np.max(np.abs(y2))))
  for a, b in zip(g1, g2):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * float(np.max(np.abs(b))) + 1e-30)


def test_bad_segment_arguments_are_refused():
  q, k, v, w = _inputs("local", 1.0)
  seg, pos = _layout()
  with pytest.raises(ValueError, match=r"aft_simple: segment_ids need causal=True"):
    ops.aft_simple(q, k, v, segment_ids=seg)
  with pytest.raises(ValueError, match=r"segment_ids must be an int array \[..., T\] = \(2, 9\)"):
    ops.aft_simple(q, k, v, causal=True, segment_ids=seg[:, :4])
  with pytest.raises(ValueError, match=r"positions must be an int array"):
    ops.aft_local(q, k, v, w, window=2, causal=True, positions=pos.astype(np.float32))
  with pytest.raises(ValueError, match=r"do not take initial_state, output_final_state"):
    ops.aft_local(q, k, v, w, window=2, causal=True, segment_ids=seg, output_final_state=True)


@pytest.mark.parametrize("op", ["local", "full"])
@pytest.mark.parametrize("bad", [-1, T])
def test_a_position_outside_w_gives_nan(op, bad):
  """Row 0's second document has a position outside w [T, T] (-1: NumPy's rule would read
  w's last row instead): every output that reads its bias is NaN; row 1 and row 0's first
  document are what each document gives alone (the float64 reference)."""
  seg, pos = _layout()
  pos = pos.copy()
  pos[0, SPLITS[0] + 1] = bad  # the second position of row 0's second document
  q, k, v, w = _inputs(op, 1.0)
  y = np.asarray(jax.jit(lambda *a: _op(op, *a, seg, pos))(q, k, v, w))
  reads = SPLITS[0] + 1 + np.arange(WINDOW if op == "local" else T)  # the rows that see it
  reads = reads[reads < T]
  assert np.all(np.isnan(y[0, reads]))
  fine = np.setdiff1d(np.arange(T), reads)
  assert np.all(np.isfinite(y[0, fine])) and np.all(np.isfinite(y[1]))
  n = SPLITS[0]
  bias = ref.local_bias(w, WINDOW) if op == "local" else w
  want = ref.aft_full(q[0, :n], k[0, :n], v[0, :n], bias[:n, :n], causal=True)
  np.testing.assert_allclose(y[0, :n], want, rtol=1e-5, atol=1e-6)
