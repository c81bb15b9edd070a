"""`load_corpus`: its config, the default data folder, process 0 preparing behind a barrier."""

import os
import threading

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils

from aft_jax.data import config as data_config
from aft_jax.data import corpus as corpus_lib
from aft_jax.data import enwik8, prepare, sources, store
from aft_jax.data.config import DataConfig
from tests.support import fake_enwik8 as fe


def test_default_data_dir_is_absolute_and_per_user(tmp_path, monkeypatch):
  monkeypatch.delenv("AFT_JAX_DATA", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert data_config.default_data_dir() == str(tmp_path / "home" / ".cache" / "aft_jax")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("AFT_JAX_DATA", "relative/data")
  assert data_config.resolve_data_dir("") == str(tmp_path / "relative" / "data")
  assert data_config.resolve_data_dir("mine") == str(tmp_path / "mine")


def _two_processes(tmp_path, monkeypatch):
  """load_corpus as processes 1, 0 in two threads: ({index: result}, [(event, index), ...])."""
  events, barrier, results = [], threading.Barrier(2, timeout=60), {}
  real_prepare, real_load = prepare.prepare_corpus, corpus_lib.load_prepared
  record = lambda event: events.append((event, int(threading.current_thread().name)))  # noqa: E731

  def prepare_spy(*args, **kwargs):
    record("prepare")
    return real_prepare(*args, **kwargs)

  def load_spy(path):
    record("load:complete" if store.is_complete(path) else "load:incomplete")
    return real_load(path)

  def fake_barrier(name):
    assert name == corpus_lib.BARRIER_NAME
    record("barrier")
    barrier.wait()

  def run(index):
    cfg = DataConfig("enwik8", data_dir=str(tmp_path / "data"), manual_dir=str(tmp_path / "manual"))
    try:
      results[index] = corpus_lib.load_corpus(cfg)
    except Exception as e:  # pylint: disable=broad-except  (checked by the caller)
      results[index] = e

  monkeypatch.setattr(prepare, "prepare_corpus", prepare_spy)
  monkeypatch.setattr(corpus_lib, "load_prepared", load_spy)
  monkeypatch.setattr(jax, "process_index", lambda: int(threading.current_thread().name))
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "sync_global_devices", fake_barrier)
  # Process 1 starts first: it must wait for process 0 instead of preparing.
  threads = [threading.Thread(target=run, args=(i,), name=str(i)) for i in (1, 0)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert [e for e in events if e[0] == "prepare"] == [("prepare", 0)]
  return results, events


@pytest.mark.usefixtures("offline")
def test_only_process_zero_prepares_and_a_failure_there_leaves_no_other_waiting(
  tmp_path, monkeypatch
):
  (tmp_path / "manual").mkdir()  # no data: process 0 fails to prepare
  results, _ = _two_processes(tmp_path, monkeypatch)
  assert isinstance(results[0], sources.MissingDataError)
  assert isinstance(results[1], FileNotFoundError)  # not a hang, not a second prepare
  assert "not a complete prepared corpus" in str(results[1])
  assert not os.path.exists(tmp_path / "data" / "prepared" / "enwik8-byte")
  fe.write_file(str(tmp_path / "manual"), fe.content(2_003))
  results, events = _two_processes(tmp_path, monkeypatch)
  # Process 1 passes the barrier only after process 0 prepared, so it reads complete data.
  assert events.index(("prepare", 0)) < events.index(("barrier", 0))
  assert ("load:complete", 1) in events and ("load:incomplete", 1) not in events
  for index in (0, 1):
    got = b"".join(results[index].splits[s].astype(np.uint8).tobytes() for s in enwik8.SPLITS)
    assert got == fe.content(2_003)


@pytest.mark.parametrize(
  "cfg,message",
  [
    ({"dataset": "enwik9"}, "config.data.dataset = 'enwik9' is not one of pydoc, wikitext103"),
    ({"dataset": "enwik8", "tokenizer": "word"}, "tokenizer = 'word': enwik8 is bytes"),
    ({"dataset": "pydoc", "tokenizer": "subword"}, "tokenizer = 'subword': pydoc is bytes or wo"),
    ({"dataset": "enwik8", "official": "maybe"}, "official = 'maybe' is not one of auto, yes, no"),
    ({"dataset": "wikitext103", "variant": "v2"}, "variant = 'v2' is not one of v1, raw_v1"),
    ({"dataset": "enwik8", "packing": True}, "packing = True: enwik8 is one stream of tokens"),
  ],
)
def test_bad_fields_are_one_line_errors_before_any_io(cfg, message):
  with pytest.raises(ValueError, match=message) as e:
    DataConfig.of(cfg).validate()
  assert "\n" not in str(e.value)
  with pytest.raises(TypeError, match="load_corpus takes a DataConfig"):
    corpus_lib.load_corpus(cfg)


def test_load_corpus_pydoc_from_a_config_object():
  class Cfg:
    dataset, tokenizer, data_dir, manual_dir, variant = "pydoc", "byte", "", None, "v1"

  assert corpus_lib.load_corpus(DataConfig.of(Cfg()).validate()).name == "pydoc-byte"
  assert not DataConfig(dataset="text", train_files="x", packing=True).problems()
