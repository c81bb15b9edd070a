"""The GPU kernels' launch form forced, for benchmarks and tests: within ``forced(form)``
every ``triton.plan_for`` choice made while tracing takes ``form`` ("sequential" or "chunked")
wherever that form can run (docs/kernels.md).
"""

from __future__ import annotations

import contextlib
import functools

from aft_jax.ops.pallas import triton


@contextlib.contextmanager
def forced(form: str):
  if form not in triton.FORMS:
    raise ValueError(f"form must be one of {triton.FORMS}, got {form!r}")
  choose = triton.plan_for
  triton.plan_for = functools.partial(choose, form=form)
  try:
    yield
  finally:
    triton.plan_for = choose
