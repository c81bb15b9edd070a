"""Compiled scratch memory: causal AFT grows linearly in T."""

import functools

import jax
import jax.numpy as jnp
import pytest

from aft_jax import ops

D = 64
LENGTHS = (1024, 4096, 16384)


def _temp_bytes(fn, *args, n=3):
  """Scratch memory of forward + backward (the gradients of the first ``n`` inputs)."""
  grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=tuple(range(n))))
  return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes


def _args(t_len, with_w=False, d=D):
  x = jax.ShapeDtypeStruct((1, t_len, d), jnp.float32)
  return (x, x, x) + ((jax.ShapeDtypeStruct((t_len, t_len), jnp.float32),) if with_w else ())


CASES = {
  "aft_simple": (functools.partial(ops.aft_simple, causal=True), False),
  "aft_local": (lambda q, k, v, w: ops.aft_local(q, k, v, w, window=32, causal=True), True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_causal_aft_memory_grows_linearly(name):
  fn, with_w = CASES[name]
  sizes = [_temp_bytes(fn, *_args(t, with_w)) for t in LENGTHS]
  for small, big in zip(sizes, sizes[1:]):
    assert big <= 5 * small, (name, sizes)  # 4x longer: at most ~5x the memory
  # and far below a single T x T float32 array at the longest length
  assert sizes[-1] < LENGTHS[-1] ** 2 * 4 / 4, (name, sizes)


def test_causal_aft_uses_a_twentieth_of_softmax_memory_at_4096():
  """Forward+backward at T 4096, d 512: at most 0.05x causal softmax's scratch (8 heads)."""
  from benchmarks.bench_ops import _softmax_einsum

  t_len = 4096
  x = _args(t_len, True, d=512)
  softmax = _temp_bytes(_softmax_einsum, *x[:3])
  simple = _temp_bytes(functools.partial(ops.aft_simple, causal=True), *x[:3])
  local = _temp_bytes(functools.partial(ops.aft_local, window=128, causal=True), *x, n=4)
  assert softmax > t_len * t_len * 4 * 8 / 2, softmax  # the 8 heads' scores: the baseline is real
  assert simple <= 0.05 * softmax, (simple, softmax)
  assert local <= 0.05 * softmax, (local, softmax)
