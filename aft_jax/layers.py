"""Flax linen AFT layers: drop-in replacements for multi-head attention.

Every module maps ``x [..., T, d_model] -> [..., T, d_model]``: it projects x to q, k, v, mixes
them with one of the ops of :mod:`aft_jax.ops` and projects back to d_model. They share one
interface (``causal``, ``dtype`` for compute, ``param_dtype`` for parameters) so a model can
switch its mixing layer by name, and every parameter carries logical axis names for sharding:

    embed     the model dimension d_model
    heads     AFT's channels (every channel is its own "head" in AFT-full/local/simple), or the
              heads of AFT-conv and softmax attention
    kv        the channels of one head
    length    the query position of the T x T bias; length_k its key position
    bias_factor  the factor dimension d' of a factorised bias w = u v^T
    kernel    the offsets of an AFT-conv kernel

Packed rows (causal layers only): ``segment_ids`` ``[..., T]`` (documents that do not see each
other; a new one wherever the id changes) and ``mask`` ``[..., T]`` (False: padding, which no
token sees; pad outputs are finite and meaningless) make each document's output what the layer
gives on it alone, the bias positions of each from 0 (``ops.segment_positions``), or
``positions`` ``[..., T]`` where given (AFT-full/local: the rows and columns of w, < max_len).
Softmax attention takes them as a mask: position t attends to t' <= t of its own segment.

Incremental decoding (``decode=True``, causal layers only): x is one token ``[..., 1, d_model]``
and the layer keeps a "cache" collection: AFT-simple an O(d) state (running max, numerator,
denominator), AFT-local and AFT-conv1d that state plus the last ``window`` keys and values,
AFT-full and softmax attention all past keys and values. AFTSimple and AFTConv1D decode any
number of tokens (no position bias: their state is the same size at every position).
AFTFull and AFTLocal decode at most ``max_len`` tokens: the index is traced, so a step past it
cannot raise; its output is NaN (every later one too), never values for a position with no
cache slot or bias row. The AFT layers' steps are the pure functions of ``aft_jax.ops``
(``ops.aft_simple_step``, ...) on that state. Initialise the cache with ``model.init(...,
decode=True)`` on a ``[..., 1, d_model]`` input. AFT-simple, AFT-local and AFT-conv1d also take
a chunk ``[..., T, d_model]`` with ``decode=True`` (a prompt): one parallel pass of the op after
the cached state, which it leaves as T steps would (the ops' ``initial_state`` /
``output_final_state``).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from aft_jax import ops, sharding

Dtype = Any
_dense_init = nn.initializers.xavier_uniform()


def _shaped(init, names, shape):
  """``init`` for a parameter of ``shape`` with logical axis ``names`` (one per axis).

  DenseGeneral asks its initializers for a flat shape ([in, out] for the kernel, [out] for the
  bias) and reshapes what they return; the names go on the reshaped value, so that under a mesh
  (``mesh.sequence > 1`` traces in one) the constraint they imply meets the array they describe,
  not a flat one of another rank. The values are those of ``init`` at the flat shape."""

  def shaped(key, flat_shape, dtype=jnp.float32):
    return jnp.reshape(init(key, flat_shape, dtype), shape)

  return nn.with_logical_partitioning(shaped, names)


def _dense(
  in_features, features, names, dtype, param_dtype, name, axis=-1, *, std=0.0, use_bias=True
):
  """DenseGeneral from ``in_features`` (the contracted axes' sizes: an int, or a tuple with
  ``axis``) to ``features`` (an int or a tuple), its kernel's axes named ``names``; the kernel
  Glorot-uniform, or N(0, std) for std > 0."""
  tup = lambda x: tuple(x) if isinstance(x, (tuple, list)) else (x,)
  n_in = len(tup(in_features))
  init = nn.initializers.normal(std) if std > 0 else _dense_init
  return nn.DenseGeneral(
    features,
    axis=axis,
    dtype=dtype,
    param_dtype=param_dtype,
    name=name,
    use_bias=use_bias,
    kernel_init=_shaped(init, names, tup(in_features) + tup(features)),
    bias_init=_shaped(nn.initializers.zeros_init(), names[n_in:], tup(features)),
  )


class _Projected(nn.Module):
  """How a mixing layer's dense projections start, and whether they have biases.

  The defaults are the layers' own (Glorot-uniform kernels, biases); the language model sets
  GPT-2's initialisation here (``ModelConfig.init``): every projection N(0, 0.02) and the
  output projection, which adds to the residual stream, N(0, 0.02 / sqrt(2 num_layers)), so
  that the stream's variance does not grow with depth. AFT's own parameters (the position
  biases) keep the AFT paper's initialisation either way.
  """

  init_std: float = 0.0  # q, k, v kernels: 0 Glorot-uniform, > 0 N(0, init_std)
  out_init_std: float = 0.0  # the output projection's kernel: 0 as init_std
  use_bias: bool = True  # biases in the projections

  def _proj(self, in_features, features, names, name, axis=-1):
    std = self.out_init_std if name == "out" and self.out_init_std else self.init_std
    return _dense(
      in_features, features, names, self.dtype, self.param_dtype, name, axis,
      std=std, use_bias=self.use_bias,
    )  # fmt: skip


def _check_rank(module, x):
  """ValueError unless x is ``[..., T, d_model]`` (a rank-1 x has no T)."""
  if jnp.ndim(x) < 2:
    raise ValueError(f"{type(module).__name__}: x must be [..., T, d_model]; got x {jnp.shape(x)}")


def _check_len(module, t_len):
  if t_len > module.max_len:
    raise ValueError(
      f"{type(module).__name__}: sequence length T = {t_len} exceeds max_len = "
      f"{module.max_len} (input shape [..., T, d_model])"
    )


def _check_decode_input(module, x, chunks: bool = False):
  """``chunks``: the layer also takes a chunk of T > 1 tokens (the recurrent AFT layers)."""
  if not module.causal:
    raise ValueError(f"{type(module).__name__}: decode=True needs causal=True")
  if x.shape[-2] != 1 and not chunks:
    raise ValueError(
      f"{type(module).__name__}: decode=True takes one token at a time, x [..., 1, d_model]; "
      f"got x {x.shape}"
    )


def _packing(module, x, segment_ids, mask, positions=None, t_axis: int = -2):
  """{} for a plain row, else the op's ``segment_ids`` and ``positions`` for packed rows and a
  padding mask (``ops.segment_positions``; ``positions`` given: the bias positions, else each
  segment's from 0); ValueError unless causal and ``[..., T]``."""
  if segment_ids is None and mask is None:
    if positions is not None:
      raise ValueError(f"{type(module).__name__}: positions need segment_ids (packed rows)")
    return {}
  name = type(module).__name__
  if not module.causal:
    raise ValueError(f"{name}: segment_ids and mask (packed rows, padding) need causal=True")
  lead = x.shape[: x.ndim + t_axis + 1]
  for arg, a in (("segment_ids", segment_ids), ("mask", mask), ("positions", positions)):
    if a is not None and jnp.shape(a) != lead:
      raise ValueError(
        f"{name}: {arg} must be [..., T] = {lead} for x {x.shape}; got {jnp.shape(a)}"
      )
  seg, pos = ops.segment_positions(segment_ids, mask, lead)
  return {"segment_ids": seg, "positions": pos if positions is None else positions}


# Logical axis names of the activations q, k, v the ops take (T is "activation_length").
_QKV = ("batch", "activation_length", "heads")
_HEADS_QV = ("batch", "activation_length", "heads", "kv")


def _op(module, fn, args, names):
  """``fn(*args, axis_name=...)``: with T split over the mesh's ``sequence`` axis
  (``sharding.in_mesh_shards``) in a causal layer, else on the whole of T."""
  if not module.causal:
    return fn(*args, axis_name=None)
  return sharding.in_mesh_shards(fn, args, names)


def _cached_step(module, init, step):
  """``step(state) -> (y, state)`` on the decoding state kept in the layer's "cache" collection:
  one variable per leaf of ``init()``, the state before any token (a NamedTuple or dict of
  arrays), named by its field (m, num, den, keys, values, index).

  Returns y, or None while the cache is being initialised (``model.init(..., decode=True)``:
  shapes only, no step).
  """
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


def _within_max_len(module, step):
  """``step`` whose output is NaN once the cache holds ``max_len`` tokens (the index is traced,
  so this is visible without checkify: position max_len has no cache slot or bias row)."""

  def run(state, *qkv):
    y, new = step(state, *qkv)
    return jnp.where(state.index < module.max_len, y, jnp.nan).astype(y.dtype), new

  return run


def _decode_token(module, q, k, v, init, step, token_axis: int = -2, chunk=None):
  """A decoding step of an AFT layer on one token, q, k, v ``[..., 1, *channels]``:
  ``step(state, q_t, k_t, v_t) -> (y_t, state)`` (an ``aft_jax.ops`` step) on the state kept in
  the cache (``_cached_step``), ``init(q_t, k_t, v_t)`` before the first token. With T > 1
  tokens (a prompt chunk), ``chunk(state, q, k, v) -> (y, state)``: the op on all of them in
  one parallel pass after the cached state (``initial_state``, ``output_final_state``).

  token_axis: the token's axis in q (in k and v the same axis counted from the front).
  Returns y ``[..., T, *channels]``, or q while the cache is being initialised.
  """
  axis = token_axis % q.ndim
  q_t, k_t, v_t = (jax.lax.index_in_dim(x, 0, axis, keepdims=False) for x in (q, k, v))
  if q.shape[axis] > 1:
    y = _cached_step(module, lambda: init(q_t, k_t, v_t), lambda s: chunk(s, q, k, v))
    return q if y is None else y
  y = _cached_step(module, lambda: init(q_t, k_t, v_t), lambda s: step(s, q_t, k_t, v_t))
  return q if y is None else jnp.expand_dims(y, axis)


def _head_features(module, x):
  """(num_heads, d_model // num_heads) for x [..., d_model]; ValueError if it does not divide."""
  d_model, h = x.shape[-1], module.num_heads
  if d_model % h:
    raise ValueError(
      f"{type(module).__name__}: d_model = {d_model} (x {x.shape}) is not divisible by "
      f"num_heads = {h}"
    )
  return (h, d_model // h)


def _heads_out(module, y, d_model):
  """The output projection of per-head values y ``[..., H, C] -> [..., d_model]``."""
  return module._proj(y.shape[-2:], d_model, ("heads", "kv", "embed"), "out", axis=(-2, -1))(y)  # pylint: disable=protected-access


class _AFTChannels(_Projected):
  """Shared parts of AFT-full/local/simple: per-channel q, k, v and the output projection."""

  hidden_dim: int | None = None  # D, the channels of q, k, v (default: d_model)
  causal: bool = False
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  impl: str = "auto"  # the op's implementation (aft_jax.ops: "auto", "xla", "pallas", ...)

  def _qkv(self, x):
    d = self.hidden_dim or x.shape[-1]
    names = ("embed", "heads")
    return tuple(self._proj(x.shape[-1], d, names, n)(x) for n in ("query", "key", "value"))

  def _out(self, y, d_model):
    return self._proj(y.shape[-1], d_model, ("heads", "embed"), "out")(y)

  chunks = False  # whether decode=True takes a chunk of T > 1 tokens (``_decode_token``)

  def _mix(self, x, decode, mix):
    """Projects x to q, k, v, mixes them (``mix(q, k, v)``, or a decoding step) and projects
    back to d_model."""
    q, k, v = self._qkv(x)
    if decode:
      _check_decode_input(self, x, self.chunks)
      y = self._step(q, k, v)
    else:
      y = mix(q, k, v)
    return self._out(y, x.shape[-1])


class _PositionBias(_AFTChannels):
  """A learned T x T position bias w: full (init 0) or factorised u v^T (init N(0, 1e-2))."""

  max_len: int = 512
  factor_dim: int | None = None  # d' of w = u v^T; None: a full [max_len, max_len] parameter

  def _bias_params(self):
    f = self.factor_dim
    if f is not None and (not isinstance(f, int) or isinstance(f, bool) or f < 0):
      raise ValueError(
        f"{type(self).__name__}: factor_dim must be an int >= 0 (0 or None: a full "
        f"[max_len, max_len] bias), got {f!r}"
      )
    if self.factor_dim:
      init = nn.initializers.normal(stddev=1e-2)
      names = ("length", "bias_factor")
      u = self.param(
        "pos_u",
        nn.with_logical_partitioning(init, names),
        (self.max_len, self.factor_dim),
        self.param_dtype,
      )
      v = self.param(
        "pos_v",
        nn.with_logical_partitioning(init, ("length_k", "bias_factor")),
        (self.max_len, self.factor_dim),
        self.param_dtype,
      )
      return u, v
    w = self.param(
      "pos_bias",
      nn.with_logical_partitioning(nn.initializers.zeros_init(), ("length", "length_k")),
      (self.max_len, self.max_len),
      self.param_dtype,
    )
    return (w,)

  def bias(self, t_len):
    """The top-left [T, T] block of w (float32)."""
    p = self._bias_params()
    if self.factor_dim:
      u, v = p
      return jnp.asarray(u[:t_len], jnp.float32) @ jnp.asarray(v[:t_len], jnp.float32).T
    return jnp.asarray(p[0][:t_len, :t_len], jnp.float32)

  def bias_row(self, t):
    """Row t of w, all max_len keys: [max_len] (float32)."""
    p = self._bias_params()
    if self.factor_dim:
      u, v = (jnp.asarray(a, jnp.float32) for a in p)
      return v @ u[t]
    return jnp.asarray(p[0], jnp.float32)[t]  # (p may be a NumPy array; t is traced)


class AFTFull(_PositionBias):
  """AFT-full (paper Eq. 2) with a learned [max_len, max_len] position bias.

  Y = sigma(Q) * (exp(w) @ (exp(K) * V)) / (exp(w) @ exp(K)), Q, K, V = x Wq, x Wk, x Wv;
  the sums run over t' <= t when causal. Input ``[..., T, d_model]``, T <= max_len; a shorter
  sequence uses the top-left T x T block of w.
  """

  @nn.compact
  def __call__(self, x, *, decode: bool = False, segment_ids=None, mask=None, positions=None):
    _check_rank(self, x)
    _check_len(self, x.shape[-2])
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
    return self._mix(
      x,
      decode,
      lambda q, k, v: sharding.in_mesh_shards(
        full, (q, k, v, self.bias(t_bias)), names, splits_t=False
      ),
    )

  def _step(self, q, k, v):
    init = lambda q_t, *_: ops.aft_full_init(q_t.shape, self.max_len)
    step = lambda s, *qkv: ops.aft_full_step(s, *qkv, self.bias_row(s.index))
    return _decode_token(self, q, k, v, init, _within_max_len(self, step))


class AFTLocal(_PositionBias):
  """AFT-local (paper Eq. 4): w is learned where |t - t'| < window and 0 (not -inf) elsewhere.

      Y_t = sigma(Q_t) * sum_t' exp(K_t' + w'[t, t']) V_t' / sum_t' exp(K_t' + w'[t, t']),
      w'[t, t'] = w[t, t'] if |t - t'| < window else 0;  Q, K, V = x Wq, x Wk, x Wv.

  Every position still sees the whole sequence; the window only limits where the learned bias
  applies. Input ``[..., T, d_model]`` -> ``[..., T, d_model]``, T <= max_len (a shorter
  sequence uses the top-left T x T block of w). Time O(T window d), no T x T work per channel.

  Attributes:
    max_len: the largest T; w is ``[max_len, max_len]`` (initialised to 0) or, with
      ``factor_dim = d'``, u v^T with u, v ``[max_len, d']`` ~ N(0, 1e-2).
    window: s >= 1.
    causal: sum over t' <= t only; enables ``decode=True`` (O(d) state + the last s keys/values).
    hidden_dim: channels of Q, K, V (default d_model).
    dtype, param_dtype: compute and parameter dtypes.
  """

  window: int = 32

  @nn.compact
  def __call__(self, x, *, decode: bool = False, segment_ids=None, mask=None, positions=None):
    ops.check_window("AFTLocal", self.window)
    _check_rank(self, x)
    _check_len(self, x.shape[-2])
    packed = _packing(self, x, segment_ids, mask, positions)
    names = (_QKV, _QKV, _QKV, ("length", "length_k"))
    if packed:  # packed rows are whole documents: T is not split
      return self._mix(
        x,
        decode,
        lambda q, k, v: self._local(q, k, v, self.bias(self.max_len), axis_name=None, **packed),
      )
    t_len = x.shape[-2]
    if self.factor_dim and self.causal:
      # The op takes w as its factors: a long sequence (in sub-pieces) or a device's shard of
      # T forms only the blocks of w = u v^T it reads, never the [T, T] product.
      names = names[:3] + (("length", "bias_factor"), ("length_k", "bias_factor"))
      local = lambda q, k, v, u, w_v, axis_name: self._local(q, k, v, (u, w_v), axis_name=axis_name)

      def mix(q, k, v):  # (not when decoding: the steps read their own bias rows)
        u, w_v = (jnp.asarray(a[:t_len], jnp.float32) for a in self._bias_params())
        return _op(self, local, (q, k, v, u, w_v), names)

      return self._mix(x, decode, mix)
    return self._mix(
      x, decode, lambda q, k, v: _op(self, self._local, (q, k, v, self.bias(t_len)), names)
    )

  def _local(self, q, k, v, w, *, axis_name, **packed):
    """The op; w ``[T, T]`` or (sharded) its factors (u, v)."""
    local = functools.partial(ops.aft_local, window=self.window, causal=self.causal)
    if axis_name is not None:
      packed["axis_name"] = axis_name
    return local(q, k, v, w, impl=self.impl, **packed)

  chunks = True

  def _step(self, q, k, v):
    # T <= max_len: a window past max_len holds every position, as one of max_len does.
    window = min(self.window, self.max_len)
    init = lambda q_t, *_: ops.aft_local_init(q_t.shape, window)
    step = lambda s, *qkv: ops.aft_local_step(s, *qkv, self.bias_row(s.index))

    # The state's index is the chunk's offset into w; as for the steps, positions past max_len
    # have no bias row: the op gives NaN there (a traced offset cannot raise).
    chunk = lambda s, q, k, v: ops.aft_local(
      q, k, v, self.bias(self.max_len), window=window, causal=True, impl=self.impl,
      initial_state=s, output_final_state=True,
    )  # fmt: skip

    return _decode_token(self, q, k, v, init, _within_max_len(self, step), chunk=chunk)


class AFTSimple(_AFTChannels):
  """AFT-simple (paper Eq. 5): w = 0. Y_t = sigma(Q_t) * sum_t' softmax_t'(K) * V_t'.

  Input ``[..., T, d_model]``, any T. O(T d) time and memory; decoding keeps an O(d) state.
  """

  @nn.compact
  def __call__(self, x, *, decode: bool = False, segment_ids=None, mask=None, positions=None):
    _check_rank(self, x)
    packed = _packing(self, x, segment_ids, mask, positions)
    packed.pop("positions", None)  # no position bias

    def simple(q, k, v, axis_name):
      axis = {} if axis_name is None else {"axis_name": axis_name}
      return ops.aft_simple(q, k, v, causal=self.causal, impl=self.impl, **packed, **axis)

    if packed:  # packed rows are whole documents: T is not split
      return self._mix(x, decode, lambda q, k, v: simple(q, k, v, None))
    return self._mix(x, decode, lambda q, k, v: _op(self, simple, (q, k, v), (_QKV,) * 3))

  chunks = True

  def _step(self, q, k, v):
    init = lambda q_t, *_: ops.aft_simple_init(q_t.shape)
    chunk = lambda s, q, k, v: ops.aft_simple(
      q, k, v, causal=True, impl=self.impl, initial_state=s, output_final_state=True
    )
    return _decode_token(self, q, k, v, init, ops.aft_simple_step, chunk=chunk)


class _ConvKernel(nn.Module):
  """w = gamma (w - mean w) / std w + beta per head; gamma = beta = 0 at init (paper Sec. 3.4)."""

  heads: int
  shape: tuple[int, ...]
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self):
    names = ("heads",) + ("kernel",) * len(self.shape)
    raw = self.param(
      "kernel",
      nn.with_logical_partitioning(nn.initializers.normal(1.0), names),
      (self.heads,) + self.shape,
      self.param_dtype,
    )
    gamma = self.param(
      "gamma",
      nn.with_logical_partitioning(nn.initializers.zeros_init(), ("heads",)),
      (self.heads,),
      self.param_dtype,
    )
    beta = self.param(
      "beta",
      nn.with_logical_partitioning(nn.initializers.zeros_init(), ("heads",)),
      (self.heads,),
      self.param_dtype,
    )
    raw = jnp.asarray(raw, jnp.float32).reshape(self.heads, -1)
    axes = (1,)
    norm = (raw - raw.mean(axes, keepdims=True)) / (raw.std(axes, keepdims=True) + 1e-5)
    w = jnp.asarray(gamma, jnp.float32)[:, None] * norm + jnp.asarray(beta, jnp.float32)[:, None]
    return w.reshape((self.heads,) + self.shape)


class _AFTConvBase(_Projected):
  num_heads: int = 8
  kernel_size: Any = 7
  causal: bool = False
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  impl: str = "auto"  # the op's implementation (aft_jax.ops: "auto", "xla", "pallas", ...)

  def _heads_qkv(self, x):
    feat = _head_features(self, x)
    h = feat[0]
    dense = lambda f, names, n: self._proj(x.shape[-1], f, names, n)
    q = dense(feat, ("embed", "heads", "kv"), "query")(x)
    v = dense(feat, ("embed", "heads", "kv"), "value")(x)
    k = dense(h, ("embed", "heads"), "key")(x)
    return q, k, v

  def _out(self, y, d_model):
    return _heads_out(self, y, d_model)


class AFTConv1D(_AFTConvBase):
  """AFT-conv over sequences (paper Eq. 6, 1-D): per head a learned kernel of ``kernel_size``.

  Input ``[..., T, d_model]``; heads H = num_heads, each with C = d_model / H channels and one
  key. Non-causal kernels are centred (odd size); causal kernel entry j is the bias of t' = t - j.
  At initialisation (gamma = beta = 0) it equals AFT-simple with one key per head.
  """

  chunks = True  # decode=True also takes a prompt chunk (``_decode_token``)

  @nn.compact
  def __call__(self, x, *, decode: bool = False, segment_ids=None, mask=None, positions=None):
    _check_rank(self, x)
    d_model = x.shape[-1]
    if (
      not isinstance(self.kernel_size, int)
      or self.kernel_size < 1
      or (not self.causal and self.kernel_size % 2 == 0)
    ):
      raise ValueError(
        f"AFTConv1D: kernel_size must be a positive int, odd unless causal; got "
        f"{self.kernel_size!r}"
      )
    q, k, v = self._heads_qkv(x)
    kernel = _ConvKernel(self.num_heads, (self.kernel_size,), self.param_dtype, name="bias")()
    if decode:
      _check_decode_input(self, x, self.chunks)
      return self._out(self._step(q, k, v, kernel), d_model)
    packed = _packing(self, x, segment_ids, mask, positions)
    packed.pop("positions", None)  # the kernel is by lag

    def conv(q, k, v, kernel, axis_name):
      axis = {} if axis_name is None else {"axis_name": axis_name}
      return ops.aft_conv1d(q, k, v, kernel, causal=self.causal, impl=self.impl, **packed, **axis)

    if packed:  # packed rows are whole documents: T is not split
      return self._out(conv(q, k, v, kernel, None), d_model)
    names = (_HEADS_QV, _QKV, _HEADS_QV, ("heads", "kernel"))
    return self._out(_op(self, conv, (q, k, v, kernel), names), d_model)

  def _step(self, q, k, v, kernel):
    init = lambda _, k_t, v_t: ops.aft_conv1d_init(k_t.shape, v_t.shape, self.kernel_size)
    step = lambda s, *qkv: ops.aft_conv1d_step(s, *qkv, kernel)
    chunk = lambda s, q, k, v: ops.aft_conv1d(
      q, k, v, kernel, causal=True, impl=self.impl, initial_state=s, output_final_state=True
    )
    return _decode_token(self, q, k, v, init, step, token_axis=-3, chunk=chunk)


class AFTConv2D(_AFTConvBase):
  """AFT-conv over images (paper Eq. 6): per head a learned kh x kw kernel ("SAME").

  Input ``[..., Ht, Wd, d_model]`` -> ``[..., Ht, Wd, d_model]``; ``kernel_size`` an odd int
  or (kh, kw). Not causal. At initialisation it equals AFT-simple over all Ht * Wd positions.
  """

  @nn.compact
  def __call__(self, x):
    d_model = x.shape[-1]
    ks = self.kernel_size
    ks = (ks, ks) if isinstance(ks, int) else tuple(ks)
    if len(ks) != 2 or any(s < 1 or s % 2 == 0 for s in ks):
      raise ValueError(f"AFTConv2D: kernel_size must be odd (kh, kw); got {self.kernel_size!r}")
    if self.causal:
      raise ValueError("AFTConv2D: there is no causal 2-D AFT-conv; use causal=False")
    if x.ndim < 3:
      raise ValueError(f"AFTConv2D: x must be [..., Ht, Wd, d_model]; got x {x.shape}")
    q, k, v = self._heads_qkv(x)
    kernel = _ConvKernel(self.num_heads, ks, self.param_dtype, name="bias")()
    return self._out(ops.aft_conv2d(q, k, v, kernel, impl=self.impl), d_model)


# MultiHeadAttention's implementations (``jax.nn.dot_product_attention``'s): "auto" is jax's
# default choice (XLA in jax 0.10), "cudnn" is cuDNN flash attention (NVIDIA GPUs from Ampere
# on, bfloat16 or float16). Not the default: on older GPUs (a Colab T4) cuDNN's fused kernel
# does not exist, and an automatic choice there would fail rather than fall back.
ATTENTION_IMPLS = ("auto", "xla", "cudnn")


def attention_impl_problem(impl, dtype) -> str | None:
  """Why MultiHeadAttention cannot take ``impl`` with compute ``dtype``, or None."""
  if impl not in ATTENTION_IMPLS:
    return f"softmax attention takes impl {' | '.join(map(repr, ATTENTION_IMPLS))}"
  if impl == "cudnn" and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return f"cuDNN flash attention needs dtype bfloat16 or float16, not {jnp.dtype(dtype).name}"
  return None


class MultiHeadAttention(_Projected):
  """Softmax multi-head attention (the Transformer baseline) with the AFT layers' interface.

  Input ``[..., T, d_model]``; uses ``jax.nn.dot_product_attention`` with ``impl``: "auto"
  (jax's choice), "xla" or "cudnn" (cuDNN flash attention: a GPU, bfloat16 or float16; the
  baseline to compare AFT's speed with on a GPU). Decoding steps always use XLA (one query
  row). ``max_len`` is only needed for decoding (the size of the key/value cache).
  """

  num_heads: int = 8
  causal: bool = False
  max_len: int = 512
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  impl: str = "auto"

  @nn.compact
  def __call__(self, x, *, decode: bool = False, segment_ids=None, mask=None, positions=None):
    """``positions`` is accepted for the AFT layers' interface and unused (no position bias)."""
    _check_rank(self, x)
    d_model = x.shape[-1]
    feat = _head_features(self, x)
    packed = _packing(self, x, segment_ids, mask, positions)
    q, k, v = (
      self._proj(d_model, feat, ("embed", "heads", "kv"), n)(x) for n in ("query", "key", "value")
    )
    lead, t_len = x.shape[:-2], x.shape[-2]
    flat = lambda a: a.reshape((-1,) + a.shape[-3:])
    if decode:
      _check_decode_input(self, x)
      y = self._step(flat(q), flat(k), flat(v))
    else:
      seg_mask = None
      if packed:  # [B', 1, T, T]: t' of t's own segment (the causal part is is_causal's)
        seg_mask = ops.same_segment(packed["segment_ids"]).reshape((-1, 1, t_len, t_len))
      y = jax.nn.dot_product_attention(
        flat(q),
        flat(k),
        flat(v),
        mask=seg_mask,
        is_causal=self.causal,
        implementation=self._implementation(),
      )
    y = y.reshape(lead + (t_len,) + feat)
    return _heads_out(self, y, d_model)

  def _implementation(self) -> str | None:
    """``dot_product_attention``'s implementation for ``impl``; a ValueError where it cannot
    run (never a silent switch to another implementation)."""
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
