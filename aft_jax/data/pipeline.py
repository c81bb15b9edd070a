"""Language-model batches from a 1-D token stream.

Training (`train_iterator`): the split is cut into non-overlapping windows of
`seq_len + 1` tokens, window w = tokens[w*(L+1) : (w+1)*(L+1)], inputs = w[:-1],
targets = w[1:]. Each epoch visits the windows in a fresh order (grain's
index shuffle with seed `seed + epoch`), batches of `global_batch_size`
windows drop the epoch's remainder, and epochs repeat forever. Process p of P
receives rows [p*B/P, (p+1)*B/P) of every global batch, so the global batch
does not depend on P.

Evaluation (`eval_batches`): every token is a weighted target exactly once;
the first one gets `bos_id` as its context. Rows are padded with weight 0 so
that all batches have the same static shape and every process yields the same
number of batches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np

_STATE_VERSION = 1


def _check_sharding(global_batch_size: int, process_index: int, process_count: int) -> int:
  if global_batch_size <= 0 or process_count <= 0:
    raise ValueError(
      f"global_batch_size={global_batch_size} and process_count={process_count} must be positive"
    )
  if global_batch_size % process_count:
    raise ValueError(
      f"global_batch_size={global_batch_size} is not divisible by process_count={process_count}"
    )
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
  return global_batch_size // process_count


@dataclasses.dataclass(frozen=True)
class _Windows:
  """Gathers rows of windows: ids int[b] -> {'inputs','targets': int32[b, L]}."""

  tokens: np.ndarray
  seq_len: int
  row_slice: slice  # this process's rows of the global batch

  def __call__(self, window_ids: np.ndarray) -> dict[str, np.ndarray]:
    ids = np.asarray(window_ids)[self.row_slice]
    pos = ids[:, None].astype(np.int64) * (self.seq_len + 1) + np.arange(self.seq_len + 1)
    w = np.asarray(self.tokens[pos], dtype=np.int32)  # [b, L+1]; reads only these rows of a memmap
    return {"inputs": w[:, :-1], "targets": w[:, 1:]}


class TrainIterator:
  """Infinite iterator of `{'inputs','targets': int32[local_B, seq_len]}`.

  `get_state()` is a JSON-serialisable dict; `set_state(state)` on an iterator
  built with the same arguments continues with exactly the batches that would
  have followed. The state counts global batches, so it may be restored with
  a different process_count.
  """

  def __init__(self, dataset, fingerprint: dict):
    """`dataset`: a `grain.MapDataset` of batches."""
    self._dataset = dataset
    self._fingerprint = fingerprint
    self._it = self._new_iterator()

  def _new_iterator(self):
    import grain  # pylint: disable=g-import-not-at-top

    # grain's default (16 threads, 500 batches ahead) would keep the CPU busy
    # far ahead of a training step; a few batches hide the gather latency.
    return iter(
      self._dataset.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
    )

  def __iter__(self) -> "TrainIterator":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._it)

  def get_state(self) -> dict:
    return {"version": _STATE_VERSION, **self._fingerprint, "grain": self._it.get_state()}

  def check_state(self, state: dict, since: str = "the checkpoint") -> None:
    """Raises a one-line ValueError unless ``state`` (``get_state``'s, of ``since``) can be
    continued by this iterator: the same train split length, seq_len, batch and seed."""
    if state.get("version") != _STATE_VERSION:
      raise ValueError(
        f"the data position in {since} has format version {state.get('version')!r}, this "
        f"version of aft_jax reads {_STATE_VERSION}: resume it with the aft_jax that wrote it"
      )
    mismatched = [k for k, v in self._fingerprint.items() if state.get(k) != v]
    if "num_tokens" in mismatched:
      raise ValueError(
        f"the train split has {self._fingerprint['num_tokens']:,} tokens, {since} was trained "
        f"on {state.get('num_tokens'):,}: its source files changed since; a run resumes only "
        "on the data it was trained on: restore the files, or use another --workdir"
      )
    if mismatched:
      was = ", ".join(f"{k} = {state.get(k)!r} (now {self._fingerprint[k]!r})" for k in mismatched)
      raise ValueError(
        f"the data position in {since} is for {was}: the batches that follow it cannot be "
        "reproduced; resume with those settings, or use another --workdir"
      )

  def set_state(self, state: dict) -> None:
    self.check_state(state)
    self._it = self._new_iterator()
    self._it.set_state(state["grain"])


def train_iterator(
  tokens: np.ndarray,
  *,
  seq_len: int,
  global_batch_size: int,
  seed: int,
  process_index: int = 0,
  process_count: int = 1,
) -> TrainIterator:
  """Shuffled, sharded, infinite, checkpointable training batches (see module doc).

  Args:
    tokens: uint32/int[n] ids of the training split (a memmap is fine).
    seq_len: L, the model's context length.
    global_batch_size: B, rows per step over all processes.
    seed: shuffle seed in [0, 2**32); epoch e uses seed + e.
    process_index, process_count: this JAX process and the number of them.

  Returns:
    An iterator of dicts of int32[B // process_count, L].
  """
  local = _check_sharding(global_batch_size, process_index, process_count)
  if seq_len <= 0:
    raise ValueError(f"seq_len={seq_len} must be positive")
  tokens = np.asarray(tokens)  # a memmap stays memory-mapped
  if tokens.ndim != 1:
    raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
  num_windows = tokens.shape[0] // (seq_len + 1)
  if num_windows < global_batch_size:
    raise ValueError(
      f"split too short: len(tokens)={tokens.shape[0]} gives {num_windows} windows of "
      f"seq_len+1={seq_len + 1}, "
      f"fewer than global_batch_size={global_batch_size}"
    )
  import grain  # pylint: disable=g-import-not-at-top  (imports jax; keep `aft_jax.data` light)

  rows = slice(process_index * local, (process_index + 1) * local)
  ds = (
    grain.MapDataset.range(num_windows)
    .shuffle(seed=seed)  # epoch e of the repeat below is shuffled with seed + e
    .batch(global_batch_size, drop_remainder=True)
    .repeat()
    .map(_Windows(tokens, seq_len, rows))
  )
  fingerprint = {
    "seed": int(seed),
    "seq_len": int(seq_len),
    "global_batch_size": int(global_batch_size),
    "num_tokens": int(tokens.shape[0]),
  }
  return TrainIterator(ds, fingerprint)


@dataclasses.dataclass(frozen=True)
class _EvalPlan:
  """Window k predicts tokens [start_k, start_k + L) and counts [lo_k, hi_k)."""

  start: np.ndarray
  lo: np.ndarray
  hi: np.ndarray


def _eval_plan(n: int, seq_len: int, stride: int | None) -> _EvalPlan:
  if seq_len <= 0:
    raise ValueError(f"seq_len={seq_len} must be positive")
  if n <= 0:
    raise ValueError(f"split too short: len(tokens)={n}, nothing to evaluate")
  if stride is None or stride == seq_len:
    # Disjoint windows; the last one is padded.
    start = np.arange(0, n, seq_len, dtype=np.int64)
    return _EvalPlan(start, start, np.minimum(start + seq_len, n))
  if not 0 < stride < seq_len:
    raise ValueError(f"stride={stride} must be in (0, seq_len={seq_len}] or None")
  # Sliding windows: the first counts its L targets, each later one the next
  # `stride` targets, placed at the end of a full window so that each counted
  # target sees at least L - stride earlier tokens.
  extra = max(0, n - seq_len)
  k = np.arange(1, 1 + math.ceil(extra / stride), dtype=np.int64)
  lo = np.concatenate([[0], seq_len + (k - 1) * stride])
  hi = np.minimum(np.concatenate([[seq_len], seq_len + k * stride]), n)
  start = np.maximum(hi - seq_len, 0)
  return _EvalPlan(start, lo, hi)


def num_eval_batches(
  num_tokens: int, *, seq_len: int, global_batch_size: int, stride: int | None = None
) -> int:
  """Number of batches `eval_batches` yields (the same on every process)."""
  return math.ceil(_eval_plan(num_tokens, seq_len, stride).start.size / global_batch_size)


def eval_batches(
  tokens: np.ndarray,
  *,
  seq_len: int,
  global_batch_size: int,
  bos_id: int,
  stride: int | None = None,
  process_index: int = 0,
  process_count: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
  """Batches covering every token of `tokens` exactly once as a weighted target.

  Args:
    tokens: int[n] ids of the split.
    seq_len: L.
    global_batch_size: B; each process yields B // process_count rows.
    bos_id: context of the first token.
    stride: None for disjoint windows; S < L for sliding windows that count
      only their last S targets (the first window counts all of its targets).
    process_index, process_count: as in `train_iterator`.

  Yields:
    {'inputs', 'targets': int32[local_B, L], 'weights': float32[local_B, L]};
    weights are 1 on counted targets and 0 on context and padding.
  """
  local = _check_sharding(global_batch_size, process_index, process_count)
  n = int(np.shape(tokens)[0])
  plan = _eval_plan(n, seq_len, stride)
  offsets = np.arange(seq_len, dtype=np.int64)
  num_batches = math.ceil(plan.start.size / global_batch_size)
  for b in range(num_batches):
    first = b * global_batch_size + process_index * local
    rows = np.arange(first, first + local)
    valid_row = rows < plan.start.size  # rows past the last window are all padding
    r = np.minimum(rows, plan.start.size - 1)
    pos = plan.start[r][:, None] + offsets  # target positions, [local, L]
    real = valid_row[:, None]
    targets = np.where(real & (pos < n), tokens[np.minimum(pos, n - 1)], 0).astype(np.int32)
    # The context of target t is token t-1, or bos_id for t = 0.
    prev = np.where(pos <= n, tokens[np.clip(pos - 1, 0, n - 1)], 0)
    inputs = np.where(real, np.where(pos == 0, bos_id, prev), 0).astype(np.int32)
    weights = (pos >= plan.lo[r][:, None]) & (pos < plan.hi[r][:, None]) & real
    yield {"inputs": inputs, "targets": targets, "weights": weights.astype(np.float32)}
