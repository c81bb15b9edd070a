"""The AFT operations (Zhai et al., 2021, arXiv 2105.14103) as pure jax.numpy functions.

Notation: ``q, k, v`` are ``[..., T, D]`` (any leading batch dims); ``sigma`` is the sigmoid.
Every op computes, for each position ``t`` and channel ``d``,

    Y[t, d] = sigma(q[t, d]) * sum_t' exp(k[t', d] + w[t, t']) v[t', d]
                              / sum_t' exp(k[t', d] + w[t, t'])

and the variants differ only in the position bias ``w`` and in which ``t'`` are summed
(``causal=True``: ``t' <= t``).

Numerical stability. ``exp`` overflows float32 above ~88, and a single shift per row of ``w``
and per channel of ``k`` is not enough (the largest ``w`` and ``k`` sit at different ``t'``), so
every sum is an exact log-sum-exp: partial sums are ``(m, num, den)`` triples (``logsumexp``),
prefix sums carry the running maximum. Results are finite and accurate in float32 for finite
logits k + w of any size (tested to |k + w| ~ 1e35). Precision policy: exponentials, maxima
and sums are float32; float32 inputs multiply at ``Precision.HIGHEST``; bfloat16 inputs take
bfloat16 factors (shifted exponentials, values) with float32 accumulation, the accelerators'
tensor-core rate, and give bfloat16 outputs, within about 1e-2 of the largest output or
gradient of float64 at logits of std 1 and 40 (docs/kernels.md, "Precision"). The maxima never
carry a gradient (they cancel in num / den): the backward pass is linear scans and products.

Where the work happens. AFT-local and AFT-full: ``banded`` (query blocks against the keys they
can see, as products of exp(w - row max) and exp(k - channel max) v, plus running sums of the
bias-0 keys outside the window; O(T s D), no T x T array when s << T). Causal AFT-simple:
``causal_mean`` (chunks with a triangular product each; about a ``cumsum``'s speed). Both have
a hand-written JVP whose only [T, D] residuals are the output mean and its log-normalizer.
AFT-conv: ``conv`` (prefix scans and shifted sums of triples, plain autodiff). Non-causal
AFT-simple has w = 0: it is ``jax.nn.softmax`` over T.

Implementations. Every op takes ``impl``: ``"xla"`` (the code above), ``"pallas"`` (the op's
kernel compiled for the accelerator: ``pallas_simple``, ``pallas_local`` on GPU,
``pallas_simple_tpu`` on TPU), ``"pallas_interpret"`` (the GPU kernel in Pallas' interpreter,
for tests) or ``"auto"`` (a kernel where one exists for the op, the device being lowered for and
the channel count; XLA otherwise). One table and one choice, ``registry`` (whose docstring has
the rules); the choice changes results only by float rounding, and a kernel asked for that
cannot run is a ValueError, never a silent switch to XLA.

Inputs are checked once, before anything is traced (``arguments``); an empty input (T, D or a
batch dim 0) gives the empty output. Causal ops: an output never depends on a later position,
not even on a NaN or an infinity there: earlier outputs are bit-identical whatever follows.

Modes, each in its own module behind these functions (``arguments.normalise`` picks one):
a whole sequence (``plain``); a piece of one (``pieces``: ``initial_state=`` /
``output_final_state=``, flash-linear-attention's names, on the causal ops but AFT-full, and
AFT-local's ``offset=``, the piece's position in w, taken from the state by default); packed
documents (``segments``: ``segment_ids=``, and ``positions=`` for AFT-local and AFT-full); T
sharded over a mesh axis inside ``jax.shard_map`` (``sharded``: ``axis_name=``). A non-causal
op given these is a ValueError. The states (``state``) are those of the one-token decoding
steps (``step``: ``aft_simple_step``, ``aft_full_step``, ``aft_local_step``,
``aft_conv1d_step`` and their ``*_init`` states).
"""

from __future__ import annotations

import functools

import jax

from aft_jax.ops import pieces, plain, segments, sharded, target
from aft_jax.ops.arguments import Call, check_window, normalise
from aft_jax.ops.logsumexp import Acc
from aft_jax.ops.registry import IMPLS, check_impl
from aft_jax.ops.state import FullState, WindowState
from aft_jax.ops.step import (
  aft_conv1d_init,
  aft_conv1d_step,
  aft_full_init,
  aft_full_step,
  aft_local_init,
  aft_local_step,
  aft_simple_init,
  aft_simple_step,
)

__all__ = [
  "IMPLS",
  "Acc",
  "FullState",
  "WindowState",
  "aft_full",
  "aft_simple",
  "aft_local",
  "aft_conv1d",
  "aft_conv2d",
  "aft_conv1d_init",
  "aft_conv1d_step",
  "aft_full_init",
  "aft_full_step",
  "aft_local_init",
  "aft_local_step",
  "aft_simple_init",
  "aft_simple_step",
  "check_impl",
  "check_window",
]

