"""The ops' arguments, checked and normalised once: ``normalise`` -> a ``Call`` and its mode.

Every public op hands its arguments here before anything is traced; what comes back names the
mode that runs it, each in its own module:

    plain     a whole sequence (any op, causal or not): its implementation (``plain``)
    state     a piece of a sequence after ``initial_state`` / with ``output_final_state`` or an
              ``offset`` (causal AFT-simple, AFT-local, AFT-conv1d; ``pieces``)
    packed    ``segment_ids`` / ``positions``: documents that do not see each other (causal
              AFT-full, AFT-local, AFT-simple, AFT-conv1d; ``segments``)
    sharded   ``axis_name``: T split over a mesh axis inside ``jax.shard_map`` (causal
              AFT-simple, AFT-local, AFT-conv1d; ``sharded``)

Bad input is a ValueError naming the op, the argument and the shapes or values: q, k, v, w and
the kernel real floating point with matching shapes; window an int >= 1; impl one of
``registry.IMPLS``; a state, segment or sequence-axis argument only for a causal op that takes
it, and not two modes at once; ``initial_state`` the structure, shapes and dtypes of the op's
state (float leaves, an int ``index``).

``offset`` (AFT-local: the position of the piece's first query in w) defaults to the state's
``index`` (0 without a state), the position of the next token in w; given with a state it must
equal that index. What is static is checked here (a Python int, or a concrete array: a state
handed on outside ``jit``); inside ``jit`` the offset or the index is traced, and what cannot
be checked becomes ``Call.guard``, a traced bool under which the state mode returns NaN (every
output of the piece) instead of a bias read at a clamped position: offset < 0, offset + T > L,
or offset != the state's index. A ``positions`` entry outside w gives NaN likewise
(``segments``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from aft_jax.ops import pieces, registry, segments
from aft_jax.ops import step as steps
from aft_jax.ops.registry import OpArgs, check_impl


class Call(NamedTuple):
  """An op's checked arguments.

  fn: the op's name (for messages); mode: "plain", "state", "packed" or "sharded".
  q, k, v: as given; w: the bias ``[T, T]`` / ``[L, L]``, its ``pieces.Factors``, the AFT-conv
  kernel, or None (AFT-simple). size: AFT-local's window, AFT-conv1d's kernel size, AFT-full's
  T (packed rows: every key is in the band), else None. offset: AFT-local's position of q[0]
  in w (an int or a traced int scalar; as given, None: from the state). causal, impl,
  initial_state, output_final_state, segment_ids, positions, axis_name: the op's arguments.
  guard: None, or a traced bool: False where the piece's offset cannot be right (the state mode
  then returns NaN).
  """

  fn: str
  mode: str
  q: Any
  k: Any
  v: Any
  w: Any = None
  causal: bool = False
  impl: str = "auto"
  size: int | None = None
  offset: Any = None
  initial_state: Any = None
  output_final_state: bool = False
  segment_ids: Any = None
  positions: Any = None
  axis_name: Any = None
  guard: Any = None


# --------------------------------------------------------------------------- single checks


def check_float(fn, **arrays):
  """ValueError unless every array is real floating point (an int, bool or complex input would
  be computed in float32 and then cast back, truncating the output)."""
  for name, x in arrays.items():
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise ValueError(
        f"{fn}: {name} must be a real floating-point array; got {name} "
        f"{jnp.result_type(x).name} {jnp.shape(x)}"
      )


def check_window(fn: str, window) -> None:
  """ValueError (naming ``fn``) unless ``window`` is an int >= 1 (a bool is not a window)."""
  if not isinstance(window, int) or isinstance(window, bool) or window < 1:
    raise ValueError(f"{fn}: window must be an int >= 1, got {window!r}")


def _check_qkv(fn, q, k, v):
  check_float(fn, q=q, k=k, v=v)
  if q.ndim < 2:
    raise ValueError(f"{fn}: q must be [..., T, D], got shape {q.shape}")
  if k.shape != q.shape or v.shape != q.shape:
    raise ValueError(
      f"{fn}: q, k and v must have the same shape [..., T, D]; got q {q.shape}, "
      f"k {k.shape}, v {v.shape}"
    )


def _check_w(fn, w, t_len):
  check_float(fn, w=w)
  if w.shape != (t_len, t_len):
    raise ValueError(
      f"{fn}: w must be [T, T] = {(t_len, t_len)} for T = {t_len}; got w {w.shape} "
      "(slice the top-left block of a larger bias first)"
    )


def _check_conv(fn, q, k, v, kernel, n_spatial):
  check_float(fn, q=q, k=k, v=v, kernel=kernel)
  if q.ndim < n_spatial + 2 or v.shape != q.shape or k.shape != q.shape[:-1]:
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


def _check_causal(fn, causal, **given):
  """ValueError where a state, segment or sequence-axis argument (those given: not None, not
  False) goes to a non-causal op (its output depends on every position: no past to carry)."""
  used = [name for name, x in given.items() if x is not None and x is not False]
  if used and not causal:
    raise ValueError(
      f"{fn}: {', '.join(used)} need causal=True (a non-causal output depends on every "
      "position: there is no state of the past to carry)"
    )


def _check_alone(fn, mode, initial_state, output_final_state, offset, **others):
  """ValueError where packed rows or a sharded call also get a state, an offset or (sharded)
  segments or positions."""
  if mode == "packed":
    if initial_state is not None or output_final_state or not _zero(offset):
      raise ValueError(
        f"{fn}: segment_ids/positions (packed rows) do not take initial_state, "
        "output_final_state or offset: a packed row is whole documents"
      )
    return
  if initial_state is not None or output_final_state or others.get("segment_ids") is not None:
    raise ValueError(
      f"{fn}: axis_name (T sharded over devices) does not take initial_state, "
      "output_final_state or segment_ids: the devices' shards are one whole sequence"
    )
  if others.get("positions") is not None or not _zero(offset):
    raise ValueError(f"{fn}: axis_name does not take positions or an offset")


def _zero(offset) -> bool:
  """Whether ``offset`` is left out or a Python 0."""
  return offset is None or (isinstance(offset, int) and offset == 0)


def _static_int(x) -> int | None:
  """x as an int where it is known at trace time (a Python int or a concrete array), else None."""
  try:
    return int(x)
  except jax.errors.ConcretizationTypeError:  # traced (inside jit, vmap of a traced value, ...)
    return None


def _check_state(fn, initial_state, expected):
  """ValueError unless ``initial_state`` has the structure, shapes and dtypes of ``expected``
  (the state of the op's arguments, as ShapeDtypeStructs): floating-point leaves, an integer
  (not bool) ``index``."""
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
  paths = jax.tree_util.tree_flatten_with_path(expected)[0]
  for (path, spec), leaf in zip(paths, jax.tree.leaves(initial_state)):
    kind = jnp.floating if jnp.issubdtype(spec.dtype, jnp.floating) else jnp.integer
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, kind):  # (a bool is neither)
      name = "floating-point" if kind is jnp.floating else "an int"
      raise ValueError(
        f"{fn}: initial_state{jax.tree_util.keystr(path)} must be {name} (as the op's state, "
        f"{spec.dtype.name}); got {dtype.name}"
      )


def _factors(fn, w) -> pieces.Factors:
  """w given as its factors (u, v), each ``[L, d']``; a ValueError naming their shapes else."""
  if len(w) != 2:
    raise ValueError(f"{fn}: w as factors must be a pair (u, v); got {len(w)} arrays")
  u, v = w
  check_float(fn, u=u, v=v)
  if jnp.ndim(u) != 2 or jnp.shape(u) != jnp.shape(v):
    raise ValueError(
      f"{fn}: the factors (u, v) of w = u v^T must both be [L, d']; got u {jnp.shape(u)}, "
      f"v {jnp.shape(v)}"
    )
  return pieces.Factors(u, v)


def _check_bias(fn, w, least: int, offset):
  """w ``[L, L]`` (or its factors) with L >= ``least`` = offset + T."""
  if not isinstance(w, pieces.Factors):
    check_float(fn, w=w)
  if w.ndim != 2 or w.shape[0] != w.shape[1]:
    raise ValueError(f"{fn}: w must be [L, L]; got offset {offset}, w {w.shape}")
  if w.shape[0] < least:
    raise ValueError(
      f"{fn}: w must be [L, L] with L >= offset + T = {least} (offset {offset}, "
      f"T {least - (offset if isinstance(offset, int) else 0)}); got w {w.shape}"
    )


def _offset(fn, offset, initial_state, w, t_len: int):
  """(offset, guard) of a piece of AFT-local (module docstring): the offset (an int where it
  is static, else traced) and None, or the traced bool under which it is right."""
  index = None if initial_state is None else initial_state.index
  given = offset is not None
  if not given:
    offset = 0 if index is None else index
  if isinstance(offset, bool) or not (
    isinstance(offset, int)
    or (jnp.issubdtype(jnp.result_type(offset), jnp.integer) and jnp.ndim(offset) == 0)
  ):
    raise ValueError(f"{fn}: offset must be an int >= 0 (or an int scalar), got {offset!r}")
  at = _static_int(offset)
  known = None if index is None else _static_int(index)
  if at is not None and at < 0:
    raise ValueError(f"{fn}: offset must be >= 0; got offset {at}")
  if given and at is not None and known is not None and at != known:
    raise ValueError(
      f"{fn}: offset {at} does not match initial_state.index {known}: the state holds the "
      f"{known} positions before the piece (leave offset out to take it from the state)"
    )
  _check_bias(fn, w, t_len + (at or 0), offset if at is None else at)
  # Traced: what cannot be checked here turns the piece's output into NaN (``Call.guard``).
  guard = None
  if at is None:
    guard = (offset >= 0) & (offset + t_len <= w.shape[0])
  if given and index is not None and (at is None or known is None):
    same = jnp.asarray(offset) == index
    guard = same if guard is None else guard & same
  return (offset if at is None else at), guard


# --------------------------------------------------------------------------- the ops


def _mode(causal, initial_state, output_final_state, offset, segment_ids, positions, axis_name):
  if axis_name is not None:
    return "sharded"
  if segment_ids is not None or positions is not None:
    return "packed"
  if causal and (initial_state is not None or output_final_state or not _zero(offset)):
    return "state"
  return "plain"


def normalise(fn: str, q, k, v, w=None, *, window=None, **given) -> Call:
  """The ``Call`` of op ``fn`` ("aft_full", "aft_simple", "aft_local", "aft_conv1d",
  "aft_conv2d") on q, k, v, w and its keyword arguments (those it takes: ``window`` and the
  fields of ``Call``); a ValueError naming the argument and shapes for any that is wrong
  (module docstring)."""
  call = Call(fn, "plain", q, k, v, w, size=window, **given)
  causal, impl, offset, initial_state = call.causal, call.impl, call.offset, call.initial_state
  output_final_state, segment_ids = call.output_final_state, call.segment_ids
  positions, axis_name = call.positions, call.axis_name
  if fn == "aft_local":
    check_window(fn, window)
  if fn == "aft_full" and (initial_state is not None or output_final_state):
    raise ValueError(
      "aft_full: initial_state and output_final_state are for aft_simple, aft_local and "
      "aft_conv1d; AFT-full's past is every key and value (decode with aft_full_step)"
    )
  conv = fn.startswith("aft_conv")
  if conv:
    _check_conv(fn, q, k, v, w, 2 if fn == "aft_conv2d" else 1)
  else:
    _check_qkv(fn, q, k, v)
  extras = dict(initial_state=initial_state, output_final_state=output_final_state)
  extras.update(offset=None if _zero(offset) else offset, segment_ids=segment_ids)
  extras.update(positions=positions, axis_name=axis_name)
  _check_causal(fn, causal, **extras)
  check_impl(fn, impl)
  mode = _mode(causal, initial_state, output_final_state, offset, segment_ids, positions, axis_name)
  if mode in ("packed", "sharded"):
    _check_alone(
      fn, mode, initial_state, output_final_state, offset, segment_ids=segment_ids,
      positions=positions,
    )  # fmt: skip
  call = call._replace(mode=mode)
  if conv:
    return _conv(call)
  if fn == "aft_local":
    return _local(call)
  if mode == "packed":
    segments.check(fn, q.shape, segment_ids, positions)
    if fn == "aft_full":
      check_float(fn, w=w)
      return call._replace(size=q.shape[-2])  # every key is in the band
    return call
  if fn == "aft_full":
    _check_w(fn, w, q.shape[-2])
  if mode == "state":
    shape = q.shape[:-2] + q.shape[-1:]
    _check_state(fn, initial_state, jax.eval_shape(lambda: steps.aft_simple_init(shape)))
  return call


def _conv(call: Call) -> Call:
  """AFT-conv1d's and AFT-conv2d's kernel sizes and (1-D) the state."""
  fn, q, k, v, kernel = call.fn, call.q, call.k, call.v, call.w
  # The implementation first (AFT-conv has no kernel: "pallas" is refused in every mode).
  registry.resolve(fn, call.impl, OpArgs(q, k, v, kernel, causal=call.causal))
  if fn == "aft_conv2d":
    kh, kw = kernel.shape[1:]
    if kh % 2 == 0 or kw % 2 == 0:
      raise ValueError(f"aft_conv2d: kernel sizes must be odd; got kernel {kernel.shape}")
    return call
  s = kernel.shape[-1]
  if s < 1 or (not call.causal and s % 2 == 0):
    raise ValueError(
      f"aft_conv1d: a non-causal kernel size must be odd (centred); got kernel {kernel.shape}"
    )
  if call.mode == "packed":
    segments.check(fn, k.shape, call.segment_ids, None)
  if call.mode == "state":
    k_t, v_t = k.shape[:-2] + k.shape[-1:], v.shape[:-3] + v.shape[-2:]
    expected = jax.eval_shape(lambda: steps.aft_conv1d_init(k_t, v_t, s))
    _check_state(fn, call.initial_state, expected)
  return call._replace(size=s)


def _local(call: Call) -> Call:
  """AFT-local's bias (dense, or kept as its factors where a piece or a shard forms only the
  blocks it reads), its offset and its state."""
  fn, q, w, window, mode = call.fn, call.q, call.w, call.size, call.mode
  t_len = q.shape[-2]
  if isinstance(w, (tuple, list)):  # the factors (u, v) of w = u v^T
    w = _factors(fn, w)
    long = pieces.in_sub_pieces(t_len, window)
    if mode == "packed" or not call.causal or (mode == "plain" and not long):
      w = w.dense()  # these read all of w; a short sequence in one call takes it dense
    elif mode == "plain":
      mode = "state"  # a long sequence given its factors: in sub-pieces, never [T, T]
  call = call._replace(mode=mode, w=w)
  if mode == "sharded":
    _check_bias(fn, w, t_len * jax.lax.axis_size(call.axis_name), 0)
  elif mode == "packed":
    segments.check(fn, q.shape, call.segment_ids, call.positions)
    check_float(fn, w=w)
  elif mode == "plain":
    _check_w(fn, w, t_len)
  else:
    shape = q.shape[:-2] + q.shape[-1:]
    expected = jax.eval_shape(lambda: steps.aft_local_init(shape, window))
    _check_state(fn, call.initial_state, expected)
    offset, guard = _offset(fn, call.offset, call.initial_state, w, t_len)
    call = call._replace(offset=offset, guard=guard)
  return call
