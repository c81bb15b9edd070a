"""A decoder-only language model, its mixing layer chosen by name (``ModelConfig``,
``TransformerLM``). Packed rows and streams: docs/long_sequences.md, docs/training.md."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from aft_jax import adaptive, layers, ops
from aft_jax.typed_config import TypedConfig

MIXINGS = ("aft_full", "aft_local", "aft_simple", "aft_conv1d", "aft_decay", "softmax")
POSITION_EMBEDDINGS = ("learned", "none")  # ModelConfig.position_embedding
# No position embedding needed, a decoding state that does not grow: with 'none', streams.
STREAMING = ("aft_simple", "aft_conv1d", "aft_decay")
STREAM = f"model.position_embedding 'none' with mixing {', '.join(STREAMING)}"  # what streams
# The recurrent mixings: decode=True also takes a chunk of tokens (a prompt) in one pass.
CHUNKED = ("aft_local", "aft_simple", "aft_conv1d", "aft_decay")
INITS = ("gpt2", "glorot")  # ModelConfig.init
GPT2_STD = 0.02  # GPT-2's (and nanoGPT's) standard deviation of every weight at init


def init_std(cfg: ModelConfig, residual: bool = False) -> float:
  """A dense kernel's init std (0.0: Glorot-uniform); ``residual``: into the residual stream."""
  if cfg.init != "gpt2":
    return 0.0
  return GPT2_STD / (2 * cfg.num_layers) ** 0.5 if residual else GPT2_STD


def _kernel_init(cfg: ModelConfig, residual: bool = False):
  std = init_std(cfg, residual)
  return nn.initializers.normal(std) if std else nn.initializers.xavier_uniform()