_MODES = {"plain": plain.run, "state": pieces.run, "packed": segments.run, "sharded": sharded.run}


# The fields of a Call that choose the program rather than carry data: static under jit.
_STATIC = ("fn", "mode", "causal", "impl", "size", "output_final_state", "axis_name")


def _run(fn: str, *arrays, **kwargs):
  """Op ``fn`` on its arguments: checked once (``arguments.normalise``), then run by its mode.

  Called on concrete arrays (eagerly), the mode runs as one jitted program: one compile per
  shape instead of one per primitive it executes. Inside a trace (jit, grad, vmap, shard_map)
  it runs as it is, so the implementation is chosen on the caller's tracers (a forward-mode
  derivative takes XLA: ``registry.resolve``). What ``impl="auto"`` decides from
  (``target.current()``) is part of the program's key, so no device reuses another's."""
  call = normalise(fn, *arrays, **kwargs)
  static = {name: getattr(call, name) for name in _STATIC}
  if call.offset is None or isinstance(call.offset, int):  # a traced offset is data
    static["offset"] = call.offset
  data = {name: x for name, x in call._asdict().items() if name not in static}
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(data)):
    return _MODES[call.mode](call)
  return _program(data, tuple(static.items()), target.current())


@functools.partial(jax.jit, static_argnums=(1, 2))
def _program(data, static, _target):
  call = Call(**data, **dict(static))
  return _MODES[call.mode](call)


def aft_full(
  q,
  k,
  v,
  w,
  *,
  causal: bool = False,
  impl: str = "auto",
  initial_state=None,
  output_final_state: bool = False,
  segment_ids=None,
  positions=None,
):
  """AFT-full (paper Eq. 2).

  Y[t] = sigma(q[t]) * sum_t' exp(k[t'] + w[t, t']) v[t'] / sum_t' exp(k[t'] + w[t, t'])

  Args:
    q, k, v: ``[..., T, D]``.
    w: ``[T, T]`` pairwise position bias.
    causal: sum over ``t' <= t`` only.
    impl: "auto", "xla", "pallas" or "pallas_interpret" (module docstring).
    initial_state, output_final_state: not for AFT-full (a ValueError): its state is every
      past key and value (``step.FullState``, for decoding), not a summary.
    segment_ids, positions: causal only: packed documents (``segments``): ``[..., T]`` ints;
      w is then ``[L, L]`` with L > every position.

  Returns:
    ``[..., T, D]`` in the dtype of the inputs. O(T^2 D) time, O(T^2 + T D) memory.
  """
  return _run(
    "aft_full", q, k, v, w, causal=causal, impl=impl, initial_state=initial_state,
    output_final_state=output_final_state, segment_ids=segment_ids, positions=positions,
  )  # fmt: skip


def aft_simple(
  q,
  k,
  v,
  *,
  causal: bool = False,
  impl: str = "auto",
  initial_state=None,
  output_final_state: bool = False,
  segment_ids=None,
  axis_name=None,
):
  """AFT-simple (paper Eq. 5): w = 0.

  Y[t] = sigma(q[t]) * sum_t' softmax_t'(k)[t'] v[t']   (t' <= t when causal)

  Args:
    q, k, v: ``[..., T, D]``.
    impl: "auto", "xla", "pallas" or "pallas_interpret" (module docstring).
    initial_state: causal only: the state of the positions before this piece
      (``logsumexp.Acc``, m, num, den ``[..., D]`` float; ``state``), as a call with
      ``output_final_state=True`` (or ``aft_simple_step``) returns it.
    output_final_state: also return the state after the piece.
    segment_ids: causal only: ``[..., T]`` ints, packed documents that do not see each other
      (``segments``); not with a state.
    axis_name: causal only: inside ``jax.shard_map`` with T sharded over this mesh axis
      (consecutive positions per device), each device's shard of the op's output on the whole
      sequence (``sharded``); not with a state or segments.

  Returns:
    ``[..., T, D]``, or ``(Y, state)`` with ``output_final_state``. O(T D) time and memory;
    the causal form is a prefix scan.
  """
  return _run(
    "aft_simple", q, k, v, causal=causal, impl=impl, initial_state=initial_state,
    output_final_state=output_final_state, segment_ids=segment_ids, axis_name=axis_name,
  )  # fmt: skip


