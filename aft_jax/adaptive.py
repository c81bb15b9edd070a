"""Adaptive input (Baevski & Auli, 2019) and adaptive softmax (Grave et al., 2017): clusters
[0, c_0), ..., [c_{K-1}, V) of the sorted vocabulary, cluster i of width d_model // factor**i.
Replicate (or FSDP-shard) the tables: 'vocab'-sharded, ``nll``'s chunks would be gathers."""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["AdaptiveInput", "AdaptiveSoftmax", "chunked_logsumexp"]

Array = jax.Array


def _dim(d_model: int, factor: float, i: int) -> int:
  return int(d_model // (factor**i))


def _bounds(vocab_size: int, cutoffs: Sequence[int]) -> list[tuple[int, int]]:
  edges = [0, *[int(c) for c in cutoffs], int(vocab_size)]
  return list(zip(edges[:-1], edges[1:]))


def _acc_dtype(dtype) -> Any:
  return jnp.promote_types(dtype, jnp.float32)


def chunked_logsumexp(z: Array, table: Array, chunk_size: int) -> Array:
  """``log sum_r exp(z @ table[r])`` without materialising ``z @ table.T``.

  Args:
    z: ``[N, d]`` queries (any float dtype; the matmul runs in it).
    table: ``[S, d]`` rows to score against.
    chunk_size: rows scored per step; peak memory is O(N * chunk_size).

  Returns:
    ``float32[N]`` (``float64`` for float64 ``z``), chunks recomputed in the backward pass.
  """
  n, _ = z.shape
  acc = _acc_dtype(z.dtype)
  s_rows = table.shape[0]
  c = int(min(chunk_size, s_rows))
  n_chunks = -(-s_rows // c)

  @jax.checkpoint
  def body(carry, i):
    m, s = carry
    lo = i * c
    start = jnp.minimum(lo, s_rows - c)  # last chunk: shift back to stay in bounds
    rows = jax.lax.dynamic_slice_in_dim(table, start, c, axis=0)
    x = jnp.einsum("nd,cd->nc", z, rows.astype(z.dtype), preferred_element_type=acc)
    fresh = (start + jnp.arange(c)) >= lo  # rows not already counted by the previous chunk
    x = jnp.where(fresh[None, :], x, -jnp.inf)
    m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(x, axis=-1)))
    # m = -inf only before the first chunk, where s = 0 and exp(-inf) = 0: no NaN.
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=-1)
    return (m_new, s), None

  init = (jnp.full((n,), -jnp.inf, acc), jnp.zeros((n,), acc))
  (m, s), _ = jax.lax.scan(body, init, jnp.arange(n_chunks))
  return m + jnp.log(s)


def _cluster_params(module, head: str, table: str, proj: str):
  """(tables, projections) of the clusters, each N(0, 1 / its width)."""
  param = lambda name, init, names, shape: module.param(
    name, nn.with_logical_partitioning(init, names), shape, module.param_dtype
  )
  tables, projs = [], [None]
  for i, (lo, hi) in enumerate(_bounds(module.vocab_size, module.cutoffs)):
    d_i = _dim(module.d_model, module.factor, i)
    init = nn.initializers.normal(d_i**-0.5)
    if i == 0:
      tables.append(param(head, init, ("vocab", "embed"), (hi - lo, d_i)))
      continue
    tables.append(param(table.format(i), init, ("vocab", "embed_small"), (hi - lo, d_i)))
    init = nn.initializers.normal(module.d_model**-0.5)
    projs.append(param(proj.format(i), init, ("embed_small", "embed"), (d_i, module.d_model)))
  return tuple(tables), tuple(projs)


class _Clusters(nn.Module):
  vocab_size: int
  d_model: int
  cutoffs: Sequence[int]
  factor: float = 4.0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    vocab_size, d_model, cutoffs, factor = self.vocab_size, self.d_model, self.cutoffs, self.factor
    if int(vocab_size) != vocab_size or vocab_size < 1:
      raise ValueError(f"vocab_size must be a positive int, got vocab_size={vocab_size!r}")
    if int(d_model) != d_model or d_model < 1:
      raise ValueError(f"d_model must be a positive int, got d_model={d_model!r}")
    if not factor >= 1.0:  # also rejects NaN
      raise ValueError(f"factor must be >= 1, got factor={factor!r}")
    cut = list(cutoffs)
    if any(int(c) != c for c in cut):
      raise ValueError(f"cutoffs must be ints, got cutoffs={cut!r}")
    if cut and cut[0] < 1:
      raise ValueError(f"cutoffs must be >= 1 (cluster 0 cannot be empty), got cutoffs={cut!r}")
    if any(b <= a for a, b in zip(cut, cut[1:])):
      raise ValueError(f"cutoffs must be strictly increasing, got cutoffs={cut!r}")
    if cut and cut[-1] >= vocab_size:
      raise ValueError(
        f"every cutoff must be < vocab_size, got cutoffs={cut!r} with vocab_size={vocab_size}"
      )
    for i in range(len(cut) + 1):
      if _dim(d_model, factor, i) < 1:
        raise ValueError(
          f"cluster {i} would have dimension d_model // factor**{i} = "
          f"{d_model} // {factor}**{i} < 1 (d_model={d_model}, factor={factor}, "
          f"cutoffs={cut!r}); use fewer cutoffs, a smaller factor or a larger d_model"
        )
    super().__post_init__()


