"""The AFT operations (Zhai et al., 2021, arXiv 2105.14103) as pure jax.numpy functions.

Notation: ``q, k, v`` are ``[..., T, D]`` (any leading batch dims); ``sigma`` is the sigmoid.
Every op computes, for each position ``t`` and channel ``d``,

    Y[t, d] = sigma(q[t, d]) * sum_t' exp(k[t', d] + w[t, t']) v[t', d]
                              / sum_t' exp(k[t', d] + w[t, t'])

and the variants differ only in the position bias ``w`` and in which ``t'`` are summed
(``causal=True``: ``t' <= t``).

Numerical stability. ``exp`` overflows float32 above ~88, and with logits ``k + w`` of large
magnitude a single shift per row of ``w`` and per channel of ``k`` is not enough: the largest
``w`` and the largest ``k`` usually sit at different ``t'``, and every shifted term underflows.
So every sum here is an exact log-sum-exp: partial sums are carried as triples
``(m, num, den)`` = (max logit, sum exp(logit - m) v, sum exp(logit - m)), combined like a stable
log-sum-exp, and prefix sums carry the running maximum. Results are finite and accurate in
float32 for finite logits k + w of any size (tested to |k + w| ~ 1e35; the empty-sum sentinel
``logsumexp.NEG`` is the lowest float32, below every finite logit). Precision policy:
exponentials, maxima and sums are float32; with float32 inputs the matrix products are float32
too (``Precision.HIGHEST``); with bfloat16 inputs their factors (shifted exponentials and
values) are bfloat16 with float32 accumulation (``preferred_element_type``), the
accelerators' tensor-core rate, and the output is bfloat16.
Measured against float64 (docs/kernels.md, "Precision"): bfloat16 results
are within about 1e-2 of the largest output or gradient at logits of std 1 and 40, about the
rounding of bfloat16 outputs. The maxima ``m`` never carry a gradient (they cancel in
num / den), so the backward pass is linear scans and matrix products, with no max() to
differentiate.

Where the work happens (modules of this package). AFT-local and AFT-full: ``banded`` (query
blocks against the keys they can see, as matrix products of exp(w - row max) and
exp(k - channel max) v, plus running sums of the bias-0 keys outside the window; O(T s D), no
T x T array when s << T). Causal AFT-simple: ``causal_mean`` (one pass over chunks with a
triangular matrix product per chunk; about the speed of a ``cumsum``). Both have a
hand-written JVP whose only [T, D] residuals are the output mean and its log-normalizer, so
the backward pass stores little. AFT-conv: ``conv`` (the triples of ``logsumexp``: prefix scans
and shifted sums, with plain autodiff). Non-causal AFT-simple has w = 0, so one shift per
channel (the maximum of k over T) is exact: it is ``jax.nn.softmax`` over T.

Implementations. Every op takes ``impl``, resolved in one place, ``registry.resolve``, from one
table, ``registry.TABLE``: per op, XLA (the jax.numpy code above) and its Pallas kernels
(``impls``), each with one ``supports(args, device)`` that says why it cannot run, if it
cannot. The values: ``"xla"``; ``"pallas"`` (the op's kernel compiled for the accelerator: on
GPU (Triton) causal AFT-simple, ``pallas_simple``, and causal AFT-local, ``pallas_local``; on
TPU (Mosaic) causal AFT-simple, ``pallas_simple_tpu``, channels a multiple of 128);
``"pallas_interpret"`` (the GPU kernel run by Pallas' interpreter on any backend: slow, for
tests; the TPU kernel's interpreted form is ``pallas_simple_tpu.causal_mean(...,
interpret=True)``); or ``"auto"`` (Pallas where a kernel exists for the op, the device and the
channel count, XLA otherwise). The device is the one the computation is lowered for
(``target.current()``: an abstract mesh's device kind, a ``with mesh:`` block's devices, else
the default backend), not the host: GPU kernels need compute capability 8.0 (XLA refuses Triton
below it: a T4 takes XLA), and ``"auto"`` wraps them in ``jax.lax.platform_dependent`` so a
lowering for any other platform takes XLA (one exported module holds both). On TPU ``"auto"``
is XLA: the TPU kernel lowers and is tested in interpret mode but has never been timed on a
TPU, so ``"pallas"`` opts in to it. Where jax has no Pallas Triton backend, ``"auto"`` takes
XLA with one warning. The choice changes results only by float rounding. Asking for a kernel
that does not exist (an op without one, ``"pallas"`` on a CPU, AFT-local on a TPU, a GPU below
compute capability 8.0, a channel count the kernel cannot tile) is a ValueError, never a silent
switch to XLA.

Inputs. q, k, v (and w, the AFT-conv kernel) must be real floating point (an int, bool or
complex input is a ValueError, not a truncated output); an empty input (T, D or a batch dim
0) gives the empty output. Causal ops: an output never depends on a later position, not even
on a NaN or an infinity there. The fast paths shift each block by what its first row sees and
zero a non-finite or overflowing term before any product (``logsumexp.set_aside``), and only
the rows that see such a term are recomputed, so earlier outputs are bit-identical whatever
the later inputs are (XLA and every kernel's forward pass).

Decoding. The causal ops are recurrences over t; their one-token steps are pure functions of an
explicit state (``step``: ``aft_simple_step``, ``aft_full_step``, ``aft_local_step``,
``aft_conv1d_step`` and their ``*_init`` states), which the decoding layers call.

Long and packed sequences (causal ops only; a non-causal op or AFT-full given these is a
ValueError). The same states cut a sequence into pieces: ``initial_state=`` /
``output_final_state=`` on aft_simple, aft_local (with ``offset=``, the piece's position in w)
and aft_conv1d (``state``: the state types; ``pieces``: a piece runs the op itself with the
state prepended as keys, so every implementation serves it). ``axis_name=`` inside
``jax.shard_map`` with T split over that mesh axis builds each device's state from the other
shards with one all-gather (and a ppermute of the last keys) and returns the device's shard of
the whole output (``context``). ``segment_ids=`` (and ``positions=`` for aft_local, aft_full)
treat a row as packed documents that do not see each other (``segments``: exact, plain XLA).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from aft_jax.ops import context, pieces, registry, segments
from aft_jax.ops import target  # noqa: F401 (ops.target: the device "auto" decides for)
from aft_jax.ops.registry import IMPLS, OpArgs, check_impl
from aft_jax.ops.logsumexp import Acc
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

_SAID: set[str] = set()  # the warnings given in this process (each once)


def _resolve(fn: str, impl: str, args: OpArgs) -> registry.Choice:
  """``registry.resolve``, and its warning given once per process."""
  choice = registry.resolve(fn, impl, args)
  if choice.warning is not None and choice.warning not in _SAID:
    _SAID.add(choice.warning)
    warnings.warn(choice.warning, RuntimeWarning, stacklevel=4)
  return choice


# --------------------------------------------------------------------------- validation


def _check_float(fn, **arrays):
  """ValueError unless every array is real floating point (an int, bool or complex input would
  be computed in float32 and then cast back, truncating the output)."""
  for name, x in arrays.items():
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise ValueError(
        f"{fn}: {name} must be a real floating-point array; got {name} "
        f"{jnp.result_type(x).name} {jnp.shape(x)}"
      )


def _empty(args: OpArgs):
  """The result of an op with an empty input (T, D or a batch dim 0): an empty output of q's
  shape, or None when there is work to do."""
  if args.q.size and args.k.size:
    return None
  return jnp.zeros(args.q.shape, jnp.result_type(args.q, args.k, args.v))


def _check_qkv(fn, q, k, v):
  _check_float(fn, q=q, k=k, v=v)
  if q.ndim < 2:
    raise ValueError(f"{fn}: q must be [..., T, D], got shape {q.shape}")
  if k.shape != q.shape or v.shape != q.shape:
    raise ValueError(
      f"{fn}: q, k and v must have the same shape [..., T, D]; got q {q.shape}, "
      f"k {k.shape}, v {v.shape}"
    )


def _check_w(fn, w, t_len):
  _check_float(fn, w=w)
  if w.shape != (t_len, t_len):
    raise ValueError(
      f"{fn}: w must be [T, T] = {(t_len, t_len)} for T = {t_len}; got w {w.shape} "
      "(slice the top-left block of a larger bias first)"
    )


def check_window(fn: str, window) -> None:
  """ValueError (naming ``fn``) unless ``window`` is an int >= 1 (a bool is not a window)."""
  if not isinstance(window, int) or isinstance(window, bool) or window < 1:
    raise ValueError(f"{fn}: window must be an int >= 1, got {window!r}")


# --------------------------------------------------------------------------- pieces


def _check_extras(fn, causal, initial_state=None, output_final_state=False, **given):
  """ValueError where a state, segment or sequence-axis argument is given to an op that cannot
  take it: the state and the rest belong to causal ops (a non-causal output depends on every
  position, so there is no state of the past to hand on)."""
  named = {"initial_state": initial_state is not None, "output_final_state": output_final_state}
  named.update({name: x is not None for name, x in given.items()})
  used = [name for name, on in named.items() if on]
  if used and not causal:
    raise ValueError(
      f"{fn}: {', '.join(used)} need causal=True (a non-causal output depends on every "
      "position: there is no state of the past to carry)"
    )


def _check_alone(fn, initial_state, output_final_state, plain_offset=True):
  """ValueError where packed rows (segment_ids, positions) come with a state or an offset."""
  if initial_state is not None or output_final_state or not plain_offset:
    raise ValueError(
      f"{fn}: segment_ids/positions (packed rows) do not take initial_state, "
      "output_final_state or offset: a packed row is whole documents"
    )


def _check_sharded(fn, initial_state, output_final_state, segment_ids, positions=None, offset=0):
  """ValueError where a sharded call (axis_name) also gets a state, an offset or segments."""
  if initial_state is not None or output_final_state or segment_ids is not None:
    raise ValueError(
      f"{fn}: axis_name (T sharded over devices) does not take initial_state, "
      "output_final_state or segment_ids: the devices' shards are one whole sequence"
    )
  if positions is not None or not (isinstance(offset, int) and offset == 0):
    raise ValueError(f"{fn}: axis_name does not take positions or an offset")


def _check_state(fn, initial_state, expected):
  """ValueError unless ``initial_state`` has the structure and shapes of ``expected`` (the
  state of the op's arguments, as ShapeDtypeStructs)."""
  if initial_state is None:
    return
  want = jax.tree.map(lambda x: x.shape, expected)
  try:
    got = jax.tree.map(jnp.shape, initial_state)
    same = jax.tree.structure(got) == jax.tree.structure(want) and got == want
  except (TypeError, ValueError):
    same, got = False, type(initial_state).__name__
  if not same:
    raise ValueError(
      f"{fn}: initial_state must be the state of these inputs, {type(expected).__name__} with "
      f"shapes {want}; got {got}"
    )


def _factors(fn, w) -> pieces.Factors:
  """w given as its factors (u, v), each ``[L, d']``; a ValueError naming their shapes else."""
  if len(w) != 2:
    raise ValueError(f"{fn}: w as factors must be a pair (u, v); got {len(w)} arrays")
  u, v = w
  _check_float(fn, u=u, v=v)
  if jnp.ndim(u) != 2 or jnp.shape(u) != jnp.shape(v):
    raise ValueError(
      f"{fn}: the factors (u, v) of w = u v^T must both be [L, d']; got u {jnp.shape(u)}, "
      f"v {jnp.shape(v)}"
    )
  return pieces.Factors(u, v)


def _check_offset(fn, offset, w, t_len):
  """``offset`` an int >= 0 (or a traced int scalar) with w ``[L, L]``, L >= offset + T."""
  if isinstance(offset, bool) or not (
    isinstance(offset, int) or jnp.issubdtype(jnp.result_type(offset), jnp.integer)
  ):
    raise ValueError(f"{fn}: offset must be an int >= 0, got {offset!r}")
  least = t_len + (offset if isinstance(offset, int) else 0)
  if isinstance(offset, int) and offset < 0 or w.ndim != 2 or w.shape[0] != w.shape[1]:
    raise ValueError(f"{fn}: offset must be >= 0 and w [L, L]; got offset {offset}, w {w.shape}")
  if w.shape[0] < least:
    raise ValueError(
      f"{fn}: w must be [L, L] with L >= offset + T = {least} (offset {offset}, T {t_len}); "
      f"got w {w.shape}"
    )


def _packed_banded(fn, q, k, v, w, segment_ids, positions, size: int):
  """AFT-full (``size`` = T) or AFT-local (``size`` = window) on packed rows (``segments``)."""
  _check_qkv(fn, q, k, v)
  _check_float(fn, w=w)
  segments.check(fn, q.shape, segment_ids, positions)
  return segments.gated(q, k, v, segment_ids, size, segments.band_bias(w, positions, q.shape[-2]))


def _plain(fn, impl, **static):
  """The op ``fn`` on plain arguments (causal, no state): its resolved implementation."""

  def run(q, k, v, w=None):
    args = OpArgs(q, k, v, w, causal=True, **static)
    out = _empty(args)
    return _resolve(fn, impl, args)(args) if out is None else out

  return run


# --------------------------------------------------------------------------- the ops


def _banded_op(fn, q, k, v, w, window: int | None, causal: bool, impl: str):
  """AFT-full (``window`` None: every key) or AFT-local after checking the arguments."""
  _check_qkv(fn, q, k, v)
  _check_w(fn, w, q.shape[-2])
  args = OpArgs(q, k, v, w, causal=causal, window=window)
  run = _resolve(fn, impl, args)
  empty = _empty(args)
  return run(args) if empty is None else empty


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
  if initial_state is not None or output_final_state:
    raise ValueError(
      "aft_full: initial_state and output_final_state are for aft_simple, aft_local and "
      "aft_conv1d; AFT-full's past is every key and value (decode with aft_full_step)"
    )
  _check_extras("aft_full", causal, segment_ids=segment_ids, positions=positions)
  if segment_ids is None and positions is None:
    return _banded_op("aft_full", q, k, v, w, None, causal, impl)
  return _packed_banded("aft_full", q, k, v, w, segment_ids, positions, q.shape[-2])


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
      (``logsumexp.Acc``, m, num, den ``[..., D]``; ``state``), as a call with
      ``output_final_state=True`` (or ``aft_simple_step``) returns it.
    output_final_state: also return the state after the piece.
    segment_ids: causal only: ``[..., T]`` ints, packed documents that do not see each other
      (``segments``); not with a state.
    axis_name: causal only: inside ``jax.shard_map`` with T sharded over this mesh axis
      (consecutive positions per device), each device's shard of the op's output on the whole
      sequence (``context``); not with a state or segments.

  Returns:
    ``[..., T, D]``, or ``(Y, state)`` with ``output_final_state``. O(T D) time and memory;
    the causal form is a prefix scan.
  """
  _check_qkv("aft_simple", q, k, v)
  _check_extras(
    "aft_simple",
    causal,
    initial_state,
    output_final_state,
    segment_ids=segment_ids,
    axis_name=axis_name,
  )
  if axis_name is not None:
    _check_sharded("aft_simple", initial_state, output_final_state, segment_ids)
    state = context.simple_state(k, v, axis_name)
    return pieces.simple(_plain("aft_simple", impl), q, k, v, state, False)
  if segment_ids is not None:
    _check_alone("aft_simple", initial_state, output_final_state)
    segments.check("aft_simple", q.shape, segment_ids, None)
    return segments.gated(q, k, v, segment_ids, 0, None)
  if not causal:
    args = OpArgs(q, k, v)
    run = _resolve("aft_simple", impl, args)
    empty = _empty(args)
    return run(args) if empty is None else empty
  check_impl("aft_simple", impl)
  _check_state(
    "aft_simple",
    initial_state,
    jax.eval_shape(lambda: aft_simple_init(q.shape[:-2] + q.shape[-1:])),
  )
  return pieces.simple(_plain("aft_simple", impl), q, k, v, initial_state, output_final_state)


def aft_local(
  q,
  k,
  v,
  w,
  *,
  window: int,
  causal: bool = False,
  impl: str = "auto",
  offset=0,
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
    w: ``[T, T]``; entries outside the window are ignored. With ``offset`` or
      ``initial_state``: ``[L, L]``, L >= offset + T, the bias of the whole sequence. Or its
      factors ``(u, v)``, each ``[L, d']``, w = u v^T: a piece, or a device's shard with
      ``axis_name``, then forms only the block of w it reads (O(T d') memory, not O(T^2)).
    window: s >= 1.
    causal: sum over ``t' <= t`` only.
    impl: "auto", "xla", "pallas" or "pallas_interpret" (module docstring).
    offset: causal only: the position of ``q[..., 0, :]`` in w (an int, or a traced int
      scalar), so a piece uses the rows and columns of w of its positions.
    initial_state: causal only: the state of the ``offset`` positions before this piece
      (``WindowState``: the triple of the keys older than the last s, those s keys and values,
      and ``index`` = offset), as a call with ``output_final_state=True`` (or
      ``aft_local_step``) returns it.
    output_final_state: also return the state after the piece.
    segment_ids, positions: causal only: packed documents (``segments``): ``[..., T]`` ints,
      the documents' ids and each position's index into w (restarting per document; w then
      ``[L, L]`` with L > every position); not with a state or an offset.
    axis_name: causal only: inside ``jax.shard_map`` with T sharded over this mesh axis
      (consecutive positions per device), each device's shard of the op's output on the whole
      sequence (``context``); w is the whole sequence's
      bias; not with a state or segments.

  Returns:
    ``[..., T, D]``, or ``(Y, state)`` with ``output_final_state``. O(T s D) time; no T x T
    array is built when s << T.
  """
  check_window("aft_local", window)
  plain = isinstance(offset, int) and offset == 0
  if isinstance(w, (tuple, list)):  # the factors (u, v) of w = u v^T
    w = _factors("aft_local", w)
    whole = plain and initial_state is None and not output_final_state
    if not causal or segment_ids is not None or positions is not None:
      w = w.dense()  # these read all of w
    elif axis_name is None and whole and not pieces.in_sub_pieces(q.shape[-2], window):
      w = w.dense()  # a short sequence in one call: as the dense bias (a long one: pieces)
  if axis_name is not None:
    _check_extras("aft_local", causal, axis_name=axis_name)
    _check_sharded("aft_local", initial_state, output_final_state, segment_ids, positions, offset)
    _check_qkv("aft_local", q, k, v)
    _check_float("aft_local", **({} if isinstance(w, pieces.Factors) else {"w": w}))
    _check_offset("aft_local", 0, w, q.shape[-2] * jax.lax.axis_size(axis_name))
    state = context.window_state(k, v, window, axis_name)
    run = _plain("aft_local", impl, window=window)
    return pieces.local(run, q, k, v, w, window, state.index, state, False)
  if segment_ids is not None or positions is not None:
    _check_extras("aft_local", causal, segment_ids=segment_ids, positions=positions)
    _check_alone("aft_local", initial_state, output_final_state, plain)
    w = w.dense() if isinstance(w, pieces.Factors) else w
    return _packed_banded("aft_local", q, k, v, w, segment_ids, positions, window)
  factored = isinstance(w, pieces.Factors)  # causal, and long or in pieces (above)
  if not causal or (plain and initial_state is None and not output_final_state and not factored):
    _check_extras(
      "aft_local", causal, initial_state, output_final_state, offset=None if plain else offset
    )
    return _banded_op("aft_local", q, k, v, w, window, causal, impl)
  _check_qkv("aft_local", q, k, v)
  _check_float("aft_local", **({} if isinstance(w, pieces.Factors) else {"w": w}))
  _check_offset("aft_local", offset, w, q.shape[-2])
  check_impl("aft_local", impl)
  _check_state(
    "aft_local",
    initial_state,
    jax.eval_shape(lambda: aft_local_init(q.shape[:-2] + q.shape[-1:], window)),
  )
  run = _plain("aft_local", impl, window=window)
  return pieces.local(run, q, k, v, w, window, offset, initial_state, output_final_state)


def _check_conv(fn, q, k, v, kernel, n_spatial):
  _check_float(fn, q=q, k=k, v=v, kernel=kernel)
  nd = n_spatial + 2
  if q.ndim < nd or v.shape != q.shape or k.shape != q.shape[:-1]:
    sp = "Ht, Wd" if n_spatial == 2 else "T"
    raise ValueError(
      f"{fn}: expected q, v [..., {sp}, H, C] and k [..., {sp}, H]; got q {q.shape}, "
      f"k {k.shape}, v {v.shape}"
    )
  if kernel.ndim != n_spatial + 1 or kernel.shape[0] != q.shape[-2]:
    raise ValueError(
      f"{fn}: kernel must be [H, {'kh, kw' if n_spatial == 2 else 's'}] with H = "
      f"{q.shape[-2]} heads; got kernel {kernel.shape}"
    )


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
    axis_name: causal only: inside ``jax.shard_map`` with T sharded over this mesh axis
      (consecutive positions per device), each device's shard of the op's output on the whole
      sequence (``context``); not with a state
      or segments.

  Returns:
    ``[..., T, H, C]``, or ``(Y, state)`` with ``output_final_state``. O(T s H C): a
    depth-wise windowed sum plus O(T) prefix scans.
  """
  _check_conv("aft_conv1d", q, k, v, kernel, 1)
  _check_extras(
    "aft_conv1d",
    causal,
    initial_state,
    output_final_state,
    segment_ids=segment_ids,
    axis_name=axis_name,
  )
  args = OpArgs(q, k, v, kernel, causal=causal)
  run = _resolve("aft_conv1d", impl, args)
  s = kernel.shape[-1]
  if s < 1 or (not causal and s % 2 == 0):
    raise ValueError(
      f"aft_conv1d: a non-causal kernel size must be odd (centred); got kernel {kernel.shape}"
    )
  if not causal:
    empty = _empty(args)
    return run(args) if empty is None else empty
  if axis_name is not None:
    _check_sharded("aft_conv1d", initial_state, output_final_state, segment_ids)
    state = context.window_state(k, v, s, axis_name)
    plain = lambda q, k, v: _plain("aft_conv1d", impl)(q, k, v, kernel)
    return pieces.conv1d(plain, q, k, v, kernel, state, False)
  if segment_ids is not None:
    _check_alone("aft_conv1d", initial_state, output_final_state)
    segments.check("aft_conv1d", k.shape, segment_ids, None)
    kernel_t = jnp.asarray(kernel, jnp.float32).T  # [s, H]: row j the bias at lag j
    return segments.gated(q, k, v, segment_ids, s, lambda j: kernel_t[j])
  k_t, v_t = k.shape[:-2] + k.shape[-1:], v.shape[:-3] + v.shape[-2:]
  _check_state("aft_conv1d", initial_state, jax.eval_shape(lambda: aft_conv1d_init(k_t, v_t, s)))
  plain = lambda q, k, v: _plain("aft_conv1d", impl)(q, k, v, kernel)
  return pieces.conv1d(plain, q, k, v, kernel, initial_state, output_final_state)


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
  _check_conv("aft_conv2d", q, k, v, kernel, 2)
  args = OpArgs(q, k, v, kernel)
  run = _resolve("aft_conv2d", impl, args)
  kh, kw = kernel.shape[1:]
  if kh % 2 == 0 or kw % 2 == 0:
    raise ValueError(f"aft_conv2d: kernel sizes must be odd; got kernel {kernel.shape}")
  empty = _empty(args)
  return run(args) if empty is None else empty
