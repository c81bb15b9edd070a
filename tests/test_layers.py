"""aft_jax.layers: shapes, dtypes, the paper's equations (float64), axis names, bad input."""

import functools
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax import layers
from tests.support.helpers import abstract_init, random_params
from tests.support import numpy_reference as ref

D, T, MAX_LEN, HEADS = 8, 6, 8, 2
RTOL, ATOL = 2e-4, 2e-5

AXIS_NAMES = {"embed", "heads", "kv", "length", "length_k", "bias_factor", "kernel"}


def _modules(causal=False, dtype=jnp.float32):  # AFTConv2D only when not causal
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
  if causal:
    mods["aft_decay"] = layers.AFTDecay(**kw)
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


def _init(module, shape, seed=0):
  return nn.unbox(jax.jit(module.init)(jax.random.key(seed), jnp.zeros(shape)))["params"]


def _np(a):
  return np.asarray(a, np.float64)


def _dense_np(x, p, in_axes=1):
  k = _np(p["kernel"])
  xs = list(range(x.ndim - in_axes, x.ndim))
  return np.tensordot(_np(x), k, axes=(xs, list(range(in_axes)))) + _np(p["bias"])


def _expected(name, module, params, x):
  """The layer's output: its projections around the numpy reference of its mixing."""
  q, k, v = (_dense_np(x, params[n]) for n in ("query", "key", "value"))
  t_len = x.shape[-2]
  if name == "mha":  # q, k, v: [B, T, H, C]
    logits = np.einsum("bthc,bshc->bhts", q, k) / np.sqrt(q.shape[-1])
    if module.causal:
      logits = np.where(np.tril(np.ones((t_len, t_len), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    y = np.einsum("bhts,bshc->bthc", p / p.sum(-1, keepdims=True), v)
  elif name.startswith("aft_conv"):  # the kernel: gamma * standardised raw kernel + beta
    raw = _np(params["bias"]["kernel"])
    flat = raw.reshape(raw.shape[0], -1)
    norm = (flat - flat.mean(1, keepdims=True)) / (flat.std(1, keepdims=True) + 1e-5)
    gain = lambda n: _np(params["bias"][n])[:, None]
    kernel = (gain("gamma") * norm + gain("beta")).reshape(raw.shape)
    if name == "aft_conv1d":
      y = ref.aft_conv1d(q, k, v, kernel, module.causal)
    else:
      y = ref.aft_conv2d(q, k, v, kernel)
  elif name == "aft_decay":  # decay = exp(its parameter)
    y = ref.aft_decay(q, k, v, np.exp(_np(params["decay"])), _np(params["bonus"]))
  else:
    if name == "aft_simple":
      w = np.zeros((t_len, t_len))
    elif "pos_bias" in params:
      w = _np(params["pos_bias"])[:t_len, :t_len]
    else:
      w = _np(params["pos_u"])[:t_len] @ _np(params["pos_v"])[:t_len].T
    if name.startswith("aft_local"):
      w = ref.local_bias(w, module.window)
    y = ref.aft_full(q, k, v, w, module.causal)
  return _dense_np(y, params["out"], in_axes=y.ndim - x.ndim + 1)


def test_shapes_and_dtypes_for_leading_batch_dims():  # bfloat16 compute, float32 params
  for causal, dtype in [(False, jnp.float32), (False, jnp.bfloat16), (True, jnp.bfloat16)]:
    for name, module in _modules(causal, dtype).items():
      variables = abstract_init(module, _input_shape(name), dtype)
      dtypes = {p.dtype for p in jax.tree_util.tree_leaves(nn.unbox(variables))}
      assert dtypes == {jnp.dtype(jnp.float32)}, (name, dtypes)
      for lead in [(), (2, 3)]:
        shape = _input_shape(name, lead)
        y = jax.eval_shape(module.apply, variables, jax.ShapeDtypeStruct(shape, dtype))
        assert y.shape == shape and y.dtype == dtype, (name, causal, lead, y)


def test_rows_are_one_axis_unless_a_mesh_splits_t():
  # layers.over_rows: [..., d] as [N, d] (test_model.py: what it buys); with T split over a
  # mesh's sequence axis, as it is (one axis would gather T's shards).
  x, seen = jnp.arange(24.0).reshape(2, 3, 4), []
  fn = lambda z: seen.append(z.shape) or z[..., :3] * 2
  np.testing.assert_array_equal(layers.over_rows(fn, x), x[..., :3] * 2)
  for sizes in [(2, 1), (1, 2)]:  # (data, sequence)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(sizes, ("data", "sequence"))):
      np.testing.assert_array_equal(layers.over_rows(fn, x), x[..., :3] * 2)
  assert seen == [(6, 4), (6, 4), (2, 3, 4)]


@pytest.mark.parametrize("causal", [False, True])
def test_matches_numpy_reference(causal):  # random params (w past T = 6 < max_len = 8 too)
  for name, module in _modules(causal).items():
    shape = _input_shape(name)
    params = random_params(module, shape, seed=3)
    x = _x(shape, seed=4)
    y = _jit_apply(module)({"params": params}, x)
    assert y.shape == x.shape
    want = _expected(name, module, params, x)
    chex.assert_trees_all_close(y, want, rtol=RTOL, atol=ATOL, custom_message=name)


def test_aft_full_bias_init():
  np.testing.assert_array_equal(_init(layers.AFTFull(max_len=MAX_LEN), (2, T, D))["pos_bias"], 0)
  p = _init(layers.AFTFull(max_len=64, factor_dim=16), (1, 2, D))
  for n in ("pos_u", "pos_v"):
    a = np.asarray(p[n])
    # 1024 samples: the std of the sample std is ~2.2% of sigma.
    assert 0.9e-2 < a.std() < 1.1e-2, (n, a.std())
    assert abs(a.mean()) < 1.5e-3, (n, a.mean())
  assert not np.allclose(p["pos_u"], p["pos_v"])
  # AFT-conv starts as AFT-simple with one key per head: gain gamma = beta = 0, a random kernel.
  for name in ("aft_conv1d", "aft_conv2d"):
    bias = _init(_modules()[name], _input_shape(name), seed=7)["bias"]
    np.testing.assert_array_equal(np.stack([bias["gamma"], bias["beta"]]), 0.0)
    assert bias["gamma"].shape == (HEADS,) and np.asarray(bias["kernel"]).std() > 0.1


EXPECTED_NAMES = {
  "aft_full": {"query/kernel": ("embed", "heads"), "query/bias": ("heads",),
               "out/kernel": ("heads", "embed"), "out/bias": ("embed",),
               "pos_bias": ("length", "length_k")},
  "aft_full_factor": {"pos_u": ("length", "bias_factor"), "pos_v": ("length_k", "bias_factor")},
  "aft_conv1d": {"query/kernel": ("embed", "heads", "kv"), "key/kernel": ("embed", "heads"),
                 "out/kernel": ("heads", "kv", "embed"), "bias/kernel": ("heads", "kernel"),
                 "bias/gamma": ("heads",), "bias/beta": ("heads",)},
  "aft_conv2d": {"bias/kernel": ("heads", "kernel", "kernel")},
  "aft_decay": {"decay": ("heads",), "bonus": ("heads",)},
  "mha": {"key/kernel": ("embed", "heads", "kv"), "out/kernel": ("heads", "kv", "embed")},
}  # fmt: skip


@pytest.mark.parametrize(
  "mesh_shape, batch",
  [
    ((1, 1, 1, 4), 2),  # one position per shard
    ((2, 1, 1, 2), 1),  # one row, which data = 2 does not split: the op on the whole
  ],
)
def test_logical_axis_names_of_every_param_and_under_a_mesh(mesh_shape, batch):
  """One known name per dimension; under a mesh, the shapes of no mesh."""
  from aft_jax import sharding

  mesh = jax.sharding.AbstractMesh(mesh_shape, sharding.MESH_AXES)
  for causal in (False, True):
    for name, module in _modules(causal=causal).items():
      shape = (batch, 3, 4, D) if name == "aft_conv2d" else (batch, 4, D)
      plain = abstract_init(module, shape)
      boxed = jax.tree_util.tree_leaves_with_path(
        plain["params"], is_leaf=lambda a: isinstance(a, nn.Partitioned)
      )
      names = {"/".join(p.key for p in path): tuple(leaf.names) for path, leaf in boxed}
      for path, leaf in boxed:
        assert len(leaf.names) == leaf.value.ndim and set(leaf.names) <= AXIS_NAMES, (name, path)
      assert names and EXPECTED_NAMES.get(name, {}).items() <= names.items(), (name, names)
      # Softmax attention cannot split T; AFT-conv2d's kernel names one logical axis twice
      # ("kernel"), which flax refuses under a mesh (an image layer: no model uses it).
      if name == "aft_conv2d" or causal and name == "mha":
        continue
      with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        meshed = abstract_init(module, shape)
      chex.assert_trees_all_equal_shapes_and_dtypes(nn.unbox(meshed), nn.unbox(plain))


SEG = np.zeros((1, 4), np.int32)
Full, Local, Conv1D, Conv2D = layers.AFTFull, layers.AFTLocal, layers.AFTConv1D, layers.AFTConv2D
MHA, Simple = layers.MultiHeadAttention, layers.AFTSimple
# (module, input shape, the message's first line, keywords): an op's error once per layer path
BAD = [
  (Full(max_len=4), (1, 6, D), r"aft_full: w must be \[T, T\] = \(6, 6\) .*got w \(4, 4\)"),
  (Local(max_len=4, window=2, factor_dim=2, causal=True), (1, 5, D), r"aft_local: w must be \["),
  (Local(window=0, causal=True), (1, 1, D), r"AFTLocal: window .* got 0", dict(decode=True)),
  (Conv1D(num_heads=2, kernel_size=0, causal=True), (1, 4, D), r"AFTConv1D: kernel_size"),
  (Conv2D(num_heads=2, kernel_size=(3,)), (1, 3, 3, D), r"AFTConv2D: kernel_size"),
  (Conv2D(num_heads=2), (3, D), r"aft_conv2d: expected q, v \[\.\.\., Ht, Wd, H, C\]"),
  (Conv1D(num_heads=3), (1, 4, D), rf"AFTConv1D: d_model = {D}.*num_heads = 3"),
  (MHA(num_heads=3), (1, 4, D), r"MultiHeadAttention: d_model = 8.*= 3"),
  (Full(max_len=8, causal=True), (1, 4, D), r"aft_full: positions must be an int array .*float32",
   dict(segment_ids=SEG, positions=SEG * 1.0)),
  (MHA(num_heads=2, causal=True), (1, 4, D),
   r"MultiHeadAttention: segment_ids must be an int .*\(1, 3\)", dict(segment_ids=SEG[:, :3])),
  (Conv1D(num_heads=2), (1, 4, D), r"aft_conv1d: segment_ids need causal=True", dict(mask=SEG > 0)),
  (Local(window=2, causal=True), (1, 4, D), r"AFTLocal: positions need segment_ids",
   dict(positions=SEG)),
  (Simple(causal=True), (1, 4, D), r"AFTSimple: mask must be \[..., T\] = \(1, 4\)",
   dict(mask=SEG[:, :3] > 0)),
  (layers.AFTDecay(init_decay=(-1.0, 1.0), causal=True), (1, 4, D), r"AFTDecay: init_decay .*-1"),
]  # fmt: skip


@pytest.mark.parametrize("module, shape, first_line, kw", [b + ({},) * (4 - len(b)) for b in BAD])
def test_bad_input_is_a_one_line_value_error(module, shape, first_line, kw):
  with pytest.raises(ValueError) as e:
    abstract_init(module, shape, **kw)
  assert re.fullmatch(first_line + ".*", str(e.value).splitlines()[0]), str(e.value)


def test_decode_and_rank_are_checked_by_every_layer():
  for name, mod in _modules(causal=False).items():
    if name != "aft_conv2d":
      _raises(mod, (2, 1, D), r"decode=True needs causal=True", decode=True)
      _raises(mod, (D,), rf"{type(mod).__name__}: x must be.*got x \({D},\)")  # no T
  for name, mod in _modules(causal=True).items():
    if not getattr(mod, "chunks", False):  # the recurrent layers take prompt chunks
      _raises(mod, (2, 3, D), r"decode=True takes one token.*\(2, 3, 8\)", decode=True)


def _raises(module, shape, match, **kw):
  with pytest.raises(ValueError, match=match):
    abstract_init(module, shape, **kw)


def test_attention_impl_is_passed_on_or_refused(monkeypatch):
  bf16 = dict(num_heads=2, causal=True, dtype=jnp.bfloat16)
  _raises(layers.MultiHeadAttention(impl="cudnn", **bf16), (1, 4, D), r"cudnn.*not the 'cpu'")
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
    layers.AFTDecay(causal=True),
  ],
  ids=["local", "simple", "conv1d", "decay"],
)
def test_padding_mask_ignores_the_pads(module):
  """Right (row 0), left (row 1) padding: the tokens alone's outputs, whatever the pads hold."""
  x = np.asarray(_x((2, 7, 4)))
  mask = np.array([[1] * 5 + [0] * 2, [0] * 2 + [1] * 5], bool)
  params = {"params": random_params(module, (1, 7, 4))}

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
