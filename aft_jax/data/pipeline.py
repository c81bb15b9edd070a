"""Language-model batches from a 1-D token stream: training windows or packed rows of whole
documents (``train_iterator``), evaluation batches (``eval_batches``); docs/data.md, "Batches"."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator

import numpy as np

_STATE_VERSION = 1


def _check_sharding(seq_len: int, global_batch_size: int, process_index: int, process_count: int):
  """The rows of the global batch this process takes."""
  if seq_len <= 0:
    raise ValueError(f"seq_len={seq_len} must be positive")
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
  local = global_batch_size // process_count
  return slice(process_index * local, (process_index + 1) * local)


def _windows(tokens, seq_len: int, rows: slice, window_ids) -> dict[str, np.ndarray]:
  """This process's ``rows`` of the windows ``window_ids``: inputs and targets int32[b, L]."""
  ids = np.asarray(window_ids)[rows]
  pos = ids[:, None].astype(np.int64) * (seq_len + 1) + np.arange(seq_len + 1)
  w = np.asarray(tokens[pos], dtype=np.int32)  # [b, L+1]; reads only these rows of a memmap
  return {"inputs": w[:, :-1], "targets": w[:, 1:]}


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Piece j is the stream's pairs [start[j], start[j] + length[j]) at ``offset[j]`` in its row;
  row r holds pieces first[r]:first[r + 1]."""

  start: np.ndarray
  length: np.ndarray
  offset: np.ndarray
  first: np.ndarray
  num_documents: int

  @property
  def num_rows(self) -> int:
    return self.first.size - 1


def plan_rows(document_ends: np.ndarray, seq_len: int, num_tokens: int) -> _Plan:
  """Documents packed in order, next-fit, into rows of ``seq_len`` pairs (a longer one in pieces):
  an index set, shuffled and checkpointed as windows are (grain's packers reorder and buffer)."""
  ends = np.asarray(document_ends, np.int64)
  starts = np.concatenate([[0], ends[:-1]]) if ends.ndim == 1 else ends
  sizes = ends - starts
  if ends.ndim != 1 or ends.size == 0 or ends[-1] != num_tokens or (sizes <= 0).any():
    raise ValueError(
      f"document_ends must be int[documents], increasing, ending at len(tokens) = {num_tokens}; "
      f"got shape {ends.shape}, {ends.reshape(-1)[:8]}..."
    )
  count = -(-sizes // seq_len)  # pieces per document
  doc = np.repeat(np.arange(ends.size), count)
  k = np.arange(doc.size) - np.repeat(np.cumsum(count) - count, count)  # piece k of its doc
  start = starts[doc] + k * seq_len
  length = np.minimum(seq_len, ends[doc] - start)
  # Next-fit is sequential (a row's fill depends on every piece before it): one pass.
  offset = np.empty_like(length)
  new_row = np.zeros(length.size, bool)
  fill = seq_len
  for j, n in enumerate(length.tolist()):
    if fill + n > seq_len:
      new_row[j], fill = True, 0
    offset[j], fill = fill, fill + n
  first = np.append(np.flatnonzero(new_row), length.size)
  return _Plan(start, length, offset, first, int(ends.size))


def _packed_rows(tokens, plan: _Plan, n: int, bos_id: int, mine: slice, row_ids) -> dict:
  """This process's rows ``mine`` of the packed rows ``row_ids``."""
  rows = np.asarray(row_ids)[mine]
  # The pieces of these rows, flattened: which output row, where, and their pairs.
  lo, hi = plan.first[rows], plan.first[rows + 1]
  count = hi - lo
  piece = np.concatenate([np.arange(a, z) for a, z in zip(lo, hi)])
  out_row = np.repeat(np.arange(rows.size), count)
  seg = np.arange(piece.size) - np.repeat(np.cumsum(count) - count, count) + 1
  length = plan.length[piece]
  step = np.arange(length.sum()) - np.repeat(np.cumsum(length) - length, length)
  r, col = np.repeat(out_row, length), np.repeat(plan.offset[piece], length) + step
  pair = np.repeat(plan.start[piece], length) + step  # stream index of each target
  keys = ("inputs", "targets", "segment_ids", "positions")
  out = {k: np.zeros((rows.size, n), np.int32) for k in keys}
  out["targets"][r, col] = tokens[pair]
  out["inputs"][r, col] = np.where(pair == 0, bos_id, tokens[np.maximum(pair - 1, 0)])
  out["segment_ids"][r, col] = np.repeat(seg, length)
  out["positions"][r, col] = step
  out["weights"] = (out["segment_ids"] > 0).astype(np.float32)
  return out


class TrainIterator:
  """Infinite training batches; `set_state(get_state())` (a JSON dict) on an iterator of the same
  arguments, any process_count, continues with exactly the batches that would have followed."""

  def __init__(self, dataset, fingerprint: dict, packing: dict | None = None):
    self._dataset, self._fingerprint = dataset, fingerprint
    # None for stream windows; for packed rows {"rows", "documents", "padding_fraction"}.
    self.packing = packing
    self._it = self._new_iterator()

  def _new_iterator(self):
    import grain  # pylint: disable=g-import-not-at-top

    # grain's default (16 threads, 500 batches ahead) keeps the CPU busy far ahead of a step.
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
    """A one-line ValueError unless this iterator can continue ``state`` (of ``since``)."""
    if state.get("version") != _STATE_VERSION:
      raise ValueError(
        f"the data position in {since} has format version {state.get('version')!r}, this "
        f"version of aft_jax reads {_STATE_VERSION}: resume it with the aft_jax that wrote it"
      )
    # Every key either side; a stream position has no packing keys (packing = False).
    keys = [k for k in state if k not in ("version", "grain")] + list(self._fingerprint)
    was, now = {"packing": False, **state}, {"packing": False, **self._fingerprint}
    mismatched = list(dict.fromkeys(k for k in keys + ["packing"] if was.get(k) != now.get(k)))
    if "packing" in mismatched:
      mismatched = [k for k in mismatched if k != "num_documents"]
    if "num_tokens" in mismatched:
      raise ValueError(
        f"the train split has {self._fingerprint['num_tokens']:,} tokens, {since} was trained "
        f"on {state.get('num_tokens'):,}: its source files changed since; a run resumes only "
        "on the data it was trained on: restore the files, or use another --workdir"
      )
    if mismatched:
      differ = ", ".join(f"{k} = {was.get(k)!r} (now {now.get(k)!r})" for k in mismatched)
      raise ValueError(
        f"the data position in {since} is for {differ}: the batches that follow it cannot be "
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
  document_ends: np.ndarray | None = None,
  bos_id: int | None = None,
) -> TrainIterator:
  """Shuffled, sharded, infinite, checkpointable batches of int32[B // process_count, L] of the
  ids ``tokens`` (a memmap is fine); epoch e shuffles with seed + e (docs/data.md, "Batches").
  ``document_ends`` (``Corpus.documents``): packed rows of whole documents, the first one's first
  input ``bos_id``, with weights; None: windows of the stream."""
  rows = _check_sharding(seq_len, global_batch_size, process_index, process_count)
  tokens = np.asarray(tokens)  # a memmap stays memory-mapped
  if tokens.ndim != 1:
    raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
  fingerprint = dict(seed=int(seed), seq_len=int(seq_len), global_batch_size=int(global_batch_size))
  fingerprint["num_tokens"] = int(tokens.shape[0])
  packing = None
  if document_ends is not None:
    if bos_id is None:
      raise ValueError("train_iterator: packed rows (document_ends) need bos_id")
    plan = plan_rows(document_ends, seq_len, tokens.shape[0])
    if plan.num_rows < global_batch_size:
      raise ValueError(
        f"split too short: {plan.num_documents} documents pack into {plan.num_rows} rows of "
        f"seq_len={seq_len}, fewer than global_batch_size={global_batch_size}"
      )
    num_items = plan.num_rows
    gather = functools.partial(_packed_rows, tokens, plan, seq_len, int(bos_id), rows)
    fingerprint.update(packing=True, num_documents=plan.num_documents)
    padding = 1.0 - float(plan.length.sum()) / (plan.num_rows * seq_len)
    packing = {"rows": plan.num_rows, "documents": plan.num_documents, "padding_fraction": padding}
  else:
    num_items = tokens.shape[0] // (seq_len + 1)
    gather = functools.partial(_windows, tokens, seq_len, rows)
    if num_items < global_batch_size:
      raise ValueError(
        f"split too short: len(tokens)={tokens.shape[0]} gives {num_items} windows of "
        f"seq_len+1={seq_len + 1}, fewer than global_batch_size={global_batch_size}"
      )
  import grain  # pylint: disable=g-import-not-at-top  (imports jax; keep `aft_jax.data` light)

  ds = (
    grain.MapDataset.range(num_items)
    .shuffle(seed=seed)  # epoch e of the repeat below is shuffled with seed + e
    .batch(global_batch_size, drop_remainder=True)
    .repeat()
    .map(gather)
  )
  return TrainIterator(ds, fingerprint, packing)


def _eval_plan(n: int, seq_len: int, stride: int | None):
  """(start, lo, hi): window k predicts tokens [start_k, start_k + L) and counts [lo_k, hi_k)."""
  if n <= 0:
    raise ValueError(f"split too short: len(tokens)={n}, nothing to evaluate")
  if stride is None or stride == seq_len:
    # Disjoint windows; the last one is padded.
    start = np.arange(0, n, seq_len, dtype=np.int64)
    return start, start, np.minimum(start + seq_len, n)
  if not 0 < stride < seq_len:
    raise ValueError(f"stride={stride} must be in (0, seq_len={seq_len}] or None")
  # Sliding windows: each after the first counts the next `stride` targets at the end of a full
  # window, so that each counted target sees at least L - stride earlier tokens.
  extra = max(0, n - seq_len)
  k = np.arange(1, 1 + math.ceil(extra / stride), dtype=np.int64)
  lo = np.concatenate([[0], seq_len + (k - 1) * stride])
  hi = np.minimum(np.concatenate([[seq_len], seq_len + k * stride]), n)
  start = np.maximum(hi - seq_len, 0)
  return start, lo, hi


def num_eval_batches(
  num_tokens: int, *, seq_len: int, global_batch_size: int, stride: int | None = None
) -> int:
  """Number of batches `eval_batches` yields (the same on every process)."""
  _check_sharding(seq_len, global_batch_size, 0, 1)
  return math.ceil(_eval_plan(num_tokens, seq_len, stride)[0].size / global_batch_size)


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
  """Batches {'inputs', 'targets', 'weights'} of [local_B, L] in which every token of `tokens`
  (int[n]; the first one's context ``bos_id``) is a target of weight 1 once (0: context, padding).
  ``stride``: None for disjoint windows; S < L for sliding windows counting their last S targets
  (the first window all of its)."""
  mine = _check_sharding(seq_len, global_batch_size, process_index, process_count)
  n = int(np.shape(tokens)[0])
  start, lo, hi = _eval_plan(n, seq_len, stride)
  offsets = np.arange(seq_len, dtype=np.int64)
  for b in range(math.ceil(start.size / global_batch_size)):
    rows = b * global_batch_size + np.arange(mine.start, mine.stop)
    valid_row = rows < start.size  # rows past the last window are all padding
    r = np.minimum(rows, start.size - 1)
    pos = start[r][:, None] + offsets  # target positions, [local, L]
    real = valid_row[:, None]
    targets = np.where(real & (pos < n), tokens[np.minimum(pos, n - 1)], 0).astype(np.int32)
    # The context of target t is token t-1, or bos_id for t = 0.
    prev = np.where(pos <= n, tokens[np.clip(pos - 1, 0, n - 1)], 0)
    inputs = np.where(real, np.where(pos == 0, bos_id, prev), 0).astype(np.int32)
    weights = (pos >= lo[r][:, None]) & (pos < hi[r][:, None]) & real
    yield {"inputs": inputs, "targets": targets, "weights": weights.astype(np.float32)}