@dataclasses.dataclass(frozen=True)
class ModelConfig(TypedConfig):
  """``config.model`` (``vocab_size`` from the data); ``problems()``: the run config's check."""

  WHERE = "model"
  OUTSIDE_TREE = ("vocab_size",)
  ADDED = {
    "impl": ("457a2e0", "xla"),
    "init": ("bdcc2f1", "glorot"),
    "use_bias": ("bdcc2f1", True),
    "gelu_approximate": ("bdcc2f1", True),
    "position_embedding": ("1c00082", "learned"),
  }

  vocab_size: int = 0  # from the data (0: not known yet)
  max_len: int = 256  # longest sequence (a stream: no limit, only a prompt chunk's)
  num_layers: int = 2
  d_model: int = 128
  num_heads: int = 4  # softmax attention and AFT-conv heads (AFT-full/local/simple: per channel)
  mlp_dim: int = 512  # hidden units of each block's MLP
  mixing: str = "aft_local"  # one of MIXINGS
  window: int = 32  # AFT-local: w is learned where |t - t'| < window, 0 elsewhere
  kernel_size: int = 7  # AFT-conv1d kernel (causal: entry j is the bias of t - j)
  factor_dim: int = 0  # AFT-full/local bias w = u v^T, u, v [max_len, factor_dim]; 0: full w
  dropout_rate: float = 0.1  # after the embedding, each mixing layer and each MLP
  dtype: Any = "float32"  # compute dtype: 'float32' or 'bfloat16' (GPU/TPU)
  param_dtype: Any = "float32"  # parameters (and optimizer state)
  impl: str = "auto"  # the mixing's implementation: ops.IMPLS, softmax layers.ATTENTION_IMPLS
  remat: bool = False  # rematerialise each block in the backward pass (less memory)
  scan_layers: bool = False  # nn.scan over the blocks: one block compiled, not num_layers
  tie_embeddings: bool = True  # the output layer is the transposed input embedding
  init: str = "gpt2"  # 'gpt2' or 'glorot' (``init_std``); AFT's own biases start as the paper's
  use_bias: bool = True  # biases in the LayerNorms and dense layers (nanoGPT's recipe: none)
  gelu_approximate: bool = True  # the MLP's GELU: the tanh approximation, or exact (erf)
  adaptive_cutoffs: tuple[int, ...] = ()  # adaptive input + softmax cluster cutoffs; (): plain
  adaptive_factor: float = 4.0  # cluster i has dimension d_model / factor**i
  position_embedding: str = "learned"  # [max_len, d_model], or 'none': STREAMING, no length limit

  def __post_init__(self):
    # Dtypes as names, tuples as lists (from files or JSON); another type is problems()'.
    set_ = functools.partial(object.__setattr__, self)
    for name in ("dtype", "param_dtype"):
      try:
        set_(name, jnp.dtype(getattr(self, name)))
      except TypeError:
        raise ValueError(
          f"{self.key(name)} = {getattr(self, name)!r} is not a dtype name"
        ) from None
    if isinstance(self.adaptive_cutoffs, (list, tuple)):
      set_("adaptive_cutoffs", tuple(self.adaptive_cutoffs))

  @classmethod
  def as_written(cls, node) -> dict:
    out = super().as_written(node)
    if out.get("adaptive_cutoffs", ()) is None:  # the first release wrote null for ()
      out["adaptive_cutoffs"] = []
    return out

  @property
  def streams(self) -> bool:
    """No length limit: no position embedding and a mixing of ``STREAMING``."""
    return self.position_embedding == "none" and self.mixing in STREAMING

  @property
  def length_limit(self) -> int | None:
    """The longest sequence the model takes (``max_len``), or None for a stream."""
    return None if self.streams else self.max_len

  def _typed_values(self) -> dict:
    values = super()._typed_values()
    values.update(dtype=self.dtype.name, param_dtype=self.param_dtype.name)  # as in the tree
    return values

  def _value_problems(self) -> list[str]:
    errors = []
    if self.mixing not in MIXINGS:
      errors.append(f"{self.key('mixing')} = {self.mixing!r} is not one of {', '.join(MIXINGS)}")
    if self.vocab_size < 0:
      errors.append(f"{self.key('vocab_size')} = {self.vocab_size} must be >= 0 (0: from the data)")
    for name in ("max_len", "num_layers", "d_model", "num_heads", "mlp_dim"):
      if getattr(self, name) < 1:
        errors.append(f"{self.key(name)} = {getattr(self, name)!r} must be a positive int")
    if errors:
      return errors  # the checks below assume positive ints
    if self.mixing in ("softmax", "aft_conv1d") and self.d_model % self.num_heads:
      errors.append(
        f"{self.key('d_model')} = {self.d_model} is not divisible by "
        f"{self.key('num_heads')} = {self.num_heads}"
      )
    for name, mixing in (("window", "aft_local"), ("kernel_size", "aft_conv1d")):
      if self.mixing == mixing and not 1 <= getattr(self, name) <= self.max_len:
        limit = f"[1, {self.key('max_len')} = {self.max_len}]"
        errors.append(f"{self.key(name)} = {getattr(self, name)} must be in {limit}")
    if self.mixing == "softmax":
      problem = layers.attention_impl_problem(self.impl, self.dtype)
      if problem:
        errors.append(f"{self.key('impl')} = {self.impl!r}: {problem}")
    elif self.impl not in ops.IMPLS:
      errors.append(
        f"{self.key('impl')} = {self.impl!r} is not one of {ops.IMPLS} for {self.mixing}"
      )
    errors += self._position_problems()
    if self.init not in INITS:
      errors.append(f"{self.key('init')} = {self.init!r} is not one of {', '.join(INITS)}")
    if self.factor_dim < 0:
      errors.append(f"{self.key('factor_dim')} = {self.factor_dim} must be >= 0 (0: a full bias)")
    if not 0.0 <= self.dropout_rate < 1.0:
      errors.append(f"{self.key('dropout_rate')} = {self.dropout_rate} must be in [0, 1)")
    for name in ("dtype", "param_dtype"):
      value = getattr(self, name)
      if value not in (jnp.float32, jnp.bfloat16):
        errors.append(f"{self.key(name)} = {value.name!r}: use 'float32' or 'bfloat16'")
    return errors

  def _position_problems(self) -> list[str]:
    key = self.key("position_embedding")
    if self.position_embedding not in POSITION_EMBEDDINGS:
      return [f"{key} = {self.position_embedding!r} is not one of {', '.join(POSITION_EMBEDDINGS)}"]
    if self.position_embedding == "learned" or self.mixing not in MIXINGS or self.streams:
      return []
    why = "its bias w[t, t'] is by absolute position"
    if self.mixing == "softmax":
      why = "its keys and queries carry no order but the causal mask's, and its decoding cache "
      why += "grows with the text"
    return [
      f"{key} = 'none' is for {' and '.join(STREAMING)} (their causal sums give the order), "
      f"not {self.key('mixing')} = {self.mixing!r}: {why}"
    ]


