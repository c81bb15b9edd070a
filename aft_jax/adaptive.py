"""Adaptive input embeddings and adaptive softmax for large-vocabulary word-level LMs.

* ``AdaptiveInput``: Baevski & Auli (2019), "Adaptive Input Representations for
  Neural Language Modeling".
* ``AdaptiveSoftmax``: Grave et al. (2017), "Efficient softmax approximation for GPUs".

Both split the (frequency-sorted) vocabulary into clusters with ``cutoffs``
``[c_0, ..., c_{K-1}]``::

    cluster 0 = [0, c_0), cluster 1 = [c_0, c_1), ..., cluster K = [c_{K-1}, V)

Cluster ``i`` has capacity ``d_i = d_model // factor**i`` (``d_0 = d_model``), so rare
words get small embeddings.  ``cutoffs=[]`` gives one cluster, i.e. a plain embedding /
plain full softmax.  (WikiText-103: V = 267,735, cutoffs [20000, 40000, 200000].)

Parameters, shapes and logical axis names (``nn.with_logical_partitioning``)::

    AdaptiveInput   embed_0               [c_0, d_model]      ('vocab', 'embed')
                    embed_i      (i >= 1) [|cluster i|, d_i]  ('vocab', 'embed_small')
                    proj_i       (i >= 1) [d_i, d_model]      ('embed_small', 'embed')
    AdaptiveSoftmax cluster_logits        [K, d_model]        ('cluster', 'embed')
                    head_embed   (untied) [c_0, d_model]      ('vocab', 'embed')
                    tail_embed_i (untied) [|cluster i|, d_i]  ('vocab', 'embed_small')
                    tail_proj_i  (untied) [d_i, d_model]      ('embed_small', 'embed')

``embed_small`` is a separate name from ``embed`` because d_i differs per cluster and is
usually too small to be worth sharding; map it to ``None`` unless you know better.
Cluster 0 has no projection (its dimension already is d_model).  K = len(cutoffs).

Sharding note: ``nll`` walks each table in ``dynamic_slice`` chunks, so mapping
``'vocab'`` to a mesh axis makes XLA gather the rows of each chunk; prefer replicating
(or FSDP-sharding) these tables.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["AdaptiveInput", "AdaptiveSoftmax", "chunked_logsumexp"]

Array = jax.Array


# --------------------------------------------------------------------------- helpers


def _validate(vocab_size: int, d_model: int, cutoffs: Sequence[int], factor: float) -> None:
  """Raise ``ValueError`` naming the offending argument (called before any tracing)."""
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


def _dim(d_model: int, factor: float, i: int) -> int:
  return int(d_model // (factor**i))


def _bounds(vocab_size: int, cutoffs: Sequence[int]) -> list[tuple[int, int]]:
  """Half-open ``[lo, hi)`` word-id range of every cluster."""
  edges = [0, *[int(c) for c in cutoffs], int(vocab_size)]
  return list(zip(edges[:-1], edges[1:]))


def _acc_dtype(dtype) -> Any:
  """Accumulation dtype: at least float32 (bf16 -> f32), float64 stays float64."""
  return jnp.promote_types(dtype, jnp.float32)


def _partitioned(init, names):
  return nn.with_logical_partitioning(init, names)


def chunked_logsumexp(z: Array, table: Array, chunk_size: int) -> Array:
  """``log sum_r exp(z @ table[r])`` without materialising ``z @ table.T``.

  Args:
    z: ``[N, d]`` queries (any float dtype; the matmul runs in it).
    table: ``[S, d]`` rows to score against.
    chunk_size: rows scored per step; peak memory is O(N * chunk_size).

  Returns:
    ``float32[N]`` (``float64[N]`` if ``z`` is float64).

  A ``lax.scan`` over ``ceil(S / C)`` chunks keeps the online (max-subtracted) pair
  ``(m, s)`` with ``lse = m + log s``::

      m' = max(m, max_r x_r),   s' = s * exp(m - m') + sum_r exp(x_r - m')

  accumulated in at least float32.  Chunks are ``dynamic_slice``s of the unpadded table; the last
  one is shifted back to end at row S (slices must stay in bounds) and the rows it shares
  with the previous chunk are masked to -inf so every row is counted exactly once.  ``m``
  is a ``stop_gradient``: lse does not depend on it, so d lse / d x = softmax(x) exactly,
  and no gradient flows through ``max``.  The body is ``jax.checkpoint``-ed so the
  backward pass recomputes each chunk's logits instead of saving all of them (which
  would be [N, S] again).
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


