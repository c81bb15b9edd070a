"""AFT-full (paper Eq. 2): AFT-local's sums (``local``) with a band of every key; no kernel, no
summary state (decoding: a window of max_len)."""

from aft_jax.ops import common, local
from aft_jax.ops import logsumexp as lse

FN = "aft_full"
KERNELS = ()  # (none: impl="pallas" is refused)


def aft_full(
  q, k, v, w, *, causal=False, impl="auto", initial_state=None, output_final_state=False,
  segment_ids=None, positions=None,
):  # fmt: skip
  """AFT-full: Y[t] = sigma(q[t]) * sum_t' softmax_t'(k[t'] + w[t, t']) v[t'] (causal: t' <= t).

  Args:
    q, k, v: ``[..., T, D]``; w: ``[T, T]``, the pairwise bias.
    causal, impl: as ``aft_simple``.
    initial_state, output_final_state: refused (decode with ``aft_full_step``).
    segment_ids, positions: causal: as ``aft_local``; w ``[L, L]``, L > every position.

  Returns:
    ``[..., T, D]``; O(T^2 D) time, O(T^2 + T D) memory.
  """
  if initial_state is not None or output_final_state:
    raise ValueError(
      f"{FN}: initial_state and output_final_state are for aft_simple, aft_local and "
      "aft_conv1d; AFT-full's past is every key and value (decode with aft_full_step)"
    )
  q, k, v = common.check_qkv(FN, q, k, v)
  mode = common.check_mode(FN, causal, impl, segment_ids=segment_ids, positions=positions)
  if mode == "packed":
    common.check_arrays(FN, q.shape[:-1], segment_ids=segment_ids, positions=positions)
    common.check_arrays(FN, w=w)
  else:
    local.check_bias(FN, w, q.shape[-2])
  return common.eager(
    _run, q=q, k=k, v=v, w=w, segment_ids=segment_ids, positions=positions, causal=bool(causal),
    impl=impl,
  )  # fmt: skip


def _run(q, k, v, w, segment_ids, positions, causal, impl):
  t_len = q.shape[-2]
  if segment_ids is None and positions is None:
    return local._whole(q, k, v, w, t_len, causal, impl, FN, KERNELS)
  return lse.packed(q, k, v, segment_ids, t_len, local.band_bias(w, positions, t_len))


def aft_full_init(shape, max_len: int) -> lse.WindowState:
  """The state before any token, for q_t, k_t, v_t of ``shape`` [..., D] and T <= max_len."""
  return local.aft_local_init(shape, max_len)


def aft_full_step(state: lse.WindowState, q_t, k_t, v_t, w_t):
  """One token t = ``state.index``: q_t, k_t, v_t ``[..., D]``, w_t ``[L]`` (row t of w).
  Returns ``(Y[t], state)``."""
  return local.aft_local_step(state, q_t, k_t, v_t, w_t)
