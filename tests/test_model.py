"""aft_jax.model: counts, decode == forward == scan, remat, dropout, checks, packed rows, init."""

import dataclasses
import functools
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import model as M
from tests.support.helpers import abstract_init, param_count, random_params

B, T, V = 2, 10, 17
BASE = M.ModelConfig(vocab_size=V, max_len=12, num_layers=2, d_model=8, num_heads=2, mlp_dim=16,
                     window=3, kernel_size=3, dropout_rate=0.0)  # fmt: skip
ADAPTIVE = dict(adaptive_cutoffs=(6, 11), adaptive_factor=2.0)


def _cfg(**kw):
  return dataclasses.replace(BASE, **kw)


def _tokens(seed=0, shape=(B, T)):
  return jnp.asarray(np.random.default_rng(seed).integers(0, V, size=shape), jnp.int32)


def _params(cfg, seed=0):
  return random_params(M.TransformerLM(cfg), (B, T), jnp.int32, seed, scale=0.4)


def _stack(params, num_layers):  # block_0, block_1, ... -> blocks (a leading layer axis)
  out = {k: v for k, v in params.items() if not k.startswith("block_")}
  out["blocks"] = jax.tree.map(
    lambda *xs: jnp.stack(xs), *[params[f"block_{i}"] for i in range(num_layers)]
  )
  return out


def _expected_count(cfg):
  d, v, m, h = cfg.d_model, cfg.vocab_size, cfg.mlp_dim, cfg.num_heads
  dense, ln, mlp = d * d + d, 2 * d, d * m + m + m * d + d
  if cfg.mixing in ("aft_full", "aft_local"):
    mix = 4 * dense + (2 * cfg.max_len * cfg.factor_dim if cfg.factor_dim else cfg.max_len**2)
  elif cfg.mixing in ("aft_simple", "softmax"):
    mix = 4 * dense
  elif cfg.mixing == "aft_decay":  # + decay and bonus [d]
    mix = 4 * dense + 2 * d
  else:  # aft_conv1d: q, v [d, H, d/H] + bias; k [d, H] + bias; out; kernel [H, s], gamma, beta
    mix = 3 * dense + (d * h + h) + h * cfg.kernel_size + 2 * h
  total = v * d + cfg.max_len * d + cfg.num_layers * (2 * ln + mix + mlp) + ln
  return total if cfg.tie_embeddings else total + d * v


@pytest.mark.parametrize("mixing", M.MIXINGS)
def test_param_count_shapes_dtypes_and_axis_names(mixing):
  assert _cfg(mixing=mixing).problems() == []
  for kw in [{}, dict(tie_embeddings=False), dict(factor_dim=3), dict(scan_layers=True)]:
    cfg = _cfg(mixing=mixing, **kw)
    variables = abstract_init(M.TransformerLM(cfg), (B, T), jnp.int32)
    params = nn.unbox(variables)["params"]
    assert M.count_params(params) == param_count(params) == _expected_count(cfg), (mixing, kw)
    assert ("unembed" in params) == (not cfg.tie_embeddings)
    # One logical axis name per dimension; a scanned stack's first: "layers".
    boxed = jax.tree_util.tree_leaves_with_path(
      variables["params"], is_leaf=lambda a: isinstance(a, nn.Partitioned)
    )
    for path, leaf in boxed:
      scanned = cfg.scan_layers and path[0].key == "blocks"
      assert len(leaf.names) == leaf.value.ndim and (leaf.names[0] == "layers") == scanned, path
      assert "layers" not in leaf.names[1:], path
  # float32 params and outputs, bfloat16 compute too.
  model = M.TransformerLM(_cfg(mixing=mixing, dtype=jnp.bfloat16))
  variables = abstract_init(model, (B, T), jnp.int32)
  assert {x.dtype for x in jax.tree_util.tree_leaves(nn.unbox(variables))} == {jnp.dtype("f4")}
  out = jax.eval_shape(model.apply, variables, _tokens())
  nll = jax.eval_shape(model.apply, variables, _tokens(), _tokens(1))
  assert (out.shape, nll.shape, out.dtype, nll.dtype) == ((B, T, V), (B, T), "f4", "f4")


