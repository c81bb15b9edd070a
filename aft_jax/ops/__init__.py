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
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp

from aft_jax.ops import registry
from aft_jax.ops import target  # noqa: F401 (ops.target: the device "auto" decides for)
from aft_jax.ops.registry import IMPLS, OpArgs, check_impl
from aft_jax.ops.step import (
  FullState,
  WindowState,
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


# --------------------------------------------------------------------------- the ops


def _banded_op(fn, q, k, v, w, window: int | None, causal: bool, impl: str):
  """AFT-full (``window`` None: every key) or AFT-local after checking the arguments."""
  _check_qkv(fn, q, k, v)
  _check_w(fn, w, q.shape[-2])
  args = OpArgs(q, k, v, w, causal=causal, window=window)
  run = _resolve(fn, impl, args)
  empty = _empty(args)
  return run(args) if empty is None else empty


def aft_full(q, k, v, w, *, causal: bool = False, impl: str = "auto"):
  """AFT-full (paper Eq. 2).

  Y[t] = sigma(q[t]) * sum_t' exp(k[t'] + w[t, t']) v[t'] / sum_t' exp(k[t'] + w[t, t'])

  Args:
    q, k, v: ``[..., T, D]``.
    w: ``[T, T]`` pairwise position bias.
    causal: sum over ``t' <= t`` only.
    impl: "auto", "xla", "pallas" or "pallas_interpret" (module docstring).

  Returns:
    ``[..., T, D]`` in the dtype of the inputs. O(T^2 D) time, O(T^2 + T D) memory.
  """
  return _banded_op("aft_full", q, k, v, w, None, causal, impl)


def aft_simple(q, k, v, *, causal: bool = False, impl: str = "auto"):
  """AFT-simple (paper Eq. 5): w = 0.

  Y[t] = sigma(q[t]) * sum_t' softmax_t'(k)[t'] v[t']   (t' <= t when causal)

  Args:
    q, k, v: ``[..., T, D]``.
    impl: "auto", "xla", "pallas" or "pallas_interpret" (module docstring).

  Returns:
    ``[..., T, D]``. O(T D) time and memory; the causal form is a prefix scan.
  """
  _check_qkv("aft_simple", q, k, v)
  args = OpArgs(q, k, v, causal=causal)
  run = _resolve("aft_simple", impl, args)
  empty = _empty(args)
  return run(args) if empty is None else empty


def aft_local(q, k, v, w, *, window: int, causal: bool = False, impl: str = "auto"):
  """AFT-local (paper Eq. 4): w[t, t'] is used where |t - t'| < window and is 0 elsewhere.

  Positions outside the window still contribute, with bias 0 (not -inf).

  Args:
    q, k, v: ``[..., T, D]``.
    w: ``[T, T]``; entries outside the window are ignored.
    window: s >= 1.
    causal: sum over ``t' <= t`` only.
    impl: "auto", "xla", "pallas" or "pallas_interpret" (module docstring).

  Returns:
    ``[..., T, D]``. O(T s D) time; no T x T array is built when s << T.
  """
  check_window("aft_local", window)
  return _banded_op("aft_local", q, k, v, w, window, causal, impl)


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


def aft_conv1d(q, k, v, kernel, *, causal: bool = False, impl: str = "auto"):
  """AFT-conv over a sequence (paper Eq. 6, 1-D): per head i, a kernel w^i of size s.

  Y[t, i] = sigma(q[t, i]) * sum_t' exp(k[t', i] + w^i[t, t']) v[t', i]
                           / sum_t' exp(k[t', i] + w^i[t, t'])

  where w^i[t, t'] = kernel[i, j] for t' = t + j - s // 2 (non-causal; s odd) or t' = t - j
  (causal), and 0 for every other t' (those positions still contribute).

  Args:
    q, v: ``[..., T, H, C]``; k: ``[..., T, H]`` (one key per head).
    kernel: ``[H, s]``.
    impl: "auto", "xla", "pallas" or "pallas_interpret" (module docstring).

  Returns:
    ``[..., T, H, C]``. O(T s H C): a depth-wise windowed sum plus O(T) prefix scans.
  """
  _check_conv("aft_conv1d", q, k, v, kernel, 1)
  args = OpArgs(q, k, v, kernel, causal=causal)
  run = _resolve("aft_conv1d", impl, args)
  s = kernel.shape[-1]
  if s < 1 or (not causal and s % 2 == 0):
    raise ValueError(
      f"aft_conv1d: a non-causal kernel size must be odd (centred); got kernel {kernel.shape}"
    )
  empty = _empty(args)
  return run(args) if empty is None else empty


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