class AdaptiveInput(_Clusters):
  """Adaptive input embedding: e(w) = E_0[w] in cluster 0, else E_i[w - lo_i] @ P_i; ``ids
  int[...] -> [..., d_model]``, ids outside ``[0, vocab_size)`` zeros, no sqrt(d_model) scale."""

  def setup(self):
    # In setup, so that a tied AdaptiveSoftmax can read them without this module's __call__.
    self._tables, self._projs = _cluster_params(self, "embed_0", "embed_{}", "proj_{}")

  def embedding_tables(self) -> tuple[Array, ...]:
    """Per-cluster tables ``(E_0 [c_0, d_model], E_1 [|c1|, d_1], ...)`` (param dtype)."""
    return self._tables

  def projections(self) -> tuple[Array | None, ...]:
    """Per-cluster projections ``(None, P_1 [d_1, d_model], ...)`` (param dtype)."""
    return self._projs

  def __call__(self, ids: Array) -> Array:
    ids = jnp.asarray(ids)
    out = jnp.zeros((*ids.shape, self.d_model), self.dtype)
    for (lo, hi), table, proj in zip(
      _bounds(self.vocab_size, self.cutoffs), self._tables, self._projs
    ):
      in_cluster = (ids >= lo) & (ids < hi)
      # Static shapes: every cluster gathers every position (clipped), the mask selects.
      rows = jnp.take(table, jnp.clip(ids - lo, 0, hi - lo - 1), axis=0).astype(self.dtype)
      rows = jnp.where(in_cluster[..., None], rows, jnp.zeros((), self.dtype))
      if proj is not None:
        rows = rows @ proj.astype(self.dtype)
      out = out + rows
    return out