# --------------------------------------------------------------------------- modules


def _cluster_params(module, head: str, table: str, proj: str):
  """(tables, projections) of an adaptive input or softmax, created as ``module``'s params.

  Cluster 0: a ``[c_0, d_model]`` table named ``head`` and no projection; cluster i > 0: a
  ``[|c_i|, d_i]`` table ``table.format(i)`` and a ``[d_i, d_model]`` projection
  ``proj.format(i)``. Each is N(0, 1 / its width) so every embedding has about unit norm.
  """
  tables, projs = [], []
  for i, (lo, hi) in enumerate(_bounds(module.vocab_size, module.cutoffs)):
    d_i = _dim(module.d_model, module.factor, i)
    init = nn.initializers.normal(d_i**-0.5)
    axes = ("vocab", "embed" if i == 0 else "embed_small")
    name = head if i == 0 else table.format(i)
    tables.append(module.param(name, _partitioned(init, axes), (hi - lo, d_i), module.param_dtype))
    if i == 0:
      projs.append(None)
    else:
      init = nn.initializers.normal(module.d_model**-0.5)
      projs.append(
        module.param(
          proj.format(i),
          _partitioned(init, ("embed_small", "embed")),
          (d_i, module.d_model),
          module.param_dtype,
        )
      )
  return tuple(tables), tuple(projs)


class _Clusters(nn.Module):
  """The settings an adaptive input and an adaptive softmax share, checked before tracing."""

  vocab_size: int
  d_model: int
  cutoffs: Sequence[int]
  factor: float = 4.0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    _validate(self.vocab_size, self.d_model, self.cutoffs, self.factor)
    super().__post_init__()


class AdaptiveInput(_Clusters):
  """Adaptive input embedding (Baevski & Auli, 2019).

  For a word ``w`` in cluster ``i`` with local index ``j = w - lo_i``::

      e(w) = E_0[w]              (i = 0,  E_0: [c_0, d_model])
      e(w) = E_i[j] @ P_i        (i >= 1, E_i: [|cluster i|, d_i], P_i: [d_i, d_model])

  with ``d_i = d_model // factor**i``.  ``__call__(ids: int[...]) -> dtype[..., d_model]``.
  Ids outside ``[0, vocab_size)`` embed to zeros.  No ``sqrt(d_model)`` scaling is
  applied; that is the caller's choice.

  Init: ``E_0 ~ N(0, 1/d_model)``, ``E_i ~ N(0, 1/d_i)``, ``P_i ~ N(0, 1/d_model)``, so
  every cluster's output has per-coordinate variance ``1/d_model``.

  For weight tying, ``embedding_tables()`` and ``projections()`` return the raw
  parameters (see ``AdaptiveSoftmax.tie_to``).
  """

  def setup(self):
    # Params live in setup (not compact) so that a tied AdaptiveSoftmax can call
    # embedding_tables()/projections() before or without this module's __call__.
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
      # Static shapes: every cluster gathers for every position (clipped index) and
      # the mask selects; the wasted work is only d_i-sized per position.
      rows = jnp.take(table, jnp.clip(ids - lo, 0, hi - lo - 1), axis=0).astype(self.dtype)
      rows = jnp.where(in_cluster[..., None], rows, jnp.zeros((), self.dtype))
      if proj is not None:
        rows = rows @ proj.astype(self.dtype)
      out = out + rows
    return out


