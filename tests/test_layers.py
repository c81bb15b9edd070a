"""aft_jax.layers: shapes, dtypes, the paper's equations (float64 reference), causality, logical
axis names, bad input. Random params fill ``jax.eval_shape(module.init)``: only the tests of
initial values compile ``init``."""

import functools
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import layers
from aft_jax import ops
from tests.support.helpers import abstract_init
from tests.support import numpy_reference as ref

D, T, MAX_LEN, HEADS = 8, 6, 8, 2
RTOL, ATOL = 2e-4, 2e-5

AXIS_NAMES = {"embed", "heads", "kv", "length", "length_k", "bias_factor", "kernel"}


def _modules(causal=False, dtype=jnp.float32):
  """One small instance of every layer (AFTConv2D only when not causal)."""
  kw = dict(causal=causal, dtype=dtype, param_dtype=jnp.float32)
  mods = {
    "aft_full": layers.AFTFull(max_len=MAX_LEN, **kw),
    "aft_full_factor": layers.AFTFull(max_len=MAX_LEN, factor_dim=3, **kw),
    "aft_local": layers.AFTLocal(max_len=MAX_LEN, window=2, **kw),
    "aft_local_factor": layers.AFTLocal(max_len=MAX_LEN, window=3, factor_dim=3, **kw),
    "aft_simple": layers.AFTSimple(**kw),
    "aft_conv1d": layers.AFTConv1D(num_heads=HEADS, kernel_size=3, **kw),
    "mha": layers.MultiHeadAttention(num_heads=HEADS, max_len=MAX_LEN, **kw),
  }
  if not causal:
    mods["aft_conv2d"] = layers.AFTConv2D(num_heads=HEADS, kernel_size=(3, 5), **kw)
  return mods


def _input_shape(name, lead=(2,)):
  return lead + ((3, 4, D) if name == "aft_conv2d" else (T, D))


@functools.lru_cache(maxsize=None)
def _jit_apply(module):
  return jax.jit(module.apply)