class AdaptiveSoftmax(_Clusters):
  """Adaptive softmax::

      head logits   u = [h @ E_0^T ; h @ C^T]                    ([c_0 + K])
      tail k        z_k = h @ P_k^T,  v_k = z_k @ E_k^T           ([|cluster k|])
      log p(w) = u_w - LSE(u)                                    (w in cluster 0)
      log p(w) = u_{c_0+k-1} - LSE(u) + v_k[w - lo_k] - LSE(v_k)  (w in cluster k)

  ``nll``: every LSE over ``chunk_size`` rows at a time, O(tokens * chunk_size) memory.
  ``tie_to``: an ``AdaptiveInput`` of the same settings whose tables and projections it uses;
  ``cluster_logits`` C [K, d_model] ('cluster', 'embed').
  """

  tie_to: AdaptiveInput | None = None
  chunk_size: int = 8192

  def __post_init__(self):
    if int(self.chunk_size) != self.chunk_size or self.chunk_size < 1:
      raise ValueError(f"chunk_size must be a positive int, got chunk_size={self.chunk_size!r}")
    t = self.tie_to
    if t is not None:
      if not isinstance(t, AdaptiveInput):
        raise ValueError(f"tie_to must be an AdaptiveInput or None, got tie_to={type(t)!r}")
      mine = (self.vocab_size, self.d_model, tuple(self.cutoffs), float(self.factor))
      theirs = (t.vocab_size, t.d_model, tuple(t.cutoffs), float(t.factor))
      if mine != theirs:
        raise ValueError(
          "tie_to must match (vocab_size, d_model, cutoffs, factor): "
          f"softmax has {mine}, tie_to has {theirs}"
        )
    super().__post_init__()

  def setup(self):
    n_tail = len(self.cutoffs)
    if n_tail:
      normal = nn.initializers.normal(self.d_model**-0.5)
      init = nn.with_logical_partitioning(normal, ("cluster", "embed"))
      self.cluster_logits = self.param(
        "cluster_logits", init, (n_tail, self.d_model), self.param_dtype
      )
    if self.tie_to is None:
      self._own_tables, self._own_projs = _cluster_params(
        self, "head_embed", "tail_embed_{}", "tail_proj_{}"
      )

  def _weights(self) -> tuple[tuple[Array, ...], tuple[Array | None, ...]]:
    if self.tie_to is not None:
      return self.tie_to.embedding_tables(), self.tie_to.projections()
    return self._own_tables, self._own_projs

  def _logits(self, x: Array, table: Array) -> Array:  # x @ table^T, float32 [N, S]
    table = table.astype(self.dtype)
    return jnp.einsum("nd,sd->ns", x, table, preferred_element_type=_acc_dtype(self.dtype))

  def nll(self, h: Array, targets: Array) -> Array:
    """``-log p(targets | h)``: ``h [..., d_model]``, ``targets int[...]`` -> ``float32[...]``."""
    targets = jnp.asarray(targets)
    if h.shape[-1] != self.d_model or h.shape[:-1] != targets.shape:
      raise ValueError(
        f"expected h [..., {self.d_model}] and targets [...] with matching leading "
        f"shape, got h.shape={h.shape}, targets.shape={targets.shape}"
      )
    tables, projs = self._weights()
    bounds = _bounds(self.vocab_size, self.cutoffs)
    x = h.reshape(-1, self.d_model).astype(self.dtype)
    t = targets.reshape(-1)

    def target_logit(z, table, local):  # the target's row only, never [N, S] logits
      rows = jnp.take(table, local, axis=0).astype(self.dtype)
      return jnp.einsum("nd,nd->n", z, rows, preferred_element_type=_acc_dtype(self.dtype))

    # Head: LSE over [c_0 words ; K cluster logits].
    lo0, hi0 = bounds[0]
    head_lse = chunked_logsumexp(x, tables[0], self.chunk_size)
    in_head = t < hi0
    head_word = target_logit(x, tables[0], jnp.clip(t, 0, hi0 - 1))
    if len(bounds) == 1:
      return (head_lse - head_word).reshape(targets.shape)
    cl = self._logits(x, self.cluster_logits)  # [N, K]: small, materialising it is fine
    head_lse = jnp.logaddexp(head_lse, jax.nn.logsumexp(cl, axis=-1))
    # Which tail cluster (0-based) the target is in; meaningless (masked) for head words.
    k_of_t = jnp.clip(
      jnp.searchsorted(jnp.asarray(self.cutoffs), t, side="right") - 1, 0, len(self.cutoffs) - 1
    )
    head_tail = jnp.take_along_axis(cl, k_of_t[:, None], axis=-1)[:, 0]
    logp = jnp.where(in_head, head_word, head_tail) - head_lse

    # Tails: log p_cluster(w) for the target's own cluster only (others masked to 0).
    for (lo, hi), table, proj in zip(bounds[1:], tables[1:], projs[1:]):
      z = jnp.einsum("nd,sd->ns", x, proj.astype(self.dtype))  # [N, d_k], dtype
      lse = chunked_logsumexp(z, table, self.chunk_size)
      own = target_logit(z, table, jnp.clip(t - lo, 0, hi - lo - 1))
      in_k = (t >= lo) & (t < hi)
      logp = logp + jnp.where(in_k, own - lse, 0.0)
    return (-logp).reshape(targets.shape)

  def log_probs(self, h: Array) -> Array:
    """Full ``log p(. | h)``: ``h [..., d_model] -> float32[..., vocab_size]`` (materialised)."""
    tables, projs = self._weights()
    lead = h.shape[:-1]
    x = h.reshape(-1, self.d_model).astype(self.dtype)
    words = self._logits(x, tables[0])
    if len(tables) == 1:
      return jax.nn.log_softmax(words, axis=-1).reshape(*lead, self.vocab_size)
    head = jax.nn.log_softmax(jnp.concatenate([words, self._logits(x, self.cluster_logits)], -1))
    c0 = tables[0].shape[0]
    parts = [head[:, :c0]]
    for k, (table, proj) in enumerate(zip(tables[1:], projs[1:])):
      z = jnp.einsum("nd,sd->ns", x, proj.astype(self.dtype))
      v = self._logits(z, table)
      parts.append(head[:, c0 + k : c0 + k + 1] + jax.nn.log_softmax(v, axis=-1))
    return jnp.concatenate(parts, axis=-1).reshape(*lead, self.vocab_size)

  def __call__(self, h: Array, targets: Array) -> Array:
    """``nll`` (so that ``init(rng, h, targets)`` creates the params)."""
    return self.nll(h, targets)
