"""aft_jax.adaptive: adaptive input and adaptive softmax."""

from functools import partial

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

from aft_jax.adaptive import AdaptiveInput, AdaptiveSoftmax
from tests.support.helpers import param_count

V, D, CUT = 50, 16, (10, 25)


@partial(jax.jit, static_argnames=("module", "method"))  # eager calls recompile the scan each time
def _apply(module, variables, *args, method="__call__"):
  return module.apply(variables, *args, method=method)


def _setup_softmax(cutoffs=CUT, chunk_size=8192, scale=1.0, n=V):
  sm = AdaptiveSoftmax(V, D, cutoffs, chunk_size=chunk_size)
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  h = scale * jax.random.normal(k1, (n, D))
  t = jax.random.permutation(k2, V)[:n]  # n = V: every word id once (every cluster boundary)
  # Init through log_probs: creates the same params without compiling nll's scans.
  variables = sm.init(k3, h, method="log_probs")
  return sm, variables, h, t


@pytest.mark.parametrize(
  "cutoffs, chunk_size", [(CUT, 1), (CUT, 7), (CUT, 8192), ((), 1), ((), 8192), ((10,), 7)]
)
def test_nll_is_minus_the_normalised_log_probs(cutoffs, chunk_size):
  sm, v, h, t = _setup_softmax(cutoffs, chunk_size=chunk_size)
  # Batch [2, V]: row 0 at unit scale, row 1 at |h| ~ 1e3 (logits ~ 1e3-1e4, no overflow).
  scale = jnp.array([1.0, 1e3])[:, None, None]
  hb, tb = h[None] * scale, jnp.stack([t, t])
  nll = _apply(sm, v, hb, tb)
  chex.assert_shape(nll, (2, V))
  chex.assert_tree_all_finite(nll)
  lp = _apply(sm, v, hb, method="log_probs")
  chex.assert_shape(lp, (2, V, V))
  np.testing.assert_allclose(np.exp(lp[0]).sum(-1), 1.0, atol=1e-5)
  ref = -jnp.take_along_axis(lp, tb[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(nll[0], ref[0], rtol=1e-5, atol=2e-5)
  np.testing.assert_allclose(nll[1], ref[1], rtol=1e-5, atol=2e-2)  # relative to ~1e3 logits
  assert float(jnp.max(nll[1])) > 100.0  # the large case really has big logits
  if not cutoffs:  # one cluster: optax's full softmax over the module's own table
    w = nn.unbox(v)["params"]["head_embed"]
    assert set(nn.unbox(v)["params"]) == {"head_embed"}
    want = optax.softmax_cross_entropy_with_integer_labels(hb @ w.T, tb)
    np.testing.assert_allclose(nll[0], want[0], rtol=1e-5, atol=1e-5)


def test_grads_float64_and_finite_at_large_logits():
  sm, v, h, t = _setup_softmax(CUT, chunk_size=7)
  g = jax.jit(jax.grad(lambda v, h: sm.apply(v, h, t).mean(), argnums=(0, 1)))(v, h * 1e3)
  chex.assert_tree_all_finite(g)
  assert all(float(jnp.abs(x).sum()) > 0 for x in jax.tree.leaves(g))  # no table unused
  with pytest.raises(ValueError, match="targets"):
    sm.apply(v, h, t[:-1])
  # Params and inputs made in float32 (reusing compiled init ops), then cast up.
  _, v, h, t = _setup_softmax(CUT, chunk_size=7, n=12)
  with jax.enable_x64(True):
    sm = AdaptiveSoftmax(V, D, CUT, chunk_size=7, dtype=jnp.float64, param_dtype=jnp.float64)
    p64, h64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), (nn.unbox(v)["params"], h))
    f = jax.jit(lambda h, p: sm.apply({"params": p}, h, t))
    assert f(h64, p64).dtype == jnp.float64
    # One reverse-mode check w.r.t. h and every parameter (one compile, not several).
    check_grads(f, (h64, p64), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_bfloat16_compute():
  sm32, v, h, t = _setup_softmax(CUT, chunk_size=7, scale=3.0)
  sm16 = AdaptiveSoftmax(V, D, CUT, chunk_size=7, dtype=jnp.bfloat16)
  nll16 = _apply(sm16, v, h, t)
  assert nll16.dtype == jnp.float32
  chex.assert_tree_all_finite(nll16)
  np.testing.assert_allclose(nll16, _apply(sm32, v, h, t), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("cutoffs", [(1000,), ()])
def test_compiled_memory_no_full_logits(cutoffs):
  vocab, n, d = 200_000, 512, 64
  sm = AdaptiveSoftmax(vocab, d, cutoffs, chunk_size=4096)
  h = jax.ShapeDtypeStruct((n, d), jnp.float32)
  t = jax.ShapeDtypeStruct((n,), jnp.int32)
  v = jax.eval_shape(sm.init, jax.random.key(0), h, t)
  loss = lambda v, h, t: sm.apply(v, h, t).mean()
  dense_bytes = n * (vocab - (cutoffs[0] if cutoffs else 0)) * 4
  fwd = jax.jit(loss).lower(v, h, t).compile().memory_analysis().temp_size_in_bytes
  bwd = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(v, h, t).compile()
  bwd = bwd.memory_analysis().temp_size_in_bytes
  assert fwd < dense_bytes / 4, (fwd, dense_bytes)
  assert bwd < dense_bytes / 4, (bwd, dense_bytes)  # remat: backward doesn't store chunks


def test_adaptive_input_values_and_the_axis_names():
  ai = AdaptiveInput(V, D, CUT)
  ids = jnp.arange(V).reshape(5, 10)
  v = ai.init(jax.random.key(0), ids)
  p = nn.unbox(v)["params"]
  chex.assert_shape(
    [p["embed_0"], p["embed_1"], p["proj_1"], p["embed_2"], p["proj_2"]],
    [(10, 16), (15, 4), (4, 16), (25, 1), (1, 16)],
  )
  out = ai.apply(v, ids)
  chex.assert_shape(out, (5, 10, D))
  out = np.asarray(out.reshape(V, D))
  # Each word's vector is its own cluster's row (projected): e(w) = E_i[w - lo_i] @ P_i.
  np.testing.assert_allclose(out[:10], p["embed_0"], rtol=1e-6)
  np.testing.assert_allclose(out[10:25], p["embed_1"] @ p["proj_1"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out[25:], p["embed_2"] @ p["proj_2"], rtol=1e-5, atol=1e-6)
  assert ai.apply(v, ids).dtype == jnp.float32
  assert AdaptiveInput(V, D, CUT, dtype=jnp.bfloat16).apply(v, ids).dtype == jnp.bfloat16
  one = AdaptiveInput(V, D, [])  # a single cluster: a plain embedding
  v1 = one.init(jax.random.key(0), jnp.arange(V))
  assert set(nn.unbox(v1)["params"]) == {"embed_0"}
  np.testing.assert_array_equal(one.apply(v1, jnp.arange(V)), nn.unbox(v1)["params"]["embed_0"])
  specs = {
    **nn.get_partition_spec(v)["params"],
    **nn.get_partition_spec(_setup_softmax()[1])["params"],
  }
  big, small = ("vocab", "embed"), ("embed_small", "embed")
  want = dict(embed_0=big, embed_2=("vocab", "embed_small"), proj_1=small, head_embed=big)
  want.update(cluster_logits=("cluster", "embed"), tail_proj_2=small)
  assert {k: tuple(specs[k]) for k in want} == want


class _TinyLM(nn.Module):
  tie: bool
  cutoffs: tuple = CUT

  def setup(self):
    self.embed = AdaptiveInput(V, D, self.cutoffs)
    self.out = AdaptiveSoftmax(
      V, D, self.cutoffs, chunk_size=7, tie_to=self.embed if self.tie else None
    )
    self.mix = nn.Dense(D)

  def __call__(self, ids, targets):
    return self.out(jnp.tanh(self.mix(self.embed(ids))), targets)

  def log_probs(self, ids):
    return self.out.log_probs(jnp.tanh(self.mix(self.embed(ids))))


@pytest.mark.parametrize("cutoffs", [CUT, ()])
def test_tying_shares_params(cutoffs):
  ids = jnp.arange(V)[None]
  tgt = jnp.roll(ids, 1, axis=-1)
  tied, untied = _TinyLM(True, cutoffs), _TinyLM(False, cutoffs)
  vt = jax.jit(partial(tied.init, method="log_probs"))(jax.random.key(0), ids)
  vu = jax.eval_shape(partial(untied.init, method="log_probs"), jax.random.key(0), ids)
  n_in, n_rest = param_count(vt["params"]["embed"]), len(cutoffs) * D + D * D + D
  assert (param_count(vt), param_count(vu)) == (n_in + n_rest, 2 * n_in + n_rest)
  assert set(nn.unbox(vt)["params"].get("out", {})) <= {"cluster_logits"}

  # Tied == untied with the softmax's tables set to the input's.
  pt = nn.unbox(vt)["params"]
  emb, out = pt["embed"], dict(pt.get("out", {}), head_embed=pt["embed"]["embed_0"])
  for i in range(1, len(cutoffs) + 1):
    out[f"tail_embed_{i}"], out[f"tail_proj_{i}"] = emb[f"embed_{i}"], emb[f"proj_{i}"]
  lp = _apply(untied, {"params": dict(pt, out=out)}, ids, method="log_probs")
  np.testing.assert_allclose(_apply(tied, vt, ids, method="log_probs"), lp, rtol=1e-5, atol=1e-5)
  ref = -jnp.take_along_axis(lp, tgt[..., None], axis=-1).mean()

  # The tied (streamed) loss matches; the shared table's gradient is finite and nonzero.
  loss, g = jax.jit(jax.value_and_grad(lambda p: tied.apply({"params": p}, ids, tgt).mean()))(pt)
  np.testing.assert_allclose(loss, ref, rtol=1e-5)
  chex.assert_tree_all_finite(g)
  assert float(jnp.abs(g["embed"]["embed_0"]).sum()) > 0


IN, SM = AdaptiveInput, AdaptiveSoftmax
BAD_ARGS = [  # (class, arguments, the message): the checks both share are _Clusters'
  (IN, dict(cutoffs=[25, 10]), "strictly increasing"),
  (IN, dict(cutoffs=[10, 10]), "strictly increasing"),
  (IN, dict(cutoffs=[10, 50]), "vocab_size"),
  (IN, dict(cutoffs=[0, 10]), "cutoffs"),
  (IN, dict(cutoffs=[2, 4, 6]), "d_model"),  # 16 // 4**3 = 0
  (IN, dict(cutoffs=[10], factor=0.5), "factor"),
  (IN, dict(cutoffs=[10], d_model=0), "d_model"),
  (SM, dict(cutoffs=CUT, chunk_size=0), "chunk_size"),
  (SM, dict(cutoffs=CUT, tie_to=AdaptiveInput(V, D, (10,))), "tie_to"),
]


@pytest.mark.parametrize("cls, kwargs, match", BAD_ARGS)
def test_bad_arguments_raise(cls, kwargs, match):
  with pytest.raises(ValueError, match=match):
    cls(**(dict(vocab_size=V, d_model=D) | kwargs))
