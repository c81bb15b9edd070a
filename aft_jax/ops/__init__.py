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
float32 for logits of any size. Precision policy: exponentials, maxima and sums are float32;
with float32 inputs the matrix products are float32 too (``Precision.HIGHEST``); with bfloat16
inputs their factors (exponentials <= 1 and values) are bfloat16 with float32 accumulation
(``preferred_element_type``), the accelerators' tensor-core rate, and the output is bfloat16.
Measured against float64 (README, "Kernels, implementations and precision"): bfloat16 results
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

Implementations. Every op takes ``impl``: ``"xla"`` (the jax.numpy code above), ``"pallas"``
(a Pallas kernel compiled for the accelerator: on GPU (Triton) causal AFT-simple,
``pallas_simple``, and causal AFT-local, ``pallas_local``; on TPU (Mosaic) causal AFT-simple,
``pallas_simple_tpu``, channels a multiple of 128),
``"pallas_interpret"`` (the GPU kernel run by Pallas' interpreter on any backend: slow, for
tests; the TPU kernel's interpreted form is ``pallas_simple_tpu.causal_mean(...,
interpret=True)``) or ``"auto"`` (Pallas where a kernel exists for the op, the device and the
channel count, XLA otherwise). The device is the one the computation is lowered for
(``target.current()``: an abstract mesh's device kind, a ``with mesh:`` block's devices, else
the default backend), not the host: GPU kernels need compute capability 8.0 (XLA refuses Triton
below it: a T4 takes XLA), and ``"auto"`` wraps them in ``jax.lax.platform_dependent`` so a
lowering for any other platform takes XLA. On TPU ``"auto"`` is XLA: the TPU kernel lowers and
is tested in interpret mode but has never been timed on a TPU, so ``"pallas"`` opts in to it.
The choice changes results only by float rounding. Asking for a kernel that does not exist (an
op without one, ``"pallas"`` on a CPU, AFT-local on a TPU, a GPU below compute capability 8.0,
a channel count the kernel cannot tile) is a ValueError, never a silent switch to XLA.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from aft_jax.ops import (
  banded,
  causal_mean,
  conv,
  pallas_local,
  pallas_simple,
  pallas_simple_tpu,
  target,
)

__all__ = [
  "IMPLS",
  "aft_full",
  "aft_simple",
  "aft_local",
  "aft_conv1d",
  "aft_conv2d",
  "check_impl",
  "check_window",
]

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")
# Backends with compiled Pallas kernels, per op: Triton on GPU; Mosaic on TPU (AFT-simple only).
_KERNEL_BACKENDS = {"aft_simple": ("gpu", "tpu"), "aft_local": ("gpu",)}
# Where impl="auto" takes the kernel: GPUs. The TPU kernel has never been timed on a TPU, so
# there "auto" is XLA and impl="pallas" opts in.
_AUTO_BACKENDS = ("gpu",)


def _to_rows(x):
  """[..., T, D] -> [T, R] with R = prod(...) * D (free when there is no batch dim)."""
  t_len, d = x.shape[-2:]
  x = x.reshape((-1, t_len, d))
  return jnp.swapaxes(x, 0, 1).reshape(t_len, -1)


def _from_rows(x, shape):
  t_len, d = shape[-2:]
  x = jnp.swapaxes(x.reshape(t_len, -1, d), 0, 1)
  return x.reshape(shape)


def _banded_mean(k, v, w, window: int, causal: bool, low: bool):
  """The banded mean (``banded.banded_mean``) of [..., T, D] keys and values."""
  k2, v2 = _to_rows(k), _to_rows(v)
  plan = banded.make_plan(k2.shape[0], k2.shape[1], window, causal, low=low)
  return _from_rows(banded.banded_mean(plan, k2, v2, w), k.shape)


def _dispatch(impl: str, kernel_fn, xla_fn, *args):
  """``kernel_fn(*args)`` or ``xla_fn(*args)`` for a resolved ``impl``; "auto_pallas": the
  kernel where the program is lowered for CUDA, XLA for any other platform (one exported module
  can hold both)."""
  if impl == "xla":
    return xla_fn(*args)
  if impl == "auto_pallas":
    return jax.lax.platform_dependent(*args, cuda=kernel_fn, default=xla_fn)
  return kernel_fn(*args)