class AdaptiveSoftmax(_Clusters):
  """Adaptive softmax (Grave et al., 2017), with streaming normalisers.

  The head scores the ``c_0`` frequent words plus one logit per tail cluster
  ``k = 1..K``; tail cluster ``k`` projects ``h`` to ``d_k = d_model // factor**k`` and
  scores its own words::

      head logits   u = [h @ E_0^T ; h @ C^T]                    ([c_0 + K])
      tail k        z_k = h @ P_k^T,  v_k = z_k @ E_k^T           ([|cluster k|])
      log p(w) = u_w - LSE(u)                                    (w in cluster 0)
      log p(w) = u_{c_0+k-1} - LSE(u) + v_k[w - lo_k] - LSE(v_k)  (w in cluster k)

  ``nll(h: [..., d_model], targets: int[...]) -> float32[...]`` returns ``-log p(target)``.
  It never builds a ``[tokens, cluster_size]`` array: every LSE is streamed over
  ``chunk_size``-row chunks (``chunked_logsumexp``) and only the target's own logit is
  gathered (a dot product with its row), so memory is O(tokens * chunk_size), in the
  backward pass too.  Because shapes are static, each tail normaliser is computed for
  all positions (not only those whose target is in that cluster); the FLOP saving over a
  full softmax comes from the small d_k.  Normalisers accumulate in float32 whatever
  ``dtype`` is (float64 if ``dtype`` is float64); matmuls run in ``dtype`` with
  float32 results.

  ``log_probs(h) -> float32[..., vocab_size]`` materialises the full normalised
  distribution (sampling / evaluation on small batches only).

  ``tie_to``: an ``AdaptiveInput`` with the same vocab_size/d_model/cutoffs/factor
  (defined alongside this module in a parent, e.g. both in ``setup``).  Then E_0, E_k and
  P_k are that module's ``embed_*``/``proj_*`` params, and this module only owns
  ``cluster_logits`` (C, ``[K, d_model]``).  Untied init matches ``AdaptiveInput``'s;
  ``C ~ N(0, 1/d_model)``.  Targets outside ``[0, vocab_size)`` give meaningless values.
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
      self.cluster_logits = self.param(
        "cluster_logits",
        _partitioned(nn.initializers.normal(self.d_model**-0.5), ("cluster", "embed")),
        (n_tail, self.d_model),
        self.param_dtype,
      )
    if self.tie_to is None:
      self._own_tables, self._own_projs = _cluster_params(
        self, "head_embed", "tail_embed_{}", "tail_proj_{}"
      )

  def _weights(self) -> tuple[tuple[Array, ...], tuple[Array | None, ...]]:
    if self.tie_to is not None:
      return self.tie_to.embedding_tables(), self.tie_to.projections()
    return self._own_tables, self._own_projs

  def _head_cluster_logits(self, h: Array) -> Array:
    """``h @ C^T`` as float32 ``[N, K]`` (K = number of tail clusters)."""
    return jnp.einsum(
      "nd,kd->nk",
      h,
      self.cluster_logits.astype(self.dtype),
      preferred_element_type=_acc_dtype(self.dtype),
    )

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

    def target_logit(z, table, local):
      # Gather only the target's row: a [N, d] gather, never [N, S] logits.
      rows = jnp.take(table, local, axis=0).astype(self.dtype)
      return jnp.einsum("nd,nd->n", z, rows, preferred_element_type=_acc_dtype(self.dtype))

    # Head: LSE over [c_0 words ; K cluster logits].
    lo0, hi0 = bounds[0]
    head_lse = chunked_logsumexp(x, tables[0], self.chunk_size)
    in_head = t < hi0
    head_word = target_logit(x, tables[0], jnp.clip(t, 0, hi0 - 1))
    if len(bounds) == 1:
      return (head_lse - head_word).reshape(targets.shape)
    cl = self._head_cluster_logits(x)  # [N, K]: small, materialising it is fine
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
    """Full ``log p(. | h)``: ``h [..., d_model]`` -> ``float32[..., vocab_size]``.

    Materialises ``[tokens, vocab_size]``; use ``nll`` for training.
    """
    tables, projs = self._weights()
    lead = h.shape[:-1]
    x = h.reshape(-1, self.d_model).astype(self.dtype)
    words = jnp.einsum(
      "nd,vd->nv", x, tables[0].astype(self.dtype), preferred_element_type=_acc_dtype(self.dtype)
    )
    if len(tables) == 1:
      return jax.nn.log_softmax(words, axis=-1).reshape(*lead, self.vocab_size)
    head = jax.nn.log_softmax(
      jnp.concatenate([words, self._head_cluster_logits(x)], axis=-1), axis=-1
    )
    c0 = tables[0].shape[0]
    parts = [head[:, :c0]]
    for k, (table, proj) in enumerate(zip(tables[1:], projs[1:])):
      z = jnp.einsum("nd,sd->ns", x, proj.astype(self.dtype))
      v = jnp.einsum(
        "ns,vs->nv", z, table.astype(self.dtype), preferred_element_type=_acc_dtype(self.dtype)
      )
      parts.append(head[:, c0 + k : c0 + k + 1] + jax.nn.log_softmax(v, axis=-1))
    return jnp.concatenate(parts, axis=-1).reshape(*lead, self.vocab_size)

  def __call__(self, h: Array, targets: Array) -> Array:
    """Alias of ``nll`` (so ``init(rng, h, targets)`` creates the params)."""
    return self.nll(h, targets)