def _x(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _perturb(params, seed=1):
  rng = np.random.default_rng(seed)

  def f(path, p):
    name = path[-1].key
    if name in ("pos_bias", "pos_u", "pos_v", "gamma", "beta"):
      return jnp.asarray(rng.normal(size=p.shape) * (0.7 if name != "beta" else 1.0), p.dtype)
    return p

  return jax.tree_util.tree_map_with_path(f, params)


def _params(module, shape, seed=0):
  """Random params of the module's structure (every bias, gamma and beta non-zero)."""
  rng = np.random.default_rng(seed)
  struct = nn.unbox(abstract_init(module, shape))["params"]

  def f(path, s):
    scale = 1.0 if path[-1].key in ("gamma", "beta") else 0.5
    return jnp.asarray(rng.normal(size=s.shape) * scale, s.dtype)

  return jax.tree_util.tree_map_with_path(f, struct)


def _init(module, shape, seed=0):
  return nn.unbox(jax.jit(module.init)(jax.random.key(seed), jnp.zeros(shape)))["params"]


# ---------------------------------------------------------------- numpy helpers (float64)


def _np(a):
  return np.asarray(a, np.float64)


def _dense_np(x, p, in_axes=1):
  k = _np(p["kernel"])
  xs = list(range(x.ndim - in_axes, x.ndim))
  return np.tensordot(_np(x), k, axes=(xs, list(range(in_axes)))) + _np(p["bias"])


def _conv_kernel_np(p):
  raw = _np(p["kernel"])
  h = raw.shape[0]
  flat = raw.reshape(h, -1)
  norm = (flat - flat.mean(1, keepdims=True)) / (flat.std(1, keepdims=True) + 1e-5)
  w = _np(p["gamma"])[:, None] * norm + _np(p["beta"])[:, None]
  return w.reshape(raw.shape)


def _bias_np(p, t_len):
  if "pos_bias" in p:
    return _np(p["pos_bias"])[:t_len, :t_len]
  return _np(p["pos_u"])[:t_len] @ _np(p["pos_v"])[:t_len].T


def _expected(name, module, params, x):
  if name == "aft_conv2d" or name == "aft_conv1d":
    q, v = _dense_np(x, params["query"]), _dense_np(x, params["value"])
    k = _dense_np(x, params["key"])
    kernel = _conv_kernel_np(params["bias"])
    if name == "aft_conv1d":
      y = ref.aft_conv1d(q, k, v, kernel, module.causal)
    else:
      y = ref.aft_conv2d(q, k, v, kernel)
    return _dense_np(y, params["out"], in_axes=2)
  q, k, v = (_dense_np(x, params[n]) for n in ("query", "key", "value"))
  t_len = x.shape[-2]
  if name.startswith("aft_full"):
    y = ref.aft_full(q, k, v, _bias_np(params, t_len), module.causal)
  elif name.startswith("aft_local"):
    y = ref.aft_local(q, k, v, _bias_np(params, t_len), module.window, module.causal)
  else:
    y = ref.aft_simple(q, k, v, module.causal)
  return _dense_np(y, params["out"])


def _mha_np(params, x, causal):
  q, k, v = (_dense_np(x, params[n]) for n in ("query", "key", "value"))  # [B, T, H, C]
  logits = np.einsum("bthc,bshc->bhts", q, k) / np.sqrt(q.shape[-1])
  if causal:
    t_len = x.shape[-2]
    logits = np.where(np.tril(np.ones((t_len, t_len), bool)), logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  y = np.einsum("bhts,bshc->bthc", p, v)
  return _dense_np(y, params["out"], in_axes=2)


# ---------------------------------------------------------------- shapes and dtypes


def test_shapes_and_dtypes_for_leading_batch_dims():
  """Any leading dims; bfloat16 compute with float32 params returns bfloat16."""
  for causal, dtype in [(False, jnp.float32), (False, jnp.bfloat16), (True, jnp.bfloat16)]:
    for name, module in _modules(causal, dtype).items():
      variables = abstract_init(module, _input_shape(name), dtype)
      dtypes = {p.dtype for p in jax.tree_util.tree_leaves(nn.unbox(variables))}
      assert dtypes == {jnp.dtype(jnp.float32)}, (name, dtypes)
      for lead in [(), (2, 3)]:
        shape = _input_shape(name, lead)
        y = jax.eval_shape(module.apply, variables, jax.ShapeDtypeStruct(shape, dtype))
        assert y.shape == shape and y.dtype == dtype, (name, causal, lead, y)
      if causal:  # and close to float32
        params, x = _params(module, _input_shape(name)), _x(_input_shape(name))
        y = _jit_apply(module)({"params": params}, x.astype(jnp.bfloat16))
        assert y.dtype == jnp.bfloat16, (name, y.dtype)
        y32 = _jit_apply(_modules(causal=True)[name])({"params": params}, x)
        chex.assert_tree_all_finite(y)
        y = y.astype(jnp.float32)
        chex.assert_trees_all_close(y, y32, atol=0.15, rtol=0.05, custom_message=name)


# ---------------------------------------------------------------- the paper's equations


@pytest.mark.parametrize("causal", [False, True])
def test_matches_numpy_reference(causal):
  """T = 6 < max_len = 8: the top-left block of w is the one used."""
  for name, module in _modules(causal).items():
    shape = _input_shape(name)
    params = _params(module, shape, seed=3)
    x = _x(shape, seed=4)
    y = _jit_apply(module)({"params": params}, x)
    assert y.shape == x.shape
    want = _mha_np(params, x, causal) if name == "mha" else _expected(name, module, params, x)
    chex.assert_trees_all_close(y, want, rtol=RTOL, atol=ATOL, custom_message=name)


def test_reference_depends_on_bias_block():
  module = layers.AFTFull(max_len=MAX_LEN, causal=False)
  params = _params(module, (2, T, D))
  x = _x((2, T, D))
  y = _jit_apply(module)({"params": params}, x)
  outside = jax.tree.map(lambda a: a, params)
  outside["pos_bias"] = params["pos_bias"].at[T:, :].add(5.0).at[:, T:].add(5.0)
  chex.assert_trees_all_close(_jit_apply(module)({"params": outside}, x), y)
  inside = dict(params, pos_bias=params["pos_bias"].at[0, 1].add(5.0))
  assert np.abs(_jit_apply(module)({"params": inside}, x) - y).max() > 1e-3


# ---------------------------------------------------------------- initialisation


def test_aft_full_bias_init():
  p = _init(layers.AFTFull(max_len=MAX_LEN), (2, T, D))
  assert p["pos_bias"].shape == (MAX_LEN, MAX_LEN)
  np.testing.assert_array_equal(p["pos_bias"], 0.0)
  assert "pos_u" not in p
  # AFTLocal shares the bias parameters (same shapes; their values are checked above).
  local = nn.unbox(abstract_init(layers.AFTLocal(max_len=MAX_LEN, window=2), (2, T, D)))["params"]
  assert local["pos_bias"].shape == (MAX_LEN, MAX_LEN)

  big = 64
  fac = layers.AFTFull(max_len=big, factor_dim=16)
  p = _init(fac, (1, 2, D))
  assert "pos_bias" not in p
  for n in ("pos_u", "pos_v"):
    a = np.asarray(p[n])
    assert a.shape == (big, 16), a.shape
    # 1024 samples: the std of the sample std is ~2.2% of sigma.
    assert 0.9e-2 < a.std() < 1.1e-2, (n, a.std())
    assert abs(a.mean()) < 1.5e-3, (n, a.mean())
  assert not np.allclose(p["pos_u"], p["pos_v"])


def _simple_one_key_per_head(params, x, causal, spatial):
  q = _dense_np(x, params["query"])  # [..., *S, H, C]
  v = _dense_np(x, params["value"])
  k = _dense_np(x, params["key"])[..., None] * np.ones(q.shape[-1])
  lead = x.shape[: x.ndim - 1 - spatial]
  flat = lambda a: a.reshape(lead + (-1, a.shape[-2] * a.shape[-1]))
  y = ops.aft_simple(*(jnp.asarray(flat(a), jnp.float32) for a in (q, k, v)), causal=causal)
  y = np.asarray(y, np.float64).reshape(q.shape)
  return _dense_np(y, params["out"], in_axes=2)


def test_aft_conv_equals_aft_simple_at_init():
  conv1d = _init(layers.AFTConv1D(num_heads=HEADS, kernel_size=3), (2, T, D), seed=7)
  conv2d = _init(
    layers.AFTConv2D(num_heads=HEADS, kernel_size=(3, 5)), _input_shape("aft_conv2d"), seed=7
  )
  cases = [  # the causal and non-causal AFTConv1D have the same params
    (layers.AFTConv1D(num_heads=HEADS, kernel_size=3), conv1d, 1),
    (layers.AFTConv1D(num_heads=HEADS, kernel_size=3, causal=True), conv1d, 1),
    (layers.AFTConv2D(num_heads=HEADS, kernel_size=(3, 5)), conv2d, 2),
  ]
  for module, params, spatial in cases:
    np.testing.assert_array_equal(params["bias"]["gamma"], 0.0)
    np.testing.assert_array_equal(params["bias"]["beta"], 0.0)
    assert params["bias"]["gamma"].shape == (HEADS,)
    assert np.asarray(params["bias"]["kernel"]).std() > 0.1  # the raw kernel itself is random
    x = _x(_input_shape("aft_conv2d" if spatial == 2 else "aft_conv1d"), seed=8)
    y = _jit_apply(module)({"params": params}, x)
    simple = _simple_one_key_per_head(params, x, module.causal, spatial)
    chex.assert_trees_all_close(y, simple, rtol=RTOL, atol=ATOL)
    y2 = _jit_apply(module)({"params": _perturb(params)}, x)
    assert np.abs(np.asarray(y2) - simple).max() > 1e-2, module


# ---------------------------------------------------------------- causality


def test_causal_modules_ignore_the_future():
  causal, noncausal = _modules(causal=True), _modules(causal=False)
  for name, module in causal.items():
    params = _params(module, (2, T, D), seed=9)
    x = _x((2, T, D), seed=10)
    other = _x((2, T, D), seed=11)
    fn = _jit_apply(module)
    y = fn({"params": params}, x)
    for t in range(T - 1):
      x2 = x.at[:, t + 1 :].set(other[:, t + 1 :])
      y2 = fn({"params": params}, x2)
      chex.assert_trees_all_close(
        y2[:, : t + 1], y[:, : t + 1], rtol=1e-5, atol=1e-6, custom_message=f"{name} t={t}"
      )
      assert np.abs(y2[:, t + 1 :] - y[:, t + 1 :]).max() > 1e-4, (name, t)
    # The same params without causal=True do see the future (so the check above has teeth).
    x2 = x.at[:, 1:].set(other[:, 1:])
    fn_nc = _jit_apply(noncausal[name])
    diff = fn_nc({"params": params}, x2)[:, 0] - fn_nc({"params": params}, x)[:, 0]
    assert np.abs(diff).max() > 1e-4, name


# ---------------------------------------------------------------- logical axis names

EXPECTED_NAMES = {
  "aft_full": {
    "query/kernel": ("embed", "heads"),
    "query/bias": ("heads",),
    "out/kernel": ("heads", "embed"),
    "out/bias": ("embed",),
    "pos_bias": ("length", "length_k"),
  },
  "aft_full_factor": {"pos_u": ("length", "bias_factor"), "pos_v": ("length_k", "bias_factor")},
  "aft_conv1d": {
    "query/kernel": ("embed", "heads", "kv"),
    "key/kernel": ("embed", "heads"),
    "out/kernel": ("heads", "kv", "embed"),
    "bias/kernel": ("heads", "kernel"),
    "bias/gamma": ("heads",),
    "bias/beta": ("heads",),
  },
  "aft_conv2d": {"bias/kernel": ("heads", "kernel", "kernel")},
  "mha": {"key/kernel": ("embed", "heads", "kv"), "out/kernel": ("heads", "kv", "embed")},
}


def test_every_param_has_logical_axis_names():
  for name, module in _modules(causal=False).items():
    variables = abstract_init(module, _input_shape(name))
    boxed = jax.tree_util.tree_leaves_with_path(
      variables["params"], is_leaf=lambda a: isinstance(a, nn.Partitioned)
    )
    assert boxed
    names = {}
    for path, leaf in boxed:
      key = "/".join(p.key for p in path)
      assert isinstance(leaf, nn.Partitioned), (name, key, type(leaf))
      assert len(leaf.names) == len(leaf.value.shape), (name, key, leaf.names)
      assert set(leaf.names) <= AXIS_NAMES, (name, key, leaf.names)
      names[key] = tuple(leaf.names)
    for key, want in EXPECTED_NAMES.get(name, {}).items():
      assert names[key] == want, (name, key, names[key])
    # get_partition_spec turns every box into a PartitionSpec of those names.
    specs = jax.tree_util.tree_leaves_with_path(
      nn.get_partition_spec(variables["params"]),
      is_leaf=lambda a: isinstance(a, jax.sharding.PartitionSpec),
    )
    assert {"/".join(p.key for p in path): tuple(s) for path, s in specs} == names


@pytest.mark.parametrize(
  "mesh_shape, shape",
  [
    ((1, 1, 1, 4), (2, 4, D)),  # one position per shard
    ((2, 1, 1, 2), (1, 4, D)),  # one row, which data = 2 does not split: the op on the whole
  ],
)
def test_every_layer_initialises_under_a_mesh(mesh_shape, shape):
  """Logical names fit the parameters as created (DenseGeneral's flat kernels reshaped first),
  the causal layers' ops run per sequence shard, and the values are those of no mesh."""
  from aft_jax import sharding

  mesh = jax.sharding.AbstractMesh(mesh_shape, sharding.MESH_AXES)
  for causal in (False, True):
    for name, module in _modules(causal=causal).items():
      # Softmax attention cannot split T; AFT-conv2d's kernel names one logical axis twice
      # ("kernel"), which flax refuses under a mesh (an image layer: no model uses it).
      if name == "aft_conv2d" or causal and name == "mha":
        continue
      plain = abstract_init(module, shape)
      with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        meshed = abstract_init(module, shape)
      chex.assert_trees_all_equal_shapes_and_dtypes(nn.unbox(meshed), nn.unbox(plain))


# ---------------------------------------------------------------- bad input


def _raises(module, shape, match, **kw):
  with pytest.raises(ValueError, match=match):
    abstract_init(module, shape, **kw)


BAD = [  # (module, input shape, the first line of the message, decode): the op's where it has one
  (layers.AFTFull(max_len=4), (1, 6, D), r"AFTFull: sequence length T = 6 exceeds max_len = 4"),
  (layers.AFTLocal(max_len=4, window=2), (1, 5, D), r"AFTLocal: .* exceeds max_len = 4"),
  (layers.AFTLocal(max_len=8, window=0), (1, 4, D), r"aft_local: window must be .* >= 1, got 0"),
  (layers.AFTLocal(max_len=8, window=-1, causal=True), (1, 4, D), r"aft_local: window .* got -1"),
  (layers.AFTLocal(window=0, causal=True), (1, 1, D), r"AFTLocal: window .* got 0", True),
  (layers.AFTConv1D(num_heads=2, kernel_size=4), (1, 4, D), r"aft_conv1d: .*odd .*kernel \(2, 4\)"),
  (layers.AFTConv1D(num_heads=2, kernel_size=0, causal=True), (1, 4, D), r"AFTConv1D: kernel_size"),
  (layers.AFTConv2D(num_heads=2, kernel_size=(3, 4)), (1, 3, 3, D), r"aft_conv2d: .*\(2, 3, 4\)"),
  (layers.AFTConv2D(num_heads=2, kernel_size=2), (1, 3, 3, D), r"aft_conv2d: kernel sizes .*odd"),
  (layers.AFTConv2D(num_heads=2, kernel_size=(3,)), (1, 3, 3, D), r"AFTConv2D: kernel_size"),
  (layers.AFTConv2D(num_heads=2), (3, D), r"aft_conv2d: expected q, v \[\.\.\., Ht, Wd, H, C\]"),
  (layers.AFTConv1D(num_heads=3), (1, 4, D), rf"AFTConv1D: d_model = {D}.*num_heads = 3"),
  (layers.AFTConv2D(num_heads=3, kernel_size=3), (1, 3, 3, D), r"AFTConv2D: d_model = 8.*= 3"),
  (layers.MultiHeadAttention(num_heads=3), (1, 4, D), r"MultiHeadAttention: d_model = 8.*= 3"),
]


@pytest.mark.parametrize(
  "module, shape, first_line, decode", [b + (False,) * (4 - len(b)) for b in BAD]
)
def test_bad_input_is_a_one_line_value_error(module, shape, first_line, decode):
  with pytest.raises(ValueError) as e:
    abstract_init(module, shape, **({"decode": True} if decode else {}))
  assert re.fullmatch(first_line + ".*", str(e.value).splitlines()[0]), str(e.value)


def test_decode_and_rank_are_checked_by_every_layer():
  for name, mod in _modules(causal=False).items():
    if name != "aft_conv2d":
      _raises(mod, (2, 1, D), r"decode=True needs causal=True", decode=True)
      _raises(mod, (D,), rf"{type(mod).__name__}: x must be.*got x \({D},\)")  # no T
  for name, mod in _modules(causal=True).items():
    if not getattr(mod, "chunks", False):  # the recurrent layers take prompt chunks
      _raises(mod, (2, 3, D), r"decode=True takes one token.*\(2, 3, 8\)", decode=True)


def test_attention_impl_is_passed_on_or_refused(monkeypatch):
  bf16 = dict(num_heads=2, causal=True, dtype=jnp.bfloat16)
  _raises(layers.MultiHeadAttention(impl="cudnn", **bf16), (1, 4, D), r"cudnn.*not the 'cpu'")
  _raises(layers.MultiHeadAttention(impl="flash", **bf16), (1, 4, D), r"takes impl 'auto'")
  _raises(layers.MultiHeadAttention(impl="cudnn", num_heads=2), (1, 4, D), r"bfloat16 or float16")
  seen = []
  real = jax.nn.dot_product_attention
  monkeypatch.setattr(
    jax.nn,
    "dot_product_attention",
    lambda *a, implementation=None, **kw: seen.append(implementation) or real(*a, **kw),
  )
  for impl in ("auto", "xla"):
    abstract_init(layers.MultiHeadAttention(impl=impl, **bf16), (1, 4, D))
  assert seen == [None, "xla"]


@pytest.mark.parametrize(
  "module",
  [
    layers.AFTLocal(window=2, max_len=8, causal=True, factor_dim=2),
    layers.AFTSimple(causal=True),
    layers.AFTConv1D(num_heads=2, kernel_size=2, causal=True),
  ],
  ids=["local", "simple", "conv1d"],
)
def test_padding_mask_ignores_the_pads(module):
  """Right padding (row 0) and left padding (row 1): the tokens' outputs are the layer's on the
  tokens alone (bias positions from 0), whatever the pads hold; pad outputs are finite."""
  x = np.asarray(_x((2, 7, 4)))
  mask = np.array([[1] * 5 + [0] * 2, [0] * 2 + [1] * 5], bool)
  params = {"params": _params(module, (1, 7, 4))}

  @jax.jit
  def run(params, x):
    padded = module.apply(params, x, mask=mask)
    alone = module.apply(params, jnp.stack([x[0, :5], x[1, 2:]]))
    return padded, alone

  padded, alone = run(params, x)
  junk = x.copy()
  junk[~mask] = 1e4  # what the pads hold does not matter
  padded_junk, _ = run(params, junk)
  chex.assert_tree_all_finite(padded_junk)
  tokens = np.stack([padded[0, :5], padded[1, 2:]])
  np.testing.assert_allclose(tokens, alone, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(padded_junk[mask], padded[mask], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"mask must be \[..., T\] = \(2, 7\)"):
    module.apply(params, x, mask=mask[:, :3])