def aft_local(
  q,
  k,
  v,
  w,
  *,
  window: int,
  causal: bool = False,
  impl: str = "auto",
  offset=None,
  initial_state=None,
  output_final_state: bool = False,
  segment_ids=None,
  positions=None,
  axis_name=None,
):
  """AFT-local (paper Eq. 4): w[t, t'] is used where |t - t'| < window and is 0 elsewhere.

  Positions outside the window still contribute, with bias 0 (not -inf).

  Args:
    q, k, v: ``[..., T, D]``.
    w: ``[T, T]``; entries outside the window are ignored. In a piece (``offset`` or
      ``initial_state``): ``[L, L]``, L >= offset + T, the bias of the whole sequence. Or its
      factors ``(u, v)``, each ``[L, d']``, w = u v^T: a piece, or a device's shard with
      ``axis_name``, then forms only the block of w it reads (O(T d') memory, not O(T^2)).
    window: s >= 1.
    causal: sum over ``t' <= t`` only.
    impl: "auto", "xla", "pallas" or "pallas_interpret" (module docstring).
    offset: causal only: the position of ``q[..., 0, :]`` in w (an int, or a traced int
      scalar); default ``initial_state.index`` (0 without a state). Given with a state it must
      equal that index (a ValueError; where either is traced, the output is NaN instead, as it
      is for a traced offset with offset + T > L: ``arguments``). Without a state the positions
      before it hold no keys.
    initial_state: causal only: the state of the ``offset`` positions before this piece
      (``WindowState``: the triple of the keys older than the last s, those s keys and values,
      and ``index``, the position of the piece's first query), as a call with
      ``output_final_state=True`` (or ``aft_local_step``) returns it.
    output_final_state: also return the state after the piece (its index offset + T).
    segment_ids, positions: causal only: packed documents (``segments``): ``[..., T]`` ints,
      the documents' ids and each position's index into w (restarting per document; w then
      ``[L, L]`` with L > every position, else NaN); not with a state or an offset.
    axis_name: causal only: inside ``jax.shard_map`` with T sharded over this mesh axis, each
      device's shard of the op's output on the whole sequence (``sharded``); w is the whole
      sequence's bias; not with a state or segments.

  Returns:
    ``[..., T, D]``, or ``(Y, state)`` with ``output_final_state``. O(T s D) time; no T x T
    array is built when s << T.
  """
  return _run(
    "aft_local", q, k, v, w, window=window, causal=causal, impl=impl, offset=offset,
    initial_state=initial_state, output_final_state=output_final_state,
    segment_ids=segment_ids, positions=positions, axis_name=axis_name,
  )  # fmt: skip


def aft_conv1d(
  q,
  k,
  v,
  kernel,
  *,
  causal: bool = False,
  impl: str = "auto",
  initial_state=None,
  output_final_state: bool = False,
  segment_ids=None,
  axis_name=None,
):
  """AFT-conv over a sequence (paper Eq. 6, 1-D): per head i, a kernel w^i of size s.

  Y[t, i] = sigma(q[t, i]) * sum_t' exp(k[t', i] + w^i[t, t']) v[t', i]
                           / sum_t' exp(k[t', i] + w^i[t, t'])

  where w^i[t, t'] = kernel[i, j] for t' = t + j - s // 2 (non-causal; s odd) or t' = t - j
  (causal), and 0 for every other t' (those positions still contribute).

  Args:
    q, v: ``[..., T, H, C]``; k: ``[..., T, H]`` (one key per head).
    kernel: ``[H, s]``.
    impl: "auto", "xla", "pallas" or "pallas_interpret" (module docstring).
    initial_state: causal only: the state of the positions before this piece
      (``WindowState``: the triple of the keys older than the last s, those s keys and values,
      the positions seen), as a call with ``output_final_state=True`` (or ``aft_conv1d_step``)
      returns it.
    output_final_state: also return the state after the piece.
    segment_ids: causal only: ``[..., T]`` ints, packed documents that do not see each other
      (``segments``); not with a state.
    axis_name: causal only: inside ``jax.shard_map`` with T sharded over this mesh axis, each
      device's shard of the op's output on the whole sequence (``sharded``); not with a state
      or segments.

  Returns:
    ``[..., T, H, C]``, or ``(Y, state)`` with ``output_final_state``. O(T s H C): a
    depth-wise windowed sum plus O(T) prefix scans.
  """
  return _run(
    "aft_conv1d", q, k, v, kernel, causal=causal, impl=impl, initial_state=initial_state,
    output_final_state=output_final_state, segment_ids=segment_ids, axis_name=axis_name,
  )  # fmt: skip


def aft_conv2d(q, k, v, kernel, *, impl: str = "auto"):
  """AFT-conv over an image (paper Eq. 6): per head i, a kh x kw kernel w^i ("SAME").

  Y[r, c, i] = sigma(q[r, c, i]) * sum_{r', c'} exp(k[r', c', i] + w^i) v[r', c', i]
                                 / sum_{r', c'} exp(k[r', c', i] + w^i)

  with w^i = kernel[i, a, b] at (r', c') = (r + a - kh // 2, c + b - kw // 2) and 0 at every
  other position of the image (which still contributes).

  Args:
    q, v: ``[..., Ht, Wd, H, C]``; k: ``[..., Ht, Wd, H]``.
    kernel: ``[H, kh, kw]``, odd sizes.
    impl: "auto", "xla", "pallas" or "pallas_interpret" (module docstring).

  Returns:
    ``[..., Ht, Wd, H, C]``. O(Ht Wd kh kw C) per head.
  """
  return _run("aft_conv2d", q, k, v, kernel, impl=impl)