def check_ids(name: str, ids, vocab_size: int) -> None:
  """A ValueError naming the first id outside [0, ``vocab_size``); traced ids pass (NaN)."""
  if isinstance(ids, jax.core.Tracer) or not np.size(ids):
    return
  ids = np.asarray(ids)
  if ids.min() < 0 or ids.max() >= vocab_size:
    bad = ids[(ids < 0) | (ids >= vocab_size)].flat[0]
    raise ValueError(f"{name}: the id {bad} is outside the vocabulary [0, {vocab_size})")


def mixing_layer(cfg: ModelConfig, name: str = "mix") -> nn.Module:
  """The causal mixing layer named by ``cfg.mixing`` (one of MIXINGS: ``cfg.problems()``)."""
  kw = dict(causal=True, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name, impl=cfg.impl)
  kw.update(init_std=init_std(cfg), out_init_std=init_std(cfg, residual=True))
  kw.update(use_bias=cfg.use_bias)
  bias = dict(max_len=cfg.max_len, factor_dim=cfg.factor_dim or None)
  layer, own = {
    "aft_full": (layers.AFTFull, bias),
    "aft_local": (layers.AFTLocal, dict(window=cfg.window, **bias)),
    "aft_simple": (layers.AFTSimple, {}),
    "aft_conv1d": (layers.AFTConv1D, dict(num_heads=cfg.num_heads, kernel_size=cfg.kernel_size)),
    "aft_decay": (layers.AFTDecay, {}),
    "softmax": (layers.MultiHeadAttention, dict(num_heads=cfg.num_heads, max_len=cfg.max_len)),
  }[cfg.mixing]
  return layer(**own, **kw)


def gelu_exact(x):
  """torch's ``nn.GELU()``: ``nn.gelu(x, approximate=False)`` without its erfc (dear on CPU)."""
  return x * (0.5 + 0.5 * jax.lax.erf(x * jnp.asarray(2**-0.5, x.dtype)))


def _ln(cfg, name):
  embed = lambda init: nn.with_logical_partitioning(init, ("embed",))
  return nn.LayerNorm(
    dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name, use_bias=cfg.use_bias,
    scale_init=embed(nn.initializers.ones), bias_init=embed(nn.initializers.zeros),
  )  # fmt: skip


class Block(nn.Module):
  """One pre-LayerNorm block: x + mix(LN(x)), then x + MLP(LN(x)). ``[B, T, D] -> [B, T, D]``."""

  cfg: ModelConfig
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x_BTD, packed=None):  # under nn.scan: (carry, broadcast) -> (carry, None)
    cfg = self.cfg
    drop = nn.Dropout(cfg.dropout_rate, deterministic=self.deterministic)
    h = mixing_layer(cfg)(_ln(cfg, "ln_mix")(x_BTD), decode=self.decode, **(packed or {}))
    x_BTD = x_BTD + drop(h)
    dense = lambda f, names, name: nn.Dense(
      f, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name, use_bias=cfg.use_bias,
      kernel_init=nn.with_logical_partitioning(_kernel_init(cfg, name == "mlp_out"), names),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[1:]),
    )  # fmt: skip

    def mlp(x_ND):
      h = dense(cfg.mlp_dim, ("embed", "mlp"), "mlp_in")(x_ND)
      h = nn.gelu(h, approximate=True) if cfg.gelu_approximate else gelu_exact(h)
      return dense(cfg.d_model, ("mlp", "embed"), "mlp_out")(drop(h))

    x_BTD = x_BTD + drop(layers.over_rows(mlp, _ln(cfg, "ln_mlp")(x_BTD)))
    x_BTD = nn.with_logical_constraint(x_BTD, ("batch", "activation_length", "embed"))
    return (x_BTD, None) if self.cfg.scan_layers else x_BTD


