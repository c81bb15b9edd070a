"""One-token steps of the causal ops: incremental decoding as pure functions of a state.

A causal op sums over t' <= t only, so position t needs a summary of the past, not the past:

    (Y[t], state_{t+1}) = step(state_t, q[t], k[t], v[t])

with Y[t] = sigma(q[t]) * sum_{t' <= t} exp(k[t'] + w[t, t']) v[t'] / sum_{t' <= t} exp(...)
(the ``aft_jax.ops`` docstring). The states are explicit values (the decoding layers keep them
in their "cache" collection), every sum an exact (m, num, den) triple of ``logsumexp``:

    AFT-simple   (w = 0) the triple of every key so far: ``logsumexp.Acc``, O(D).
    AFT-full     every key and value so far in an [L, D] cache (L = max_len) and the count t
                 (``FullState``); the step takes w[t, :L], the bias row of position t.
    AFT-local    the last s keys and values in a ring buffer, and the triple of every older key,
    AFT-conv1d   whose bias is 0 (``WindowState``): O(s D). AFT-local's step takes w[t, :L];
                 AFT-conv1d's the kernel [H, s], entry j the bias of position t - j.

From the ``*_init`` state, the steps over t = 0 .. T-1 give the op with causal=True. The state
is float32; Y[t] comes back in the dtype of q, k, v. The AFT-simple, AFT-local and AFT-conv1d
states are the ops' own (``state``): a call with ``output_final_state=True`` hands its state to
the steps, and a step's state is a call's ``initial_state``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aft_jax.ops import logsumexp as lse
from aft_jax.ops.state import FullState, WindowState, window_init

_f32 = lambda x: jnp.asarray(x, jnp.float32)


def _out(q_t, k_t, v_t, acc):
  return lse.output(_f32(q_t), acc).astype(jnp.result_type(q_t, k_t, v_t))


def aft_simple_init(shape) -> lse.Acc:
  """The state before any token, for q_t, k_t, v_t of ``shape`` [..., D]."""
  return lse.empty(shape)


def aft_simple_step(state: lse.Acc, q_t, k_t, v_t):
  """AFT-simple: Y[t] = sigma(q[t]) * sum_{t' <= t} exp(k[t']) v[t'] / sum_{t' <= t} exp(k[t']).

  q_t, k_t, v_t: ``[..., D]``. Returns ``(Y[t] [..., D], state)``.
  """
  state = lse.add(state, _f32(k_t), _f32(v_t))
  return _out(q_t, k_t, v_t, state), state


def aft_full_init(shape, max_len: int) -> FullState:
  """The state before any token, for q_t, k_t, v_t of ``shape`` [..., D] and T <= max_len."""
  cache = jnp.zeros(tuple(shape[:-1]) + (max_len, shape[-1]), jnp.float32)
  return FullState(cache, cache, jnp.zeros((), jnp.int32))


def aft_full_step(state: FullState, q_t, k_t, v_t, w_t):
  """AFT-full: Y[t] = sigma(q[t]) * sum_{t' <= t} exp(k[t'] + w[t, t']) v[t'] / (the same
  without v), t = ``state.index``.

  q_t, k_t, v_t: ``[..., D]``; w_t: ``[L]``, row t of the bias. Returns ``(Y[t], state)``.
  """
  t = state.index
  put = lambda cache, x: jax.lax.dynamic_update_slice_in_dim(cache, _f32(x)[..., None, :], t, -2)
  keys, values = put(state.keys, k_t), put(state.values, v_t)
  valid = (jnp.arange(keys.shape[-2]) <= t)[:, None]
  acc = lse.from_terms(keys + _f32(w_t)[:, None], values, valid, axis=keys.ndim - 2)
  return _out(q_t, k_t, v_t, acc), FullState(keys, values, t + 1)


def _window_step(state: WindowState, q_t, k_t, v_t, bias):
  """The window's step; ``bias(pos, age)`` -> the biases ``[s, 1]`` or ``[s, H]`` of the ring's
  slots, slot j holding position pos[j] = t - age[j] (pos < 0: empty)."""
  axis = state.keys.ndim - 2
  size, t = state.keys.shape[axis], state.index
  slot = t % size
  # The key leaving the window (position t - size) joins the bias-free prefix sum.
  old = lambda ring: jax.lax.dynamic_index_in_dim(ring, slot, axis, keepdims=False)
  prefix = lse.add(state.prefix, old(state.keys), old(state.values), t >= size)
  put = lambda ring, x: jax.lax.dynamic_update_slice_in_dim(
    ring, jnp.expand_dims(_f32(x), axis), slot, axis
  )
  keys, values = put(state.keys, k_t), put(state.values, v_t)
  age = (slot - jnp.arange(size)) % size
  pos = t - age
  band = lse.from_terms(keys + bias(pos, age), values, (pos >= 0)[:, None], axis=axis)
  y = _out(q_t, k_t, v_t, lse.combine(prefix, band))
  return y, WindowState(prefix, keys, values, t + 1)


def aft_local_init(shape, window: int) -> WindowState:
  """The state before any token, for q_t, k_t, v_t of ``shape`` [..., D]; ``window`` s (with
  T <= L, a window of min(s, L) gives the same result)."""
  return window_init(shape, shape, window)


def aft_local_step(state: WindowState, q_t, k_t, v_t, w_t):
  """AFT-local: as ``aft_full_step`` with w[t, t'] for t - t' < s and 0 for older keys.

  q_t, k_t, v_t: ``[..., D]``; w_t: ``[L]``, row t of the bias (L > t). Returns
  ``(Y[t], state)``.
  """
  w_t = _f32(w_t)
  return _window_step(
    state, q_t, k_t, v_t, lambda pos, _: w_t[jnp.clip(pos, 0, w_t.shape[-1] - 1)][:, None]
  )


def aft_conv1d_init(k_shape, v_shape, kernel_size: int) -> WindowState:
  """The state before any token, for k_t ``[..., H]``, v_t ``[..., H, C]`` and a causal kernel
  of ``kernel_size`` s."""
  return window_init(k_shape, v_shape, kernel_size)


def aft_conv1d_step(state: WindowState, q_t, k_t, v_t, kernel):
  """Causal AFT-conv1d: per head i, Y[t, i] = sigma(q[t, i]) * sum_{t' <= t} exp(k[t', i] +
  b[t', i]) v[t', i] / (the same without v), b = kernel[i, t - t'] for t - t' < s, else 0.

  q_t, v_t: ``[..., H, C]``; k_t: ``[..., H]``; kernel: ``[H, s]``. Returns ``(Y[t], state)``.
  """
  kernel = _f32(kernel)
  return _window_step(state, q_t, k_t, v_t, lambda _, age: kernel.T[age])