def _decode_all(model, params, tokens, prefill=0):
  """Log-probs [B, T, V] decoded: ``prefill`` tokens in one chunk, then one at a time."""

  def apply(cache, x):
    return model.apply({"params": params, "cache": cache}, x, decode=True, mutable=["cache"])

  cache, chunk = model.init(jax.random.key(0), tokens[:, :1], decode=True)["cache"], []
  if prefill:
    logp, mut = apply(cache, tokens[:, :prefill])
    cache, chunk = mut["cache"], [logp]

  def step(cache, tok_B):
    logp, mut = apply(cache, tok_B[:, None])
    return mut["cache"], logp[:, 0]

  _, logp_TBV = jax.lax.scan(step, cache, tokens[:, prefill:].T)
  return jnp.concatenate(chunk + [jnp.swapaxes(logp_TBV, 0, 1)], axis=1)


@functools.partial(jax.jit, static_argnums=(0,))
def _all_paths(cfg, params, tokens, targets):  # log-probs of forward, decode; unrolled, scanned
  unrolled = M.TransformerLM(cfg)
  scanned = M.TransformerLM(dataclasses.replace(cfg, scan_layers=True))
  stacked = _stack(params, cfg.num_layers)
  out = dict(
    fwd=unrolled.apply({"params": params}, tokens),
    fwd_scan=scanned.apply({"params": stacked}, tokens),
    dec=_decode_all(unrolled, params, tokens),
    dec_scan=_decode_all(scanned, stacked, tokens),
  )
  if cfg.mixing == "aft_simple":  # the NLL path depends only on the head: plain and adaptive
    out["nll"] = unrolled.apply({"params": params}, tokens, targets)
  if cfg.mixing in M.CHUNKED:  # a prompt of 6 in one pass (T = 10 > window: the ring wraps)
    out["prefill"] = _decode_all(unrolled, params, tokens, prefill=6)
  return out


# T = 10 > window = kernel_size = 3: the decode rings wrap; both bias forms (full, factors);
# the streams: T = 8 x max_len, a prefill chunk longer than max_len.
DECODE_CASES = [
  _cfg(mixing="aft_full"),
  _cfg(mixing="aft_local", factor_dim=3),
  _cfg(mixing="aft_decay", position_embedding="none", max_len=4),
  _cfg(mixing="aft_conv1d", position_embedding="none", max_len=4),
  _cfg(mixing="softmax"),
  _cfg(mixing="aft_simple", tie_embeddings=False, d_model=16, max_len=10, **ADAPTIVE),
]


@pytest.mark.parametrize(
  "cfg", DECODE_CASES, ids=[c.mixing for c in DECODE_CASES[:-1]] + ["adaptive"]
)
def test_decode_equals_forward_and_scan_equals_unrolled(cfg):
  params = _params(cfg, seed=2)
  shape = (B, 8 * cfg.max_len) if cfg.streams else (B, T)
  tokens, targets = _tokens(3, shape), _tokens(4, shape)
  out = jax.device_get(_all_paths(cfg, params, tokens, targets))
  fwd = out["fwd"]
  assert fwd.shape == shape + (V,)
  chex.assert_tree_all_finite(out)
  # Normalised, and the NLL is minus the target's log-probability.
  chex.assert_trees_all_close(jax.scipy.special.logsumexp(fwd, axis=-1), np.zeros(shape), atol=1e-5)
  if "nll" in out:
    want = -np.take_along_axis(fwd, np.asarray(targets)[..., None], -1)[..., 0]
    chex.assert_trees_all_close(out["nll"], want, rtol=1e-5, atol=1e-5)
    assert out["nll"].shape == shape
  # The model really mixes positions: log-probs differ along T (not a bag of unigrams).
  assert np.abs(np.diff(fwd, axis=1)).max() > 1e-2
  for key in ("fwd_scan", "dec", "dec_scan", "prefill"):
    if key in out:
      chex.assert_trees_all_close(out[key], fwd, rtol=1e-4, atol=1e-4, custom_message=key)
  if cfg.streams:  # no length limit: 8 x max_len tokens, within 1e-5 of the largest
    assert cfg.problems() == [] and cfg.length_limit is None and "pos_embed" not in params
    for key in ("dec", "dec_scan", "prefill"):
      assert np.abs(out[key] - fwd).max() <= 1e-5 * np.abs(fwd).max(), key
  if cfg.mixing == "aft_local":  # decoding is not position-blind: step t sees earlier tokens
    other = tokens.at[:, 0].set((tokens[:, 0] + 1) % V)
    dec_other = _all_paths(cfg, params, other, targets)["dec"]
    assert np.abs(out["dec"][:, -1] - dec_other[:, -1]).max() > 1e-4