# --------------------------------------------------------------------------- validation


def _check_qkv(fn, q, k, v):
  if q.ndim < 2:
    raise ValueError(f"{fn}: q must be [..., T, D], got shape {q.shape}")
  if k.shape != q.shape or v.shape != q.shape:
    raise ValueError(
      f"{fn}: q, k and v must have the same shape [..., T, D]; got q {q.shape}, "
      f"k {k.shape}, v {v.shape}"
    )


def _check_w(fn, w, t_len):
  if w.shape != (t_len, t_len):
    raise ValueError(
      f"{fn}: w must be [T, T] = {(t_len, t_len)} for T = {t_len}; got w {w.shape} "
      "(slice the top-left block of a larger bias first)"
    )


def check_window(fn: str, window) -> None:
  """ValueError (naming ``fn``) unless ``window`` is an int >= 1 (a bool is not a window)."""
  if not isinstance(window, int) or isinstance(window, bool) or window < 1:
    raise ValueError(f"{fn}: window must be an int >= 1, got {window!r}")


def check_impl(fn: str, impl) -> None:
  """ValueError (naming ``fn``) unless ``impl`` is one of ``IMPLS``."""
  if impl not in IMPLS:
    raise ValueError(f"{fn}: impl must be one of {IMPLS}, got {impl!r}")


_SAID: set[str] = set()  # the warnings given in this process (each once)


def _say_once(message: str) -> None:
  if message not in _SAID:
    _SAID.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _resolve_impl(fn: str, impl: str, kernel_ok: str | None, kernel: str = "") -> str:
  """ "xla", "pallas", "pallas_interpret" or "auto_pallas" (the kernel on CUDA, XLA on any
  other platform the program is also lowered for: ``jax.lax.platform_dependent``) for ``impl``
  on the device being lowered for (``target.current()``). ``kernel_ok`` is None where a kernel
  exists for these arguments, else why not (the error for an explicit Pallas request);
  ``kernel``: the op's key in ``_KERNEL_BACKENDS``."""
  check_impl(fn, impl)
  if impl == "xla" or (impl == "auto" and kernel_ok is not None):
    return "xla"
  if kernel_ok is not None:
    raise ValueError(f"{fn}: impl={impl!r} is not available: {kernel_ok}; use impl='xla'")
  if impl == "pallas_interpret":
    return impl
  device = target.current()
  backends = _KERNEL_BACKENDS.get(kernel, ())
  if device.platform not in backends:
    if impl == "auto":
      return "xla"
    raise ValueError(
      f"{fn}: impl='pallas' compiles this op's kernel for {backends}, not for the "
      f"{device.platform!r} platform ({device}); use impl='xla', or 'pallas_interpret' to run "
      "the GPU kernel in Pallas' interpreter"
    )
  refused = target.gpu_kernels_refused(device) if device.platform == "gpu" else None
  if refused is not None:
    if impl == "pallas":
      raise ValueError(f"{fn}: impl='pallas' cannot run on {device}: {refused}; use impl='xla'")
    if target.triton_missing():
      _say_once(f"aft_jax.ops: impl='auto' takes the XLA path: {refused}")
    return "xla"
  if impl == "auto":
    return "auto_pallas" if device.platform in _AUTO_BACKENDS else "xla"
  return impl


_NO_KERNEL = "there is no Pallas kernel for this op"


def _compute_dtype(*xs):
  """(output dtype, compute dtype): bfloat16 and float16 are computed in float32."""
  dt = jnp.result_type(*xs)
  return dt, jnp.promote_types(dt, jnp.float32)


def _low(out_dtype) -> bool:
  """The precision policy: bfloat16 inputs take bfloat16 matrix-product factors with float32
  accumulation; float32 inputs keep float32 products (``logsumexp.matmul``)."""
  return out_dtype == jnp.bfloat16


def _cast(dt, *xs):
  return tuple(jnp.asarray(x, dt) for x in xs)


# --------------------------------------------------------------------------- the ops


def _flat(x):
  """[..., T, D] -> [B, T, D] (the kernels' layout)."""
  return x.reshape((-1,) + x.shape[-2:])


