"""A benchmark and test hook, kept out of the kernels: the GPU kernels' launch form forced.

``aft_jax.ops.pallas.triton.plan_for`` chooses the sequential or the chunk-parallel form of the
Pallas GPU kernels (``form="auto"``, as the ops ask); ``forced(form)`` makes every choice inside
the block ``form`` wherever that form can run, so that each can be timed or tested on the same
shapes.
It acts where the kernels are traced (inside ``jax.jit``, at the first call).
"""

from __future__ import annotations

import contextlib
import functools

from aft_jax.ops.pallas import triton


@contextlib.contextmanager
def forced(form: str):
  """Within the block, the kernels take ``form`` ("sequential" or "chunked") where they can."""
  if form not in triton.FORMS:
    raise ValueError(f"form must be one of {triton.FORMS}, got {form!r}")
  choose = triton.plan_for
  triton.plan_for = functools.partial(choose, form=form)
  try:
    yield
  finally:
    triton.plan_for = choose