@pytest.mark.parametrize(
  "kw, field",
  [
    (dict(mixing="aft_local", window=0), "config.model.window"),
    (dict(mixing="aft_conv1d", num_heads=3), "config.model.num_heads = 3"),
    (dict(mixing="aft_conv1d", kernel_size=13), "config.model.kernel_size"),
    (dict(num_layers=0), "config.model.num_layers"),
    (dict(factor_dim=-1), "config.model.factor_dim"),
    (dict(dropout_rate=1.0), "config.model.dropout_rate"),
    (dict(vocab_size=-1), "config.model.vocab_size"),
    (dict(position_embedding="rotary"), "config.model.position_embedding = 'rotary' is not"),
    (dict(mixing="aft_local", position_embedding="none"), "'aft_local': its bias w[t, t']"),
    (dict(mixing="softmax", position_embedding="none"), "not config.model.mixing = 'softmax'"),
  ],
)
def test_problems_name_the_field(kw, field):  # the run config's check of the model's settings
  problems = _cfg(**kw).problems()
  assert problems and all(p.startswith("config.model.") for p in problems), problems
  assert any(field in p for p in problems), problems


_SEG = jnp.asarray([[1] * 4 + [2] * 4 + [0] * 2], jnp.int32)
_SHORT, _FLOAT = _SEG[:, :4], _SEG.astype(jnp.float32)
_ID = r"TransformerLM: {}: the id {} is outside the vocabulary \[0, 17\)$"
BAD_INPUTS = [  # (mixing, tokens, targets, keyword arguments, the message)
  ("aft_simple", (2, 13), None, {}, r"tokens \(2, 13\) are longer than max_len = 12"),
  ("aft_simple", (2, 10), (2, 9), {}, r"targets \(2, 9\) must match tokens \(2, 10\)"),
  ("softmax", (2, 10), None, dict(decode=True), r"decode=True takes tokens \[B, 1\]"),  # no chunks
  ("aft_simple", (1, 10), None, dict(segment_ids=_SHORT), r"segment_ids .* \[B, T\] = \(1, 10\)"),
  ("aft_simple", (1, 10), None, dict(segment_ids=_FLOAT), "segment_ids must be int"),
  ("aft_simple", (1, 10), None, dict(positions=_SEG), "positions need segment_ids"),
  ("aft_simple", (1, 1), None, dict(segment_ids=_SEG[:, :1], decode=True), "not decode=True"),
  ("aft_simple", -1, None, {}, _ID.format("tokens", -1)),  # -1 would wrap to V - 1
  ("aft_simple", V, None, {}, _ID.format("tokens", V)),
  ("aft_simple", (2, 10), -100, {}, _ID.format("targets", -100)),  # PyTorch's ignore label
  ("aft_simple", (2, 10), V, {}, _ID.format("targets", V)),
]


def _ids(spec):  # a shape, or the id at [0, 3] of (2, 10) tokens
  return _tokens(0, spec) if isinstance(spec, tuple) else _tokens(0).at[0, 3].set(spec)


@pytest.mark.parametrize("mixing, tokens, targets, kw, message", BAD_INPUTS)
def test_bad_inputs_are_one_line_value_errors(mixing, tokens, targets, kw, message):
  model = M.TransformerLM(_cfg(mixing=mixing))
  args = (_ids(tokens),) + (() if targets is None else (_ids(targets),))
  with pytest.raises(ValueError) as e:  # (the ids concrete, closed over)
    jax.eval_shape(lambda key: model.init(key, *args, **kw), jax.random.key(0))
  assert re.search(message, str(e.value).splitlines()[0]), str(e.value)


# (argument, an id outside [0, V)): under jit, NaN from the bad token on or the bad target's NLL.
BAD_IDS = [("tokens", -1), ("tokens", V), ("targets", -100), ("targets", -1), ("targets", V)]


def test_ids_outside_the_vocabulary_are_nan_under_jit_never_another_ids():
  model = M.TransformerLM(_cfg(mixing="aft_simple", num_layers=1, **ADAPTIVE))
  params = _params(model.cfg)
  tokens, targets = _tokens(1), _tokens(2)
  bad = lambda x, i: x.at[0, 3].set(i)
  args = lambda name, i: (bad(tokens, i),) if name == "tokens" else (tokens, bad(targets, i))

  @jax.jit
  def run(params):
    apply = lambda *a: model.apply({"params": params}, *a)
    return apply(tokens), apply(tokens, targets), [apply(*args(n, i)) for n, i in BAD_IDS]

  logp, nll, got = jax.device_get(run(params))
  for (name, i), out in zip(BAD_IDS, got):
    if name == "tokens":
      np.testing.assert_array_equal(np.isnan(out).all(-1)[0], np.arange(T) >= 3, f"{name} {i}")
      np.testing.assert_array_equal(out[0, :3], logp[0, :3])
      np.testing.assert_array_equal(out[1:], logp[1:])
    else:
      np.testing.assert_array_equal(out, bad(jnp.asarray(nll), np.nan), f"{name} {i}")


