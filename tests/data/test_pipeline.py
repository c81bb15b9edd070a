"""Training and evaluation batches: shapes, coverage, sharding, checkpointing."""

import json

import numpy as np
import pytest

from aft_jax.data import pipeline

L = 8


def _tokens(n, seed=0):
  # Distinct values make every window identifiable by its first token.
  return np.random.default_rng(seed).permutation(n).astype(np.uint32)


def _take(it, k):
  return [next(it) for _ in range(k)]


def _train(toks, **kw):
  return pipeline.train_iterator(toks, **{"seq_len": L, "global_batch_size": 4, "seed": 0, **kw})


def _window_ids(batches, tokens):
  """Window index of each row (its first input token is unique)."""
  where = {int(t): i for i, t in enumerate(tokens)}
  starts = [where[int(r[0])] for b in batches for r in b["inputs"]]
  assert all(s % (L + 1) == 0 for s in starts)
  return [s // (L + 1) for s in starts]


def test_train_batches_are_windows_of_the_stream_each_once_an_epoch_in_a_new_order():
  toks = _tokens(9 * 40 + 5)  # 40 windows, 5 left-over tokens
  it = _train(toks, global_batch_size=8, seed=3)
  epochs = []
  for _ in range(3):
    batches = _take(it, 5)
    for b in batches:
      assert set(b) == {"inputs", "targets"} and b["inputs"].dtype == b["targets"].dtype == np.int32
      for row_in, row_tg, w in zip(b["inputs"], b["targets"], _window_ids([b], toks)):
        window = toks[w * (L + 1) : (w + 1) * (L + 1)]
        np.testing.assert_array_equal(row_in, window[:-1])
        np.testing.assert_array_equal(row_tg, window[1:])
    epochs.append(_window_ids(batches, toks))
    assert sorted(epochs[-1]) == list(range(40))  # 40 % 8 == 0: every window exactly once
  assert epochs[0] != epochs[1] != epochs[2]
  assert _window_ids(_take(_train(toks, global_batch_size=8, seed=3), 5), toks) == epochs[0]
  assert _window_ids(_take(_train(toks, global_batch_size=8, seed=4), 5), toks) != epochs[0]
  toks = _tokens(9 * 10)  # 10 windows, batches of 4: the remainder is dropped, batches full
  it = _train(toks, seed=1)
  for _ in range(3):
    assert len(set(_window_ids(_take(it, 2), toks))) == 8


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shards_concatenate_to_the_global_batch(process_count):
  toks = _tokens(2000)
  full = _take(_train(toks, global_batch_size=8, seed=5), 30)
  kw = dict(global_batch_size=8, seed=5, process_count=process_count)
  shards = [_take(_train(toks, process_index=p, **kw), 30) for p in range(process_count)]
  for step in range(30):
    for key in ("inputs", "targets"):
      parts = [shards[p][step][key] for p in range(process_count)]
      assert all(part.shape == (8 // process_count, L) for part in parts)
      np.testing.assert_array_equal(np.concatenate(parts), full[step][key])


def test_checkpoint_restores_the_following_batches():
  toks = _tokens(3000)
  it = _train(toks, seed=7)
  _take(it, 5)
  state = json.loads(json.dumps(it.get_state()))  # must survive JSON
  expected = _take(it, 3)
  fresh = _train(toks, seed=7)
  fresh.set_state(state)
  for a, b in zip(_take(fresh, 3), expected):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    np.testing.assert_array_equal(a["targets"], b["targets"])
  half = _train(toks, seed=7, process_index=1, process_count=2)  # the state counts global batches
  half.set_state(state)
  np.testing.assert_array_equal(next(half)["inputs"], expected[0]["inputs"][2:])
  with pytest.raises(ValueError, match=r"is for seed = 7 \(now 8\): the batches that follow"):
    _train(toks, seed=8).set_state(state)
  # Another length of the train split: the source files changed, said as such.
  with pytest.raises(ValueError, match="has 3,100 tokens, step 5 was trained on 3,000: its sou"):
    _train(_tokens(3100), seed=7).check_state(state, "step 5")


def _collect(tokens, *, stride, global_batch_size=4, **kw):
  kw = dict(seq_len=L, global_batch_size=global_batch_size, bos_id=999, stride=stride, **kw)
  return list(pipeline.eval_batches(tokens, **kw))


# (function, its arguments, the error): train_iterator on 100 tokens, eval_batches on 10.
ARGUMENT_ERRORS = [
  ("train", dict(global_batch_size=6, process_count=4), "global_batch_size=6 is not divisible"),
  ("train", dict(global_batch_size=16), r"len\(tokens\)=100 .* global_batch_size=16"),
  ("train", dict(process_index=2, process_count=2), r"process_index=2 must be in \[0, process_co"),
  ("train", dict(seq_len=0), "seq_len=0 must be positive"),
  ("train", dict(global_batch_size=0), "global_batch_size=0 and process_count=1 must be positive"),
  ("eval", dict(stride=9), r"stride=9 must be in \(0, seq_len=8\]"),
  ("eval", dict(stride=0), "stride=0"),
  ("eval", dict(global_batch_size=3, process_count=2), "not divisible"),
  ("eval", dict(tokens=np.arange(0)), "too short"),
  ("count", dict(seq_len=0), "seq_len=0 must be positive"),
]


@pytest.mark.parametrize("call, kw, message", ARGUMENT_ERRORS)
def test_argument_errors_are_one_line_naming_the_argument(call, kw, message):
  kw = dict(kw)
  with pytest.raises(ValueError, match=message) as e:
    if call == "train":
      _train(_tokens(100), **{"global_batch_size": 2, **kw})
    elif call == "eval":
      _collect(kw.pop("tokens", np.arange(10)), **{"stride": None, **kw})
    else:
      pipeline.num_eval_batches(10, global_batch_size=4, **kw)
  assert "\n" not in str(e.value)


def _weighted(batches):
  """(target, its context token, column) of each weighted position, in row order."""
  out = []
  for b in batches:
    for r, c in zip(*np.nonzero(b["weights"])):
      out.append((int(b["targets"][r, c]), int(b["inputs"][r, c]), int(c)))
  return out


@pytest.mark.parametrize("n", [1, 7, 8, 9, 50, 64, 101])
@pytest.mark.parametrize("stride", [None, 8, 3, 1])
def test_eval_covers_every_token_once(n, stride):
  toks = (np.arange(n) + 1).astype(np.uint32)
  batches = _collect(toks, stride=stride)
  assert len(batches) == pipeline.num_eval_batches(n, seq_len=L, global_batch_size=4, stride=stride)
  for b in batches:
    assert b["inputs"].shape == b["targets"].shape == b["weights"].shape == (4, L)
    assert b["inputs"].dtype == b["targets"].dtype == np.int32 and b["weights"].dtype == np.float32
    assert set(np.unique(b["weights"])) <= {0.0, 1.0}
    for r in np.flatnonzero(b["weights"].any(axis=1)):  # the stream shifted by one in a row
      np.testing.assert_array_equal(b["inputs"][r, 1:], b["targets"][r, :-1])
  got = _weighted(batches)
  assert [t for t, _, _ in got] == toks.tolist()  # in order: the token stream, each once
  assert [c for _, c, _ in got] == [999] + toks[:-1].tolist()  # the context: bos, then the last
  if stride is not None and stride < L and n > L:  # each later counted target sees L - stride
    assert all(j >= L - stride for _, _, j in got[L:])


@pytest.mark.parametrize("stride", [None, 3])
def test_eval_sharded_union_is_the_stream(stride):
  toks = (np.arange(203) + 1).astype(np.uint32)
  single = _collect(toks, stride=stride)
  per_process = [_collect(toks, stride=stride, process_index=p, process_count=2) for p in range(2)]
  assert len(per_process[0]) == len(per_process[1]) == len(single)
  for i, b in enumerate(single):
    for k in b:
      np.testing.assert_array_equal(np.concatenate([pp[i][k] for pp in per_process]), b[k])
  assert per_process[0][0]["inputs"].shape == (2, L)


def test_eval_every_process_same_batch_count_with_uneven_rows_and_a_memmap_is_read(tmp_path):
  toks = (np.arange(5 * L) + 1).astype(np.uint32)  # 5 windows, 4 rows per batch: 2 batches
  shards = [_collect(toks, stride=None, process_index=p, process_count=4) for p in range(4)]
  assert [len(b) for b in shards] == [2, 2, 2, 2]
  last = shards[3][-1]
  assert last["weights"].sum() == 0 and not last["inputs"].any()  # pure padding row
  np.save(tmp_path / "t.npy", (np.arange(77) + 3).astype(np.uint32))
  toks = np.load(tmp_path / "t.npy", mmap_mode="r")
  assert [t for t, _, _ in _weighted(_collect(toks, stride=5))] == (np.arange(77) + 3).tolist()
  assert next(_train(toks, global_batch_size=2))["inputs"].shape == (2, L)


def _documents(seed=0, n=60):
  """A stream of n documents of 1..3L tokens (ids distinct), and their ends."""
  ends = np.cumsum(np.random.default_rng(seed).integers(1, 3 * L, size=n))
  return _tokens(int(ends[-1]), seed), ends


def _packed(toks, ends, **kw):
  return _train(toks, document_ends=ends, bos_id=9999, **kw)


def test_packed_rows_hold_whole_documents_in_order_with_padding_at_the_end():
  """Segments: whole documents (or row-sized pieces), positions from 0; padding last, weight 0."""
  toks, ends = _documents()
  it = _packed(toks, ends)
  plan = pipeline.plan_rows(ends, L, int(ends[-1]))
  per_epoch = plan.num_rows // 4
  where = {int(t): i for i, t in enumerate(toks)}
  starts = set(np.concatenate([[0], ends[:-1]]).tolist())
  seen = []
  for b in _take(it, per_epoch):
    assert set(b) == {"inputs", "targets", "weights", "segment_ids", "positions"}
    for row in range(4):
      seg, pos, w = b["segment_ids"][row], b["positions"][row], b["weights"][row]
      real = seg > 0
      assert real[: real.sum()].all()  # the pads (if any) are the row's end
      np.testing.assert_array_equal(w, real.astype(np.float32))
      idx = np.array([where[int(t)] for t in b["targets"][row][real]])
      seen += idx.tolist()
      ids = seg[real]
      assert (np.diff(ids) >= 0).all() and (np.diff(idx) > 0).all()  # documents in corpus order
      for s in np.unique(ids):
        piece = idx[ids == s]
        np.testing.assert_array_equal(pos[real][ids == s], np.arange(piece.size))
        assert (np.diff(piece) == 1).all()
        # A piece is a document or a row-sized cut of one (from its start); it crosses no end.
        assert (piece[0] - max(e for e in starts if e <= piece[0])) % L == 0
        assert not any(piece[0] < e < piece[-1] + 1 for e in ends)
        first = np.where(piece[0] == 0, 9999, toks[max(piece[0] - 1, 0)])
        assert b["inputs"][row][real][ids == s][0] == first
        np.testing.assert_array_equal(b["inputs"][row][real][ids == s][1:], toks[piece[:-1]])
  # Rows cover every pair once per epoch (but those of the rows the batches dropped).
  assert len(seen) == len(set(seen)) >= toks.size - (plan.num_rows % 4) * L
  assert it.packing["rows"] == plan.num_rows and 0 < it.packing["padding_fraction"] < 0.5
  padding = 1 - len(seen) / (per_epoch * 4 * L)
  assert padding == pytest.approx(it.packing["padding_fraction"], abs=0.1)


def test_packed_checkpoint_restores_the_following_batches_and_refuses_a_stream_state():
  toks, ends = _documents(1)
  it = _packed(toks, ends, seed=3)
  _take(it, 7)
  state = json.loads(json.dumps(it.get_state()))
  expected = _take(it, 5)
  fresh = _packed(toks, ends, seed=3)
  fresh.set_state(state)
  for a, b in zip(_take(fresh, 5), expected):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  # Said as the setting (a stream position has no packing keys), the documents left out.
  with pytest.raises(ValueError, match=r"is for packing = True \(now False\): the batches"):
    _train(toks, seed=3).set_state(state)
  stream = _train(toks, seed=3).get_state()
  with pytest.raises(ValueError, match=r"is for packing = False \(now True\): the batches"):
    _packed(toks, ends, seed=3).set_state(stream)
  with pytest.raises(ValueError, match=r"is for seed = 3 \(now 4\), packing = False \(now Tr"):
    _packed(toks, ends, seed=4).set_state(stream)
  with pytest.raises(ValueError, match="document_ends must be int.*ending at len"):
    _packed(toks, ends[:-1])
  with pytest.raises(ValueError, match="pack into .* rows of seq_len=8, fewer than global_batch"):
    _packed(toks[: ends[0]], ends[:1])  # one document: at most 3 rows
