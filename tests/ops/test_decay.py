"""AFT with a learned decay (aft_jax/ops/decay.py) against the float64 loop reference and more."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from aft_jax import ops
from aft_jax.ops import decay as decay_mod
from tests.support import numpy_reference as ref
from tests.support.helpers import export_for
from tests.support.op_cases import close, cotangent

B, T, D = 2, 19, 4  # T: odd, chunks and a rest
LAM = np.array([0.0, 1e-6, 3.5, 30.0], np.float32)  # decays: none, below rounding, some, huge
U = np.array([1.0, -2.0, 0.0, 5.0], np.float32)
DECAYS = {"zero": np.zeros(D), "tiny": np.full(D, 1e-6), "large": np.full(D, 30.0), "mixed": LAM}


def _inputs(seed, t_len=T, scale=1.0, extreme=False):  # extreme keys: +-60 (exp(88) overflows)
  q, k, v = np.asarray(np.random.default_rng(seed).normal(size=(3, B, t_len, D)), np.float32)
  return q, np.float32(60.0) * np.sign(k) if extreme else k * np.float32(scale), v


@pytest.mark.parametrize("keys", ["std1", "extreme", "1e4", "ramps"])
@pytest.mark.parametrize("decay", DECAYS)
def test_values_against_the_loop_reference(decay, keys):
  """With and without a bonus; eagerly, so one program per form for every case. Ramps: keys
  that rise (row 0) or fall (row 1) by the decay per position, so every term counts."""
  t_len, scale = (35 if keys == "ramps" else T), (1e4 if keys == "1e4" else 1.0)
  q, k, v = _inputs(1, t_len, scale, extreme=keys == "extreme")
  lam = np.asarray(DECAYS[decay], np.float32)
  if keys == "ramps":
    k = (k + np.array([1, -1])[:, None, None] * np.arange(t_len)[:, None] * lam).astype(np.float32)
  for u in (None, U):
    want = ref.aft_decay(q, k, v, lam, u)
    np.testing.assert_allclose(ops.aft_decay(q, k, v, lam, u), want, 1e-5, 1e-6, err_msg=f"{u}")


def test_decay_zero_is_causal_aft_simple():
  q, k, v = _inputs(3, scale=40.0)
  got = jax.jit(lambda *a: ops.aft_decay(*a, jnp.zeros(D)))(q, k, v)
  np.testing.assert_allclose(got, ops.aft_simple(q, k, v, causal=True), rtol=1e-5, atol=1e-6)


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
  """8 chunks + 3 positions: outputs and final state == the scanned steps' == the reference's."""
  monkeypatch.setattr(decay_mod, "CHUNK", chunk)  # read when the op is traced (below)
  q, k, v = _inputs(4, 8 * chunk + 3, scale=5.0, extreme=keys == "extreme")
  run = jax.jit(lambda q, k, v: (ops.aft_decay(q, k, v, LAM, U, output_final_state=True),
                                 _steps(ops.aft_decay_init((B, D)), q, k, v, LAM, U)))  # fmt: skip
  (y, state), (y_steps, state_steps) = run(q, k, v)
  np.testing.assert_allclose(y, y_steps, rtol=1e-5, atol=1e-6)
  _same_state(state, state_steps)
  np.testing.assert_allclose(y, ref.aft_decay(q, k, v, LAM, U), rtol=1e-5, atol=1e-6)


def test_pieces_equal_one_call():
  """Values and gradients (q, k, v, decay, bonus; through the states) at key std 1 and 40."""
  one = lambda q, k, v, params: ops.aft_decay(q, k, v, *params)

  def chained(q, k, v, params):
    ys, state, start = [], None, 0
    for n in (5, 1, 13):  # uneven pieces, one of length 1
      qkv = (x[:, start : start + n] for x in (q, k, v))
      y, state = ops.aft_decay(*qkv, *params, initial_state=state, output_final_state=True)
      ys, start = ys + [y], start + n
    return jnp.concatenate(ys, axis=1)

  def out_and_grads(fn, q, k, v, params, ct):
    out, vjp = jax.vjp(fn, q, k, v, params)
    return out, vjp(ct)

  run = jax.jit(lambda *a: (out_and_grads(one, *a), out_and_grads(chained, *a)))
  q, k, v = _inputs(5)
  for scale in (1.0, 40.0):
    (y1, g1), (y2, g2) = run(q, k * scale, v, (LAM, U), cotangent(q.shape))
    np.testing.assert_allclose(y2, ref.aft_decay(q, k * scale, v, LAM, U), 1e-5, 1e-6)
    close(y2, y1, 1e-5)
    close(g2, g1, 1e-4)


def test_each_packed_document_as_if_alone():
  """Rows [doc of 5 | doc of 14] and [doc of 12 | doc of 7]: values and gradients."""
  splits = (5, 12)
  seg = np.array([[1] * n + [2] * (T - n) for n in splits], np.int32)
  q, k, v = _inputs(6, scale=5.0)
  ct = cotangent(q.shape)
  packed = lambda q, k, v, lam, u: jnp.sum(ops.aft_decay(q, k, v, lam, u, segment_ids=seg) * ct)

  def alone(q, k, v, lam, u):
    total = 0.0
    for row, n in enumerate(splits):
      for lo, hi in ((0, n), (n, T)):
        doc = lambda x: x[row : row + 1, lo:hi]
        total += jnp.sum(ops.aft_decay(doc(q), doc(k), doc(v), lam, u) * doc(ct))
    return total

  grads = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4))
  (l1, g1), (l2, g2) = jax.jit(lambda *a: (grads(packed)(*a), grads(alone)(*a)))(q, k, v, LAM, U)
  np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-5)  # a sum that cancels
  close(g1, g2, 1e-4)
  want = ref.aft_decay(q, k, v, LAM, U, segment_ids=seg)
  np.testing.assert_allclose(ops.aft_decay(q, k, v, LAM, U, segment_ids=seg), want, 1e-5, 1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_gradients_match_finite_differences(packed, monkeypatch):
  """float64, both modes, in q, k, v, decay and bonus (T 11: two chunks of 4 and a rest)."""
  monkeypatch.setattr(decay_mod, "CHUNK", 4)
  seg = np.array([[0] * 4 + [1] * 7, [3] * 11]) if packed else None
  fn = jax.jit(functools.partial(ops.aft_decay, segment_ids=seg))
  with jax.enable_x64(True):
    rng = np.random.default_rng(7)
    qkv = [jnp.asarray(rng.normal(size=(2, 11, 3)) * s) for s in (1.0, 2.0, 1.0)]
    lam, u = jnp.asarray([0.05, 0.5, 2.0]), jnp.asarray(rng.normal(size=3))
    check_grads(fn, (*qkv, lam, u), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_jit_vmap_and_export_for_gpu_and_tpu():
  """jit; vmap (batch, per-example decays); fwd+bwd exported for GPU and TPU: no custom call."""
  q, k, v, lam = *_inputs(8), LAM
  want = ops.aft_decay(q, k, v, lam)
  for got in (jax.jit(ops.aft_decay)(q, k, v, lam),
              jax.vmap(ops.aft_decay, in_axes=(0, 0, 0, None))(q, k, v, lam),
              jax.jit(jax.vmap(ops.aft_decay))(q, k, v, np.stack([lam, lam]))):  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  x, d = jax.ShapeDtypeStruct((2, 8, 4), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32)
  fwd_bwd = jax.grad(lambda *a: jnp.sum(ops.aft_decay(*a, a[3])), argnums=(0, 1, 2, 3))
  for platform in ("cuda", "tpu"):  # the chunks' sums are matmuls
    mlir = export_for(fwd_bwd, x, x, x, d, platform=platform).mlir_module()
    assert "custom_call" not in mlir and "dot_general" in mlir


def test_steps_keep_the_inputs_dtype():
  x, xs = jnp.zeros((2, 3), jnp.bfloat16), jnp.zeros((2, 5, 3), jnp.bfloat16)
  y, state = ops.aft_decay_step(ops.aft_decay_init((2, 3)), x, x, x, jnp.ones(3), jnp.ones(3))
  assert y.dtype == jnp.bfloat16 and state.m.dtype == jnp.float32
  assert ops.aft_decay(xs, xs, xs, jnp.ones(3)).dtype == jnp.bfloat16


X, Z = np.zeros((2, 6, 4), np.float32), np.zeros(4, np.float32)
SEG = np.array([[1] * 3 + [2] * 3] * 2, np.int32)

# (args, kwargs, the message's regex)
ERRORS = [
  ((X, X, X, Z), dict(causal=False), r"aft_decay: causal=False is not supported.*one-sided"),
  ((X, X, X, Z), dict(impl="pallas"), r"aft_decay: impl='pallas' is not available: the channel"),
  ((X, X, X, Z), dict(impl="pallas_interpret"), r"'pallas_interpret' is not .* D = 4 is not a"),
  ((X, X, X, Z), dict(impl="triton"), r"aft_decay: impl must be one of"),
  ((X, X, X, Z), dict(axis_name="seq", output_final_state=True),
   r"aft_decay: axis_name \(T sharded over devices\) does not take output_final_state"),
  ((X, X[:, :5], X, Z), {}, r"aft_decay: q, k and v must have the same shape.*k \(2, 5, 4\)"),
  ((X, X, X, Z[:3]), {}, r"aft_decay: decay must be \[D\] = \(4,\); got decay \(3,\)"),
  ((X, X, X, np.zeros((2, 4))), {}, r"decay must be \[D\] = \(4,\); got decay \(2, 4\)"),
  ((X, X, X, Z - 1), {}, r"aft_decay: decay must be >= 0 .*got min -1"),
  ((X, X, X, Z + np.nan), {}, r"aft_decay: decay must be >= 0 \(and not NaN\)"),
  ((X, X, X, Z.astype(np.int32)), {}, r"decay must be a real floating-point array"),
  ((X, X, X, Z, Z[:2]), {}, r"aft_decay: bonus must be \[D\] = \(4,\); got bonus \(2,\)"),
  ((X, X, X, Z), dict(segment_ids=SEG[:, :4]), r"segment_ids must be an int array \[..., T\]"),
  ((X, X, X, Z), dict(initial_state=ops.aft_decay_init((3, 4))),
   r"aft_decay: initial_state must be the state of these inputs"),
  ((X, X, X, Z), dict(segment_ids=SEG, output_final_state=True),
   r"do not take initial_state, output_final_state"),
]  # fmt: skip


@pytest.mark.parametrize("args, kwargs, message", ERRORS, ids=[e[-1][:40] for e in ERRORS])
def test_bad_arguments_are_one_line(args, kwargs, message):
  with pytest.raises(ValueError, match=message) as e:
    ops.aft_decay(*args, **kwargs)
  assert "\n" not in str(e.value)
