"""A benchmark and test hook, kept out of the kernels: the GPU kernels' launch form forced.

``pallas_split.plan_for`` chooses the sequential or the chunk-parallel form of the Pallas GPU
kernels (``form="auto"``, as the ops ask); ``forced(form)`` makes every choice inside the block
``form`` wherever that form can run, so that each can be timed or tested on the same shapes.
It acts where the kernels are traced (inside ``jax.jit``, at the first call).
"""

from __future__ import annotations

import contextlib
import functools

from aft_jax.ops import pallas_split


@contextlib.contextmanager
def forced(form: str):
  """Within the block, the kernels take ``form`` ("sequential" or "chunked") where they can."""
  if form not in pallas_split.FORMS:
    raise ValueError(f"form must be one of {pallas_split.FORMS}, got {form!r}")
  choose = pallas_split.plan_for
  pallas_split.plan_for = functools.partial(choose, form=form)
  try:
    yield
  finally:
    pallas_split.plan_for = choose