class TransformerLM(nn.Module):
  """Decoder-only LM. ``tokens_BT`` int ``[B, T]``, T <= max_len unless the model is a stream
  (``ModelConfig.streams``: any T); decode: T = 1, or a chunk for the ``CHUNKED`` mixings."""

  cfg: ModelConfig

  def _embeddings(self):  # (embed(tokens), head(h, targets) -> nll or log-probs)
    cfg = self.cfg
    dtypes = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    if cfg.adaptive_cutoffs:
      kw = dict(cutoffs=cfg.adaptive_cutoffs, factor=cfg.adaptive_factor, **dtypes)
      kw.update(vocab_size=cfg.vocab_size, d_model=cfg.d_model)
      inp = adaptive.AdaptiveInput(**kw, name="adaptive_input")
      tie_to = inp if cfg.tie_embeddings else None
      out = adaptive.AdaptiveSoftmax(**kw, tie_to=tie_to, name="adaptive_softmax")

      def head(h_BTD, targets_BT):
        return out.log_probs(h_BTD) if targets_BT is None else out.nll(h_BTD, targets_BT)

      return inp, head
    normal = nn.initializers.normal(stddev=init_std(cfg) or 1.0)
    init = nn.with_logical_partitioning(normal, ("vocab", "embed"))
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, **dtypes, name="embed", embedding_init=init)
    # Tied, 'glorot': the N(0, 1) embedding scaled so that initial logits are O(1).
    scale = 1.0 if cfg.init == "gpt2" else 1.0 / cfg.d_model**0.5
    tied = lambda h_BTD: embed.attend(h_BTD) * jnp.asarray(scale, h_BTD.dtype)
    unembed = tied
    if not cfg.tie_embeddings:
      init = nn.with_logical_partitioning(_kernel_init(cfg), ("embed", "vocab"))
      unembed = nn.Dense(cfg.vocab_size, use_bias=False, **dtypes, name="unembed", kernel_init=init)

    def head(h_BTD, targets_BT):
      logits_BTV = layers.over_rows(unembed, h_BTD).astype(jnp.float32)
      if targets_BT is None:
        return jax.nn.log_softmax(logits_BTV, axis=-1)
      return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)

    return embed, head

  def _blocks(self, x_BTD, deterministic, decode, packed):
    cfg = self.cfg
    block = nn.remat(Block, prevent_cse=not cfg.scan_layers) if cfg.remat else Block
    if cfg.scan_layers:
      stack = nn.scan(
        block,
        variable_axes={"params": 0, "cache": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=nn.broadcast,
        length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x_BTD, _ = stack(cfg, deterministic, decode, name="blocks")(x_BTD, packed)
      return x_BTD
    for i in range(cfg.num_layers):
      x_BTD = block(cfg, deterministic, decode, name=f"block_{i}")(x_BTD, packed)
    return x_BTD

  def _packed(self, tokens_BT, segment_ids_BT, positions_BT, decode):
    """None, or {"segment_ids", "positions"} int32 ``[B, T]``, checked (before any op reads)."""
    if segment_ids_BT is None and positions_BT is None:
      return None
    if decode:
      raise ValueError(
        "TransformerLM: segment_ids / positions (packed rows) are for training and scoring, "
        "not decode=True (a decoded sequence is one document)"
      )
    for name, x in (("segment_ids", segment_ids_BT), ("positions", positions_BT)):
      if x is not None and (
        jnp.shape(x) != tokens_BT.shape or not jnp.issubdtype(jnp.result_type(x), jnp.integer)
      ):
        raise ValueError(
          f"TransformerLM: {name} must be int [B, T] = {tokens_BT.shape} like tokens; got "
          f"{jnp.result_type(x).name} {jnp.shape(x)}"
        )
    seg, pos = ops.segment_positions(segment_ids_BT, None, tokens_BT.shape)
    seg = None if segment_ids_BT is None else jnp.asarray(seg, jnp.int32)
    pos = pos if positions_BT is None else positions_BT
    return {"segment_ids": seg, "positions": jnp.asarray(pos, jnp.int32)}

  def _position_embedding(self, t_len: int, start, packed):
    """Rows start .. start + T - 1 (decoding), the positions' (packed rows), or 0 .. T - 1."""
    cfg = self.cfg
    init = nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), ("length", "embed"))
    pos_embed = self.param("pos_embed", init, (cfg.max_len, cfg.d_model), cfg.param_dtype)
    if start is not None:
      pos_TD = jax.lax.dynamic_slice_in_dim(pos_embed, start, t_len, 0)
    elif packed is not None:
      pos_BT = packed["positions"]
      got = jnp.asarray(pos_embed).at[pos_BT].get(mode="fill", fill_value=jnp.nan)
      # A negative index would count from the end (NumPy's rule), not fall outside the table.
      pos_TD = jnp.where((pos_BT >= 0)[..., None], got, jnp.nan)
    else:
      pos_TD = pos_embed[:t_len]
    return jnp.asarray(pos_TD, cfg.dtype)

  @nn.compact
  def __call__(
    self, tokens_BT, targets_BT=None, *, segment_ids=None, positions=None, train=False, decode=False
  ):
    """Per-token NLL ``[B, T]`` (float32) given targets, else log-probabilities ``[B, T, V]``.

    ``segment_ids``, ``positions`` int ``[B, T]``: packed rows (positions default to each
    document's from 0; past max_len: NaN). ``train``: dropout. ``decode``: one step on tokens
    ``[B, 1]`` (or a ``CHUNKED`` prompt chunk) with a "cache" collection.
    """
    cfg = self.cfg
    t_len = tokens_BT.shape[-1]
    # The model's own tables (the position embedding, softmax's cache) would clamp past max_len.
    if cfg.length_limit is not None and t_len > cfg.length_limit:
      raise ValueError(
        f"TransformerLM: tokens {tokens_BT.shape} are longer than max_len = {cfg.max_len}"
      )
    if targets_BT is not None and targets_BT.shape != tokens_BT.shape:
      raise ValueError(
        f"TransformerLM: targets {targets_BT.shape} must match tokens {tokens_BT.shape}"
      )
    for name, ids in (("tokens", tokens_BT), ("targets", targets_BT)):
      if ids is not None:  # (a ValueError where concrete; NaN below, under jit)
        check_ids(f"TransformerLM: {name}", ids, cfg.vocab_size)
    packed = self._packed(tokens_BT, segment_ids, positions, decode)
    start = None
    if decode:
      if t_len != 1 and cfg.mixing not in CHUNKED:
        raise ValueError(
          f"TransformerLM: decode=True takes tokens [B, 1] (a prompt chunk [B, T] only with "
          f"config.model.mixing in {CHUNKED}), got {tokens_BT.shape} for {cfg.mixing!r}"
        )
      # The tokens seen so far (int32): the position of the chunk's first token.
      ready = self.has_variable("cache", "pos")
      pos = self.variable("cache", "pos", jnp.zeros, (), jnp.int32)
      start = pos.value
      if ready:
        pos.value = start + t_len
    embed, head = self._embeddings()
    in_vocab = lambda ids: (ids >= 0) & (ids < cfg.vocab_size)  # else NaN, not a wrapped id
    x_BTD = jnp.where(in_vocab(tokens_BT)[..., None], embed(tokens_BT), jnp.nan)
    if cfg.position_embedding == "learned":
      x_BTD = x_BTD + self._position_embedding(t_len, start, packed)
    x_BTD = nn.Dropout(cfg.dropout_rate, deterministic=not train)(x_BTD)
    x_BTD = self._blocks(x_BTD, not train, decode, packed)
    out = head(_ln(cfg, "ln_final")(x_BTD), targets_BT)
    return out if targets_BT is None else jnp.where(in_vocab(targets_BT), out, jnp.nan)


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