def _banded_op(fn, q, k, v, w, window: int | None, causal: bool, impl: str):
  """AFT-full (``window`` None: every key) or AFT-local after checking the arguments."""
  _check_qkv(fn, q, k, v)
  t_len = q.shape[-2]
  _check_w(fn, w, t_len)
  if window is None:
    why = _NO_KERNEL
  elif not causal:
    why = "the kernel is for causal=True"
  else:
    why = pallas_local.unsupported(q.shape[-1], window)
  impl = _resolve_impl(fn, impl, why, "aft_local")
  out_dt, dt = _compute_dtype(q, k, v)
  window = t_len if window is None else window

  def kernel_mean(k, v, w):
    # The kernel reads k and v in their own dtype (bf16: half the memory traffic).
    k3 = _flat(k)
    cfg = pallas_local.config_for(k.shape[-1], k3.shape[0])
    a = pallas_local.local_mean(k3, _flat(v), w, window, cfg, impl == "pallas_interpret")
    return a.reshape(k.shape).astype(dt)

  def xla_mean(k, v, w):
    k, v = _cast(dt, k, v)
    return _banded_mean(k, v, w, window, causal, _low(out_dt)).astype(dt)

  a = _dispatch(impl, kernel_mean, xla_mean, k, v, jnp.asarray(w, dt))
  return (jax.nn.sigmoid(jnp.asarray(q, dt)) * a).astype(out_dt)


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
  # impl="pallas" for a TPU compiles the Mosaic kernel (its own channel tile); else Triton's.
  tpu = impl == "pallas" and target.current().platform == "tpu"
  kernel = pallas_simple_tpu if tpu else pallas_simple
  why = "the kernel is for causal=True" if not causal else kernel.unsupported(q.shape[-1])
  impl = _resolve_impl("aft_simple", impl, why, "aft_simple")
  out_dt, dt = _compute_dtype(q, k, v)
  if not causal:
    # w = 0: one shift per channel (the max of k over T) is exact, which is what softmax does.
    q, k, v = _cast(dt, q, k, v)
    weights = jax.nn.softmax(k, axis=-2)
    return (jax.nn.sigmoid(q) * jnp.sum(weights * v, axis=-2, keepdims=True)).astype(out_dt)

  def kernel_mean(k, v):
    # The kernel reads k and v in their own dtype (bf16: half the memory traffic).
    k3, v3 = _flat(k), _flat(v)
    if tpu:
      a = pallas_simple_tpu.causal_mean(k3, v3)
    else:
      cfg = pallas_simple.config_for(k.shape[-1], k3.shape[0])
      a = pallas_simple.causal_mean(k3, v3, cfg, impl == "pallas_interpret")
    return a.reshape(k.shape).astype(dt)

  def xla_mean(k, v):
    k, v = _cast(dt, k, v)
    mean = causal_mean.causal_mean(_to_rows(k), _to_rows(v), causal_mean.CHUNK, _low(out_dt))
    return _from_rows(mean, k.shape).astype(dt)

  a = _dispatch(impl, kernel_mean, xla_mean, k, v)
  return (jax.nn.sigmoid(jnp.asarray(q, dt)) * a).astype(out_dt)


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
  _resolve_impl("aft_conv1d", impl, _NO_KERNEL)
  s = kernel.shape[-1]
  if s < 1 or (not causal and s % 2 == 0):
    raise ValueError(
      f"aft_conv1d: a non-causal kernel size must be odd (centred); got kernel {kernel.shape}"
    )
  out_dt, dt = _compute_dtype(q, k, v)
  q, k, v, kernel = _cast(dt, q, k, v, kernel)
  return conv.conv1d(q, k, v, kernel, causal).astype(out_dt)


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
  _resolve_impl("aft_conv2d", impl, _NO_KERNEL)
  kh, kw = kernel.shape[1:]
  if kh % 2 == 0 or kw % 2 == 0:
    raise ValueError(f"aft_conv2d: kernel sizes must be odd; got kernel {kernel.shape}")
  out_dt, dt = _compute_dtype(q, k, v)
  q, k, v, kernel = _cast(dt, q, k, v, kernel)
  return conv.conv2d(q, k, v, kernel).astype(out_dt)
