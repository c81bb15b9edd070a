"""AFT with a learned decay (aft_jax/ops/decay.py) against the float64 loop reference: extreme
decays and keys, chunks == steps, pieces, packed rows, derivatives, refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from aft_jax import ops
from aft_jax.ops import decay as decay_mod
from tests.support import numpy_reference as ref
from tests.support.op_cases import close, cotangent

B, T, D = 2, 19, 4  # T: odd, chunks and a rest
DECAYS = {
  "zero": np.zeros(D),
  "tiny": np.full(D, 1e-6),
  "large": np.full(D, 30.0),
  "mixed": np.array([0.0, 1e-6, 0.7, 30.0]),
}


def _inputs(seed, t_len=T, keys="std1", d=D):
  rng = np.random.default_rng(seed)
  f = lambda *s: np.asarray(rng.normal(size=s), np.float32)
  q, k, v = f(B, t_len, d), f(B, t_len, d), f(B, t_len, d)
  if keys == "extreme":  # +-60: exp overflows float32 above ~88 once a decay is added back
    k = np.asarray(60.0 * np.sign(k), np.float32)
  return q, k, v


@pytest.mark.parametrize("keys", ["std1", "extreme"])
@pytest.mark.parametrize("decay", DECAYS)
def test_values_against_the_loop_reference(decay, keys):
  """With and without a bonus; eagerly, so one program per form for every case."""
  q, k, v = _inputs(1, keys=keys)
  lam = np.asarray(DECAYS[decay], np.float32)
  bonus = np.asarray(np.random.default_rng(2).normal(size=D) * 3, np.float32)
  for u in (None, bonus):
    got = ops.aft_decay(q, k, v, lam, u)
    want = ref.aft_decay(q, k, v, lam, u)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"bonus {u}")


def test_decay_zero_is_causal_aft_simple():
  q, k, v = _inputs(3)
  k = k * 40.0
  run = jax.jit(lambda q, k, v: (ops.aft_decay(q, k, v, jnp.zeros(D)),
                                 ops.aft_simple(q, k, v, causal=True)))  # fmt: skip
  got, want = run(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _steps(state, q, k, v, lam, u):  # the one-token step scanned along T (axis 1)
  step = lambda s, x: ops.aft_decay_step(s, *x, lam, u)[::-1]
  state, ys = jax.lax.scan(step, state, tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v)))
  return jnp.swapaxes(ys, 0, 1), state


def _same_state(got, want):  # equal sums: log den + m and num / den (m is only a shift)
  lse = lambda s: np.asarray(s.m) + np.log(np.asarray(s.den))
  np.testing.assert_allclose(lse(got), lse(want), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got.num / got.den, want.num / want.den, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk, keys", [(decay_mod.CHUNK, "std5"), (8, "std5"),
                                         (decay_mod.CHUNK, "extreme")])  # fmt: skip
def test_chunks_equal_steps_over_eight_chunks(chunk, keys, monkeypatch):
  """8 x 8 + 3 positions: the op's outputs and final state are the scanned steps' and the
  reference's (at keys of +-60 a decay of 1e-6 is below a logit's rounding: it still counts)."""
  monkeypatch.setattr(decay_mod, "CHUNK", chunk)  # read when the op is traced (below)
  t_len = 8 * 8 + 3
  q, k, v = _inputs(4, t_len, keys="extreme" if keys == "extreme" else "std1")
  k = k * (1.0 if keys == "extreme" else 5.0)
  lam = np.array([0.0, 1e-6, 0.7, 30.0], np.float32)
  u = np.array([1.0, -2.0, 0.0, 5.0], np.float32)

  @jax.jit
  def run(q, k, v):
    y, state = ops.aft_decay(q, k, v, lam, u, output_final_state=True)
    return (y, state), _steps(ops.aft_decay_init((B, D)), q, k, v, lam, u)

  (y, state), (y_steps, state_steps) = run(q, k, v)
  np.testing.assert_allclose(y, y_steps, rtol=1e-5, atol=1e-6)
  _same_state(state, state_steps)
  np.testing.assert_allclose(y, ref.aft_decay(q, k, v, lam, u), rtol=1e-5, atol=1e-6)


CUTS = (5, 1, 13)  # uneven pieces, one of length 1


def test_pieces_equal_one_call():
  """Values and gradients (q, k, v, decay, bonus; through the states) at key std 1 and 40."""
  lam = np.array([0.0, 1e-6, 0.7, 30.0], np.float32)
  u = np.array([1.0, -2.0, 0.0, 5.0], np.float32)

  def one(q, k, v, params):
    return ops.aft_decay(q, k, v, *params)

  def chained(q, k, v, params):
    ys, state, start = [], None, 0
    for n in CUTS:
      piece = lambda x: x[:, start : start + n]
      y, state = ops.aft_decay(piece(q), piece(k), piece(v), *params, initial_state=state,
                               output_final_state=True)  # fmt: skip
      ys.append(y)
      start += n
    return jnp.concatenate(ys, axis=1)

  def out_and_grads(fn, q, k, v, params, ct):
    out, vjp = jax.vjp(fn, q, k, v, params)
    return out, vjp(ct)

  run = jax.jit(lambda *a: (out_and_grads(one, *a), out_and_grads(chained, *a)))
  for scale in (1.0, 40.0):
    q, k, v = _inputs(5)
    (y1, g1), (y2, g2) = run(q, k * scale, v, (lam, u), cotangent(q.shape))
    close(y2, y1, 1e-5)
    close(g2, g1, 1e-4)


def test_each_packed_document_as_if_alone():
  """Rows [doc of 5 | doc of 14] and [doc of 12 | doc of 7]: values and gradients."""
  splits = (5, 12)
  seg = np.array([[1] * n + [2] * (T - n) for n in splits], np.int32)
  q, k, v = _inputs(6)
  k = k * 5.0
  lam = np.array([0.0, 1e-6, 0.7, 30.0], np.float32)
  u = np.array([1.0, -2.0, 0.0, 5.0], np.float32)
  ct = cotangent(q.shape)

  def packed(q, k, v, lam, u):
    return jnp.sum(ops.aft_decay(q, k, v, lam, u, segment_ids=seg) * ct)

  def alone(q, k, v, lam, u):
    total = 0.0
    for row, n in enumerate(splits):
      for lo, hi in ((0, n), (n, T)):
        doc = lambda x: x[row : row + 1, lo:hi]
        total += jnp.sum(ops.aft_decay(doc(q), doc(k), doc(v), lam, u) * doc(ct))
    return total

  grads = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4))
  (l1, g1), (l2, g2) = jax.jit(lambda *a: (grads(packed)(*a), grads(alone)(*a)))(q, k, v, lam, u)
  np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-5)  # a sum that cancels
  close(g1, g2, 1e-4)
  want = ref.aft_decay(q, k, v, lam, u, segment_ids=seg)
  got = ops.aft_decay(q, k, v, lam, u, segment_ids=seg)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_gradients_match_finite_differences(packed):
  """float64, both modes, in q, k, v, decay and bonus (T 11: chunks and a rest)."""
  seg = np.array([[0] * 4 + [1] * 7, [3] * 11]) if packed else None
  fn = jax.jit(functools.partial(ops.aft_decay, segment_ids=seg))
  with jax.enable_x64(True):
    rng = np.random.default_rng(7)
    qkv = [jnp.asarray(rng.normal(size=(2, 11, 3)) * s) for s in (1.0, 2.0, 1.0)]
    lam, u = jnp.asarray([0.05, 0.5, 2.0]), jnp.asarray(rng.normal(size=3))
    check_grads(fn, (*qkv, lam, u), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_jit_and_vmap():
  q, k, v = _inputs(8)
  lam = np.array([0.0, 0.1, 1.0, 30.0], np.float32)
  want = ops.aft_decay(q, k, v, lam)
  np.testing.assert_allclose(jax.jit(ops.aft_decay)(q, k, v, lam), want, rtol=1e-6, atol=1e-7)
  # vmap over the batch and over per-example decays (the same decay in each).
  mapped = jax.vmap(ops.aft_decay, in_axes=(0, 0, 0, None))(q, k, v, lam)
  np.testing.assert_allclose(mapped, want, rtol=1e-6, atol=1e-7)
  lams = np.stack([lam, lam])
  mapped = jax.jit(jax.vmap(ops.aft_decay))(q, k, v, lams)
  np.testing.assert_allclose(mapped, want, rtol=1e-6, atol=1e-7)


def test_steps_keep_the_inputs_dtype():
  x = jnp.zeros((2, 3), jnp.bfloat16)
  y, state = ops.aft_decay_step(ops.aft_decay_init((2, 3)), x, x, x, jnp.ones(3), jnp.ones(3))
  assert y.dtype == jnp.bfloat16 and state.m.dtype == jnp.float32
  y = ops.aft_decay(jnp.zeros((2, 5, 3), jnp.bfloat16), x[:, None].repeat(5, 1),
                    x[:, None].repeat(5, 1), jnp.ones(3))  # fmt: skip
  assert y.dtype == jnp.bfloat16


X = np.zeros((2, 6, 4), np.float32)
LAM = np.zeros(4, np.float32)
SEG = np.array([[1] * 3 + [2] * 3] * 2, np.int32)

# (args, kwargs, the message's regex)
ERRORS = [
  ((X, X, X, LAM), dict(causal=False), r"aft_decay: causal=False is not supported.*one-sided"),
  ((X, X, X, LAM), dict(impl="pallas"), r"aft_decay: impl='pallas' is not available"),
  ((X, X, X, LAM), dict(impl="pallas_interpret"), r"impl='pallas_interpret' is not available"),
  ((X, X, X, LAM), dict(impl="triton"), r"aft_decay: impl must be one of"),
  ((X, X, X, LAM), dict(axis_name="seq"), r"aft_decay: axis_name .* not supported yet"),
  ((X, X[:, :5], X, LAM), {}, r"aft_decay: q, k and v must have the same shape.*k \(2, 5, 4\)"),
  ((X, X, X, LAM[:3]), {}, r"aft_decay: decay must be \[D\] = \(4,\); got decay \(3,\)"),
  ((X, X, X, np.zeros((2, 4))), {}, r"decay must be \[D\] = \(4,\); got decay \(2, 4\)"),
  ((X, X, X, LAM - 1), {}, r"aft_decay: decay must be >= 0 .*got min -1"),
  ((X, X, X, LAM + np.nan), {}, r"aft_decay: decay must be >= 0 \(and not NaN\)"),
  ((X, X, X, LAM.astype(np.int32)), {}, r"decay must be a real floating-point array"),
  ((X, X, X, LAM, LAM[:2]), {}, r"aft_decay: bonus must be \[D\] = \(4,\); got bonus \(2,\)"),
  ((X, X, X, LAM), dict(segment_ids=SEG[:, :4]), r"segment_ids must be an int array \[..., T\]"),
  ((X, X, X, LAM), dict(initial_state=ops.aft_decay_init((3, 4))),
   r"aft_decay: initial_state must be the state of these inputs"),
  ((X, X, X, LAM), dict(segment_ids=SEG, output_final_state=True),
   r"do not take initial_state, output_final_state"),
]  # fmt: skip


@pytest.mark.parametrize("args, kwargs, message", ERRORS, ids=[e[-1][:40] for e in ERRORS])
def test_bad_arguments_are_one_line(args, kwargs, message):
  with pytest.raises(ValueError, match=message) as e:
    ops.aft_decay(*args, **kwargs)
  assert "\n" not in str(e.value)
