"""Flax linen AFT layers, drop-in for multi-head attention ``[..., T, d_model]``: packed rows,
decoding (a "cache" collection). README.md "Using the layers", docs/long_sequences.md; the maths
and the argument checks are the ops' (``aft_jax.ops``)."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from aft_jax import ops, sharding
from aft_jax.ops import common

Dtype = Any


def _shaped(init, names, shape):
  """``init`` reshaped to ``shape`` before its logical axis ``names`` apply (DenseGeneral asks
  for a flat shape; under a mesh the names must meet the array's rank)."""

  def shaped(key, flat_shape, dtype=jnp.float32):
    return jnp.reshape(init(key, flat_shape, dtype), shape)

  return nn.with_logical_partitioning(shaped, names)


def over_rows(fn, x, n_in=1):
  """``fn`` on x [..., *inner] (its last ``n_in`` axes) with the leading axes as one row axis,
  [N, *inner]: a dense layer's product is then 2-D, and XLA:CPU takes the kernel's gradient as
  one product over N, not after writing an activation or its gradient transposed
  (benchmarks/results/peer_length/profile.md). Where a mesh splits T, x as it is: XLA's
  partitioner would gather T's shards for the one axis."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and dict(mesh.shape).get(sharding.SEQUENCE, 1) > 1:
    return fn(x)
  y = fn(x.reshape((-1,) + x.shape[x.ndim - n_in :]))
  return y.reshape(x.shape[: x.ndim - n_in] + y.shape[1:])


def _matmul(x, kernel, dimension_numbers, precision=None, preferred_element_type=None):
  """DenseGeneral's product, x [..., *inner] . kernel [*inner, *features], with the inner and
  feature axes each as one (a 2-D product on ``over_rows``' rows)."""
  n_in = len(dimension_numbers[0][0])
  inner = math.prod(kernel.shape[:n_in])
  y = jax.lax.dot_general(
    x.reshape(x.shape[: x.ndim - n_in] + (inner,)), kernel.reshape(inner, -1),
    (((x.ndim - n_in,), (0,)), ((), ())), precision=precision,
    preferred_element_type=preferred_element_type,
  )  # fmt: skip
  return y.reshape(x.shape[: x.ndim - n_in] + kernel.shape[n_in:])


def _param(module, name, init, names, shape):
  return module.param(name, nn.with_logical_partitioning(init, names), shape, module.param_dtype)


class _Projected(nn.Module):
  """A mixing layer's settings and dense projections (the model sets ``ModelConfig.init``'s)."""

  init_std: float = 0.0  # q, k, v kernels: 0 Glorot-uniform, > 0 N(0, init_std)
  out_init_std: float = 0.0  # the output projection's kernel: 0 as init_std
  use_bias: bool = True  # biases in the projections
  causal: bool = False
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  impl: str = "auto"  # the op's implementation (aft_jax.ops.IMPLS; softmax: ATTENTION_IMPLS)

  chunks = False  # whether decode=True takes a chunk of T > 1 tokens (``_decode_token``)

  def _proj(self, x, features, names, name, n_in=1):
    """x [..., *inner] -> [..., *features], a DenseGeneral over x's last ``n_in`` axes."""
    std = self.out_init_std if name == "out" and self.out_init_std else self.init_std
    init = nn.initializers.normal(std) if std > 0 else nn.initializers.xavier_uniform()
    inner = x.shape[x.ndim - n_in :]
    features = tuple(features) if isinstance(features, (tuple, list)) else (features,)
    dense = nn.DenseGeneral(
      features, axis=tuple(range(-n_in, 0)), dtype=self.dtype, param_dtype=self.param_dtype,
      name=name, use_bias=self.use_bias, kernel_init=_shaped(init, names, inner + features),
      bias_init=_shaped(nn.initializers.zeros_init(), names[n_in:], features),
      dot_general=_matmul,
    )  # fmt: skip
    return over_rows(dense, x, n_in)

  def _mix(self, x, decode, mix, *extra):
    """The output projection of ``mix(q, k, v)``, or decoding of ``_step(q, k, v, *extra)``."""
    q, k, v = self._qkv(x)
    if decode:
      name = type(self).__name__
      if not self.causal:
        raise ValueError(f"{name}: decode=True needs causal=True")
      if x.shape[-2] != 1 and not self.chunks:
        raise ValueError(
          f"{name}: decode=True takes one token, x [..., 1, d_model]; got x {x.shape}"
        )
      return self._out(self._step(q, k, v, *extra), x.shape[-1])
    return self._out(mix(q, k, v), x.shape[-1])


def _packing(module, x, segment_ids, mask, positions=None):
  """x and mask checked; {} for a plain row, else the op's ``segment_ids`` and ``positions``."""
  name, lead = type(module).__name__, jnp.shape(x)[:-1]
  if jnp.ndim(x) < 2:
    raise ValueError(f"{name}: x must be [..., T, d_model]; got x {jnp.shape(x)}")
  if segment_ids is None and mask is None:
    if positions is not None:  # (else dropped: a plain row)
      raise ValueError(f"{name}: positions need segment_ids (packed rows)")
    return {}
  if mask is not None and jnp.shape(mask) != lead:
    raise ValueError(
      f"{name}: mask must be [..., T] = {lead} for x {x.shape}; got {jnp.shape(mask)}"
    )
  seg, pos = ops.segment_positions(segment_ids, mask, lead)
  return {"segment_ids": seg, "positions": pos if positions is None else positions}


# Logical axis names of the activations q, k, v the ops take (T is "activation_length").
_QKV = ("batch", "activation_length", "heads")
_HEADS_QV = ("batch", "activation_length", "heads", "kv")


def _op(module, fn, args, names, packed):
  """``fn(*args, axis_name=...)``, T split over ``sequence`` when causal and not packed."""
  if packed or not module.causal:
    return fn(*args, axis_name=None)
  return sharding.in_mesh_shards(fn, args, names)


def _cached_step(module, init, step):
  """y of ``step(state) -> (y, state)`` on the "cache" collection, None while it is created."""
  paths, tree = jax.tree_util.tree_flatten_with_path(jax.eval_shape(init))
  names = [jax.tree_util.keystr(path[-1:], simple=True) for path, _ in paths]
  ready = module.has_variable("cache", names[0])
  leaf = lambda i: jax.tree.leaves(init())[i]
  cells = [module.variable("cache", name, leaf, i) for i, name in enumerate(names)]
  if not ready:
    return None
  y, state = step(jax.tree.unflatten(tree, [c.value for c in cells]))
  for cell, x in zip(cells, jax.tree.leaves(state)):
    cell.value = x
  return y


def _decode_token(module, q, k, v, init, step, token_axis: int = -2, chunk=None):
  """``step(state, q_t, k_t, v_t)`` on one token, ``chunk(state, q, k, v)`` on T > 1 (or q)."""
  axis = token_axis % q.ndim
  q_t, k_t, v_t = (jax.lax.index_in_dim(x, 0, axis, keepdims=False) for x in (q, k, v))
  if q.shape[axis] > 1:
    y = _cached_step(module, lambda: init(q_t, k_t, v_t), lambda s: chunk(s, q, k, v))
    return q if y is None else y
  y = _cached_step(module, lambda: init(q_t, k_t, v_t), lambda s: step(s, q_t, k_t, v_t))
  return q if y is None else jnp.expand_dims(y, axis)


class _AFTChannels(_Projected):
  """AFT-full/local/simple's per-channel q, k, v and output projection."""

  hidden_dim: int | None = None  # D, the channels of q, k, v (default: d_model)

  def _qkv(self, x):
    d, names = self.hidden_dim or x.shape[-1], ("embed", "heads")
    return tuple(self._proj(x, d, names, n) for n in ("query", "key", "value"))

  def _out(self, y, d_model):
    return self._proj(y, d_model, ("heads", "embed"), "out")


class _PositionBias(_AFTChannels):
  """A position bias w [max_len, max_len]: full (init 0) or u v^T (init N(0, 1e-2))."""

  max_len: int = 512
  factor_dim: int | None = None  # d' of w = u v^T; None: a full [max_len, max_len] parameter

  def _bias_params(self):
    f = self.factor_dim  # the layer's own setting (no op takes it): checked here
    if f is not None and (not isinstance(f, int) or isinstance(f, bool) or f < 0):
      raise ValueError(
        f"{type(self).__name__}: factor_dim must be an int >= 0 (0 or None: a full "
        f"[max_len, max_len] bias), got {f!r}"
      )
    if f:
      init, shape = nn.initializers.normal(stddev=1e-2), (self.max_len, f)
      u = _param(self, "pos_u", init, ("length", "bias_factor"), shape)
      return u, _param(self, "pos_v", init, ("length_k", "bias_factor"), shape)
    zeros = nn.initializers.zeros_init()
    return (_param(self, "pos_bias", zeros, ("length", "length_k"), (self.max_len,) * 2),)

  def bias(self, t_len):  # the top-left [T, T] block of w (float32)
    p = self._bias_params()
    if self.factor_dim:
      u, v = p
      return jnp.asarray(u[:t_len], jnp.float32) @ jnp.asarray(v[:t_len], jnp.float32).T
    return jnp.asarray(p[0][:t_len, :t_len], jnp.float32)

  def bias_row(self, t):  # row t of w: [max_len] (float32)
    p = self._bias_params()
    if self.factor_dim:
      u, v = (jnp.asarray(a, jnp.float32) for a in p)
      return v @ u[t]
    return jnp.asarray(p[0], jnp.float32)[t]  # (p may be a NumPy array; t is traced)

  def _bias_step(self, op_step):
    """``op_step(state, q_t, k_t, v_t, w[t])``, NaN once the cache holds ``max_len`` tokens."""

    def run(state, *qkv):
      y, new = op_step(state, *qkv, self.bias_row(state.index))
      return jnp.where(state.index < self.max_len, y, jnp.nan).astype(y.dtype), new

    return run


class AFTFull(_PositionBias):
  """AFT-full (paper Eq. 2): Y = sigma(Q) * (exp(w) @ (exp(K) * V)) / (exp(w) @ exp(K)).
  Input ``[..., T, d_model]``, T <= max_len."""

  @nn.compact
  def __call__(self, x, *, decode: bool = False, segment_ids=None, mask=None, positions=None):
    packed = _packing(self, x, segment_ids, mask, positions)
    # Packed rows index w by their positions (any below max_len), a plain row by t < T.
    t_bias = self.max_len if packed else x.shape[-2]
    full = lambda q, k, v, w, axis_name: ops.aft_full(
      q, k, v, w, causal=self.causal, impl=self.impl, **packed
    )
    if packed:
      return self._mix(x, decode, lambda q, k, v: full(q, k, v, self.bias(t_bias), None))
    # Per device's rows on a multi-device mesh (the op takes no shard of T).
    names = (_QKV, _QKV, _QKV, ("length", "length_k"))
    shards = lambda *qkvw: sharding.in_mesh_shards(full, qkvw, names, splits_t=False)
    return self._mix(x, decode, lambda q, k, v: shards(q, k, v, self.bias(t_bias)))

  def _step(self, q, k, v):
    init = lambda q_t, *_: ops.aft_full_init(q_t.shape, self.max_len)
    return _decode_token(self, q, k, v, init, self._bias_step(ops.aft_full_step))


class AFTLocal(_PositionBias):
  """AFT-local (paper Eq. 4): AFT-full with w'[t, t'] = w[t, t'] where |t - t'| < window, else 0
  (not -inf). Input ``[..., T, d_model]``, T <= max_len; O(T window d) time."""

  window: int = 32
  chunks = True

  @nn.compact
  def __call__(self, x, *, decode: bool = False, segment_ids=None, mask=None, positions=None):
    packed = _packing(self, x, segment_ids, mask, positions)
    names = (_QKV, _QKV, _QKV, ("length", "length_k"))
    local = lambda q, k, v, w, axis_name: ops.aft_local(
      q, k, v, w, window=self.window, causal=self.causal, impl=self.impl, axis_name=axis_name,
      **packed,
    )  # fmt: skip
    t_len = x.shape[-2]
    if self.factor_dim and self.causal and not packed:
      # The op takes w as its factors: a long sequence (in sub-pieces) or a device's shard of
      # T forms only the blocks of w = u v^T it reads, never the [T, T] product.
      names = names[:3] + (("length", "bias_factor"), ("length_k", "bias_factor"))
      factors = lambda q, k, v, u, w_v, axis_name: local(q, k, v, (u, w_v), axis_name)

      def mix(q, k, v):  # (not when decoding: the steps read their own bias rows)
        u, w_v = (jnp.asarray(a[:t_len], jnp.float32) for a in self._bias_params())
        return _op(self, factors, (q, k, v, u, w_v), names, packed)

      return self._mix(x, decode, mix)
    # Packed rows index w by their positions (any below max_len), a plain row by t < T.
    w = lambda: self.bias(self.max_len if packed else t_len)
    return self._mix(x, decode, lambda q, k, v: _op(self, local, (q, k, v, w()), names, packed))

  def _step(self, q, k, v):
    # The one-token steps take the window unchecked: the op's check, here (the chunks' op checks
    # it again). A window past max_len holds every position, as one of max_len does.
    window = min(ops.check_window("AFTLocal", self.window), self.max_len)
    init = lambda q_t, *_: ops.aft_local_init(q_t.shape, window)
    # The state's index is the chunk's offset into w; as for the steps, positions past max_len
    # have no bias row: the op gives NaN there (a traced offset cannot raise).
    chunk = lambda s, q, k, v: ops.aft_local(
      q, k, v, self.bias(self.max_len), window=window, causal=True, impl=self.impl,
      initial_state=s, output_final_state=True,
    )  # fmt: skip
    step = self._bias_step(ops.aft_local_step)
    return _decode_token(self, q, k, v, init, step, chunk=chunk)


class AFTSimple(_AFTChannels):
  """AFT-simple (paper Eq. 5): w = 0, Y_t = sigma(Q_t) * sum_t' softmax_t'(K) * V_t'. Input
  ``[..., T, d_model]``, any T; O(T d) time and memory, decoding an O(d) state."""

  chunks = True

  @nn.compact
  def __call__(self, x, *, decode: bool = False, segment_ids=None, mask=None, positions=None):
    packed = _packing(self, x, segment_ids, mask, positions)
    packed.pop("positions", None)  # no position bias
    simple = lambda q, k, v, axis_name: ops.aft_simple(
      q, k, v, causal=self.causal, impl=self.impl, axis_name=axis_name, **packed
    )
    return self._mix(x, decode, lambda *qkv: _op(self, simple, qkv, (_QKV,) * 3, packed))

  def _step(self, q, k, v):
    init = lambda q_t, *_: ops.aft_simple_init(q_t.shape)
    chunk = lambda s, q, k, v: ops.aft_simple(
      q, k, v, causal=True, impl=self.impl, initial_state=s, output_final_state=True
    )
    return _decode_token(self, q, k, v, init, ops.aft_simple_step, chunk=chunk)


class AFTDecay(_AFTChannels):
  """AFT with a learned decay (``ops.aft_decay``): w[t, t'] = -decay (t - t') for t' < t and a
  learned bonus for t' = t, per channel; decay = exp(``decay`` parameter), initialised from
  ``init_decay``'s range (log-spaced over the channels). Input ``[..., T, d_model]``, any T;
  O(T d) time, decoding an O(d) state."""

  init_decay: tuple[float, float] = (1e-3, 1.0)
  chunks = True

  def _params(self, d):
    if not (len(self.init_decay) == 2 and 0 < self.init_decay[0] <= self.init_decay[1]):
      raise ValueError(f"AFTDecay: init_decay must be (low, high), 0 < low <= high; got "
                       f"{self.init_decay!r}")  # fmt: skip
    low, high = (jnp.log(x) for x in self.init_decay)
    spread = lambda key, shape, dtype: jnp.linspace(low, high, shape[0], dtype=dtype)
    raw = _param(self, "decay", spread, ("heads",), (d,))
    bonus = _param(self, "bonus", nn.initializers.zeros_init(), ("heads",), (d,))
    return jnp.exp(jnp.asarray(raw, jnp.float32)), jnp.asarray(bonus, jnp.float32)

  @nn.compact
  def __call__(self, x, *, decode: bool = False, segment_ids=None, mask=None, positions=None):
    packed = _packing(self, x, segment_ids, mask, positions)
    packed.pop("positions", None)  # the bias is by lag
    decay, bonus = self._params(self.hidden_dim or x.shape[-1])
    op = lambda q, k, v, decay, bonus, axis_name: ops.aft_decay(
      q, k, v, decay, bonus, causal=self.causal, impl=self.impl, axis_name=axis_name, **packed
    )
    names = (_QKV,) * 3 + (("heads",),) * 2
    mix = lambda q, k, v: _op(self, op, (q, k, v, decay, bonus), names, packed)
    return self._mix(x, decode, mix, decay, bonus)

  def _step(self, q, k, v, decay, bonus):
    init = lambda q_t, *_: ops.aft_decay_init(q_t.shape)
    step = lambda s, *qkv: ops.aft_decay_step(s, *qkv, decay, bonus)
    chunk = lambda s, q, k, v: ops.aft_decay(
      q, k, v, decay, bonus, impl=self.impl, initial_state=s, output_final_state=True
    )
    return _decode_token(self, q, k, v, init, step, chunk=chunk)


class _ConvKernel(nn.Module):
  """w = gamma (w - mean w) / std w + beta per head; gamma = beta = 0 at init (paper Sec. 3.4)."""

  heads: int
  shape: tuple[int, ...]
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self):
    names = ("heads",) + ("kernel",) * len(self.shape)
    raw = _param(self, "kernel", nn.initializers.normal(1.0), names, (self.heads,) + self.shape)
    zeros = nn.initializers.zeros_init()
    gamma, beta = (_param(self, n, zeros, ("heads",), (self.heads,)) for n in ("gamma", "beta"))
    raw = jnp.asarray(raw, jnp.float32).reshape(self.heads, -1)
    norm = (raw - raw.mean(1, keepdims=True)) / (raw.std(1, keepdims=True) + 1e-5)
    w = jnp.asarray(gamma, jnp.float32)[:, None] * norm + jnp.asarray(beta, jnp.float32)[:, None]
    return w.reshape((self.heads,) + self.shape)


class _Heads(_Projected):
  """q, v ``[..., H, C = d_model / H]``, k as q or (``one_key``: AFT-conv) one per head."""

  num_heads: int = 8
  one_key = True

  def _qkv(self, x):
    d_model, h = x.shape[-1], self.num_heads
    if d_model % h:
      raise ValueError(
        f"{type(self).__name__}: d_model = {d_model} (x {x.shape}) is not divisible by "
        f"num_heads = {h}"
      )
    feat = (h, d_model // h)
    dense = lambda f, n: self._proj(x, f, ("embed", "heads", "kv")[: len(f) + 1], n)
    key_feat = feat[:1] if self.one_key else feat
    return dense(feat, "query"), dense(key_feat, "key"), dense(feat, "value")

  def _out(self, y, d_model):
    return self._proj(y, d_model, ("heads", "kv", "embed"), "out", n_in=2)


class AFTConv1D(_Heads):
  """AFT-conv over sequences (paper Eq. 6, 1-D): per head (C = d_model / H channels, one key) a
  learned kernel of ``kernel_size``, centred (odd) or, causal, entry j the bias of t' = t - j."""

  kernel_size: Any = 7
  chunks = True

  @nn.compact
  def __call__(self, x, *, decode: bool = False, segment_ids=None, mask=None, positions=None):
    packed = _packing(self, x, segment_ids, mask, positions)
    packed.pop("positions", None)  # the kernel is by lag
    if not isinstance(self.kernel_size, int) or self.kernel_size < 1:  # (odd: the op's rule)
      raise ValueError(f"AFTConv1D: kernel_size must be a positive int; got {self.kernel_size!r}")
    kernel = _ConvKernel(self.num_heads, (self.kernel_size,), self.param_dtype, name="bias")()
    conv = lambda q, k, v, kernel, axis_name: ops.aft_conv1d(
      q, k, v, kernel, causal=self.causal, impl=self.impl, axis_name=axis_name, **packed
    )
    names = (_HEADS_QV, _QKV, _HEADS_QV, ("heads", "kernel"))
    mix = lambda q, k, v: _op(self, conv, (q, k, v, kernel), names, packed)
    return self._mix(x, decode, mix, kernel)

  def _step(self, q, k, v, kernel):
    init = lambda _, k_t, v_t: ops.aft_conv1d_init(k_t.shape, v_t.shape, self.kernel_size)
    step = lambda s, *qkv: ops.aft_conv1d_step(s, *qkv, kernel)
    chunk = lambda s, q, k, v: ops.aft_conv1d(
      q, k, v, kernel, causal=True, impl=self.impl, initial_state=s, output_final_state=True
    )
    return _decode_token(self, q, k, v, init, step, token_axis=-3, chunk=chunk)


class AFTConv2D(_Heads):
  """AFT-conv over images (paper Eq. 6): per head a learned kh x kw kernel ("SAME"), odd sizes.
  ``[..., Ht, Wd, d_model] -> [..., Ht, Wd, d_model]``; not causal."""

  kernel_size: Any = 7

  @nn.compact
  def __call__(self, x):
    ks = self.kernel_size
    ks = (ks, ks) if isinstance(ks, int) else tuple(ks)
    if len(ks) != 2 or min(ks) < 1:  # (odd: the op's rule)
      raise ValueError(f"AFTConv2D: kernel_size must be (kh, kw) >= 1; got {self.kernel_size!r}")
    if self.causal:
      raise ValueError("AFTConv2D: there is no causal 2-D AFT-conv; use causal=False")
    q, k, v = self._qkv(x)
    kernel = _ConvKernel(self.num_heads, ks, self.param_dtype, name="bias")()
    return self._out(ops.aft_conv2d(q, k, v, kernel, impl=self.impl), x.shape[-1])


# ``jax.nn.dot_product_attention``'s: "auto" jax's choice; "cudnn" flash attention (Ampere on,
# bfloat16/float16), not the default: on older GPUs an automatic choice would fail.
ATTENTION_IMPLS = ("auto", "xla", "cudnn")


def attention_impl_problem(impl, dtype) -> str | None:
  """Why MultiHeadAttention cannot take ``impl`` with compute ``dtype``, or None."""
  if impl not in ATTENTION_IMPLS:
    return f"softmax attention takes impl {' | '.join(map(repr, ATTENTION_IMPLS))}"
  if impl == "cudnn" and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return f"cuDNN flash attention needs dtype bfloat16 or float16, not {jnp.dtype(dtype).name}"
  return None


def _flat(fn):
  """``fn(q, k, v)`` with the leading dims as one (``dot_product_attention``'s rank 4)."""
  flat = lambda a: a.reshape((-1,) + a.shape[-3:])
  return lambda q, k, v: fn(flat(q), flat(k), flat(v)).reshape(q.shape)


class MultiHeadAttention(_Heads):
  """Softmax multi-head attention (the baseline) with the AFT layers' interface, through
  ``jax.nn.dot_product_attention`` (``impl``: ATTENTION_IMPLS); ``max_len``: the decoding cache."""

  max_len: int = 512
  one_key = False

  @nn.compact
  def __call__(self, x, *, decode: bool = False, segment_ids=None, mask=None, positions=None):
    packed = _packing(self, x, segment_ids, mask, positions)
    if packed:  # (no op takes them here: checked as the AFT ops check theirs)
      common.check_arrays("MultiHeadAttention", x.shape[:-1], segment_ids=packed["segment_ids"])

    def attend(q, k, v):
      seg_mask, t_len = None, x.shape[-2]
      if packed:  # [B', 1, T, T]: t' of t's own segment (the causal part is is_causal's)
        seg_mask = ops.same_segment(packed["segment_ids"]).reshape((-1, 1, t_len, t_len))
      how = dict(mask=seg_mask, is_causal=self.causal, implementation=self._implementation())
      return jax.nn.dot_product_attention(q, k, v, **how)

    return self._mix(x, decode, _flat(attend))

  def _implementation(self) -> str | None:
    """``dot_product_attention``'s implementation; a ValueError where it cannot run."""
    problem = attention_impl_problem(self.impl, self.dtype)
    device = ops.device_facts()
    if problem is None and self.impl == "cudnn" and device.platform != "gpu":
      problem = (
        f"cuDNN flash attention needs a GPU, not the {device.platform!r} platform ({device})"
      )
    if problem:
      raise ValueError(f"MultiHeadAttention: impl={self.impl!r}: {problem}; use 'auto' or 'xla'")
    return None if self.impl == "auto" else self.impl

  def _step(self, q, k, v):
    return _flat(self._cached_attention)(q, k, v)

  def _cached_attention(self, q, k, v):
    b, _, h, dh = q.shape
    zeros = lambda x: jnp.zeros((b, self.max_len, h, dh), x.dtype)

    def step(cache):
      t = cache["index"]
      keys, values = (
        jax.lax.dynamic_update_slice_in_dim(cache[n], x, t, 1)
        for n, x in (("keys", k), ("values", v))
      )
      mask = (jnp.arange(self.max_len) <= t)[None, None, None, :]
      y = jax.nn.dot_product_attention(q, keys, values, mask=mask)
      return y, {"keys": keys, "values": values, "index": t + 1}

    init = lambda: {"keys": zeros(k), "values": zeros(v), "index": jnp.zeros((), jnp.int32)}
    y = _cached_step(self, init, step)
    return q if y is None else y