# [a a a a | b b b b | pad pad] (pads 0, as the pipeline packs): alone, the two are one batch.
PACK_SEG = np.array([1] * 4 + [2] * 4 + [0] * 2)
# One layer (compiling is the cost; the scanned case two: a block's output feeds the next).
PACK_CASES = [
  _cfg(mixing="aft_full", factor_dim=3, num_layers=1),
  _cfg(mixing="aft_local", num_layers=1),
  _cfg(mixing="aft_simple", num_layers=1),
  _cfg(mixing="aft_conv1d", num_layers=1),
  _cfg(mixing="softmax", num_layers=1),
  _cfg(mixing="aft_local", scan_layers=True, remat=True),
]


@pytest.mark.parametrize(
  "cfg", PACK_CASES, ids=[c.mixing + ("_scan" if c.scan_layers else "") for c in PACK_CASES]
)
def test_packed_row_equals_each_document_alone(cfg):
  params = _params(dataclasses.replace(cfg, scan_layers=False), seed=11)
  if cfg.scan_layers:
    params = _stack(params, cfg.num_layers)
  model = M.TransformerLM(cfg)
  row, targets = _tokens(12, (1, T)), _tokens(13, (1, T))
  seg = jnp.asarray(PACK_SEG[None], jnp.int32)
  weights = jnp.asarray(PACK_SEG[None] > 0, jnp.float32)
  alone = lambda x: x[0, :8].reshape(2, 4)  # the two documents as a batch of their own
  # Another first document and other pads: the second document must not change.
  other = row.at[:, :4].set((row[:, :4] + 1) % V).at[:, 8:].set(0)
  pos = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]], jnp.int32)

  @jax.jit
  def run(params):
    apply = lambda p, *a, **kw: model.apply({"params": p}, *a, **kw)
    packed_loss = lambda p: jnp.sum(apply(p, row, targets, segment_ids=seg) * weights)
    alone_loss = lambda p: jnp.sum(apply(p, alone(row), alone(targets)))
    return {
      "packed": apply(params, row, segment_ids=seg),
      "alone": apply(params, alone(row)),
      "plain": apply(params, row),
      "other": apply(params, other, segment_ids=seg),
      "g_packed": jax.grad(packed_loss)(params),
      "g_alone": jax.grad(alone_loss)(params),
    } | {  # positions given (AFT-simple's case): the default's, shifted by 1, or -1 (no row: NaN)
      f"pos{d}": apply(params, row, segment_ids=seg, positions=pos + d)
      for d in ((0, 1, -1) if cfg.mixing == "aft_simple" else ())
    }

  out = jax.device_get(run(params))
  if "pos0" in out:
    assert np.isnan(out.pop("pos-1")[0, 0]).all()
    np.testing.assert_allclose(out["pos0"], out["packed"], rtol=1e-6, atol=1e-6)
    assert np.abs(out["pos1"] - out["packed"]).max() > 1e-3
  chex.assert_tree_all_finite(out)
  packed = out["packed"][0, :8].reshape(2, 4, V)
  np.testing.assert_allclose(packed, out["alone"], rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(out["g_packed"], out["g_alone"], rtol=1e-4, atol=1e-5)
  assert np.abs(jax.tree.leaves(out["g_packed"])[0]).max() > 0
  # Without segment_ids the second document sees the first: the test can tell them apart.
  assert np.abs(out["plain"][0, 4:8] - out["alone"][1]).max() > 1e-3
  np.testing.assert_allclose(out["other"][0, 4:8], out["packed"][0, 4:8], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixing", ["softmax", "aft_local", "aft_conv1d"])
def test_gpt2_init_scales_and_no_biases(mixing):
  cfg = _cfg(mixing=mixing, num_layers=3, d_model=64, mlp_dim=128, num_heads=4, init="gpt2")
  init = lambda c: nn.unbox(M.TransformerLM(c).init(jax.random.key(0), _tokens()))["params"]
  params, glorot = init(cfg), init(dataclasses.replace(cfg, init="glorot"))
  residual = 0.02 / np.sqrt(2 * cfg.num_layers)
  seen, leaves = set(), jax.tree_util.tree_leaves_with_path
  for path, x in leaves(params):
    keys = [p.key for p in path]
    # AFT's own parameters (position biases, conv kernels and gains) start as under 'glorot'.
    if keys[-1] in ("pos_bias", "pos_u", "pos_v") or "bias" in keys[:-1]:
      seen.add("aft")
      np.testing.assert_array_equal(x, functools.reduce(lambda t, k: t[k], keys, glorot))
    elif keys[-1] in ("kernel", "embedding"):
      want = residual if keys[-2] in ("out", "mlp_out") else 0.02
      seen.add(want)
      np.testing.assert_allclose(np.std(np.asarray(x)), want, rtol=0.15, err_msg="/".join(keys))
      assert abs(np.mean(np.asarray(x))) < 0.2 * want, keys
  assert seen == {0.02, residual} | ({"aft"} if mixing != "softmax" else set())
  # Without biases: every bias (dense and LayerNorm) is gone, nothing else.
  no_bias = init(dataclasses.replace(cfg, use_bias=False))
  biases = [x.size for p, x in leaves(params) if p[-1].key == "bias"]
  assert biases and "bias" not in {p[-1].key for p, _ in leaves(no_bias)}
  assert M.count_params(params) - M.count_params(no_bias) == sum(biases)


def test_dropout_tied_output_scale_and_gelu_form():
  cfg = _cfg(mixing="softmax", dropout_rate=0.3)
  params = {"params": _params(cfg)}

  def run(seed=0, train=False, **kw):
    model = M.TransformerLM(dataclasses.replace(cfg, **kw))
    return model.apply(params, _tokens(), train=train, rngs={"dropout": jax.random.key(seed)})

  out, eval1, train0, train1 = run(), run(1), run(0, True), run(1, True)
  np.testing.assert_array_equal(out, eval1)  # train=False: no dropout
  assert np.abs(train0 - out).max() > 1e-4 and np.abs(train0 - train1).max() > 1e-4
  # 'glorot' scales the tied output layer by 1 / sqrt(d_model) (N(0, 1) embeddings), 'gpt2' not.
  glorot = run(init="glorot")
  np.testing.assert_allclose(jax.nn.log_softmax(out / cfg.d_model**0.5), glorot, atol=1e-5)
  assert not np.allclose(out, run(gelu_approximate=False))


def test_exact_gelu_is_jaxs_exact_gelu():
  # erf's form (torch's, cheaper on XLA:CPU) against jax's erfc form, values and derivatives.
  x = jnp.linspace(-12.0, 12.0, 20001)
  exact = functools.partial(nn.gelu, approximate=False)
  np.testing.assert_allclose(M.gelu_exact(x), exact(x), rtol=0, atol=2e-6)
  d = lambda f: jax.vmap(jax.grad(f))(x)
  np.testing.assert_allclose(d(M.gelu_exact), d(exact), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mixing", ["aft_simple", "aft_conv1d"])
def test_kernel_gradients_need_no_transposed_activations(mixing, monkeypatch):
  # layers.over_rows: the dense products take B T rows as one axis, and XLA:CPU takes each
  # kernel's gradient as one product; on [B, T, .] it first writes activations or their
  # gradients transposed, [F, B T] or [F, B, T] (F: d_model, mlp_dim or the vocabulary).
  cfg = _cfg(mixing=mixing, max_len=48, d_model=32, mlp_dim=128, num_heads=4, num_layers=1)
  tokens, params = _tokens(shape=(3, 48)), {"params": _params(cfg)}
  loss = lambda p: M.TransformerLM(cfg).apply(p, tokens, tokens).mean()

  def compiled():
    grad = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    shapes = re.findall(r"= f32\[(\d+),(\d+(?:,\d+)?)\]", grad.as_text())
    rows_last = {(f, n) for f, n in shapes if int(f) in (32, 128, V) and n in ("144", "3,48")}
    return rows_last, grad(params)

  rows_last, got = compiled()
  monkeypatch.setattr(M.layers, "over_rows", lambda fn, x, n_in=1: fn(x))
  rows_last_direct, want = compiled()
  assert rows_last == set() and rows_last_direct  # (the check finds them where they are)
  chex.assert_trees_all_close(got, want, atol=1e-6)
