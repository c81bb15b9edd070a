"""aft_jax.tools.evaluate on tiny trained runs, and what a run shows while it trains (the console's
validation lines, the profiler trace, the config, settings and sample on TensorBoard)."""

import contextlib
import io
import json
import math
import os
import struct

import numpy as np
import pytest
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData

from tests.support import shared
from tests.support.helpers import tiny_config
from aft_jax.tools import evaluate
from aft_jax.trainer import train_lib

TEXT = "The quick brown fox jumps over the lazy dog.\nzzqqxx is not a word of the docs.\n"


def _train(path, **overrides):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    results = train_lib.train_and_evaluate(tiny_config(**overrides), path)
  return results, out.getvalue()


@pytest.fixture(scope="module")
def byte_run(trained_run):
  return trained_run


@pytest.fixture(scope="module")
def word_run(tmp_path_factory):
  # The final protocol (sliding windows) differs from the training-time one (disjoint).
  overrides = {"data.tokenizer": "word", "final_eval_stride": 16}
  build = lambda folder: _train(str(folder / "run"), num_train_steps=2, **overrides)[0]
  folder, results = shared.once(tmp_path_factory, "word_run", build)
  return str(folder / "run"), results


def _evaluate(capsys, *flags):
  evaluate.main(list(flags))
  lines = capsys.readouterr().out.strip().splitlines()
  return json.loads(lines[-1])  # the last line on stdout is the JSON result


@pytest.mark.parametrize("split, prefix", [("test", "test"), ("validation", "valid")])
def test_evaluate_on_a_split_equals_the_trainers_final_number(byte_run, capsys, split, prefix):
  path, results, _ = byte_run
  out = _evaluate(capsys, "--workdir", path, "--split", split)
  assert out["nll"] == pytest.approx(results[f"{prefix}_loss"], rel=1e-6)
  assert out["ppl"] == pytest.approx(results[f"{prefix}_ppl"], rel=1e-6)
  assert out["tokens"] == results[f"{prefix}_tokens"] and out["step"] == 4
  assert out["bpb"] == pytest.approx(out["nll"] / math.log(2))


def test_evaluate_a_split_uses_the_final_protocol_of_results_json(word_run, capsys):
  """results.json's final numbers (sliding windows, final_eval_stride 16; disjoint during
  training) by default; --stride chooses another protocol."""
  path, results = word_run
  assert results["eval_protocol"]["stride"] == 16 and results["train_eval_protocol"]["stride"] == 32
  out = _evaluate(capsys, "--workdir", path, "--split", "validation")
  assert out["stride"] == 16 and out["tokens"] == results["valid_tokens"]
  assert out["ppl"] == pytest.approx(results["valid_ppl"], rel=1e-6)
  disjoint = _evaluate(capsys, "--workdir", path, "--split", "validation", "--stride", "0")
  assert disjoint["stride"] == 0 and disjoint["nll"] != pytest.approx(out["nll"], rel=1e-6)


def test_evaluate_a_text_file_byte_model_with_a_stride(byte_run, tmp_path, capsys):
  path = byte_run[0]
  text_file = tmp_path / "text.txt"
  text_file.write_text(TEXT, encoding="utf-8")
  disjoint = _evaluate(capsys, "--workdir", path, "--text_file", str(text_file))
  assert disjoint["tokens"] == len(TEXT.encode()) == disjoint["bytes"]
  assert math.isfinite(disjoint["bpb"]) and "unk_tokens" not in disjoint
  sliding = _evaluate(capsys, "--workdir", path, "--text_file", str(text_file), "--stride", "8")
  assert sliding["tokens"] == disjoint["tokens"] and sliding["stride"] == 8
  assert sliding["nll"] != disjoint["nll"]  # tokens after the first window see more context
  # The same two lines as two records: their text, each then the boundary (for bytes an end of
  # line), as the corpus reads them; not the JSON around them.
  records = _write_records(tmp_path / "text.jsonl")
  scored = _evaluate(capsys, "--workdir", path, "--text_file", str(records))
  assert scored["tokens"] == disjoint["tokens"] and scored["bytes"] == disjoint["bytes"]
  assert scored["nll"] == pytest.approx(disjoint["nll"], rel=1e-6)


def _write_records(path):
  """TEXT's lines as JSONL records (a field before the text, as real corpora have)."""
  lines = TEXT.splitlines()
  path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(lines)))
  return path


# A line's end is <eos>; a record's text, as a split's document, is followed by one more.
@pytest.mark.parametrize("name, eos", [("text.txt", 2), ("text.jsonl", 4)])
def test_evaluate_a_text_file_word_model_counts_unknown_words(
  word_run, tmp_path, capsys, name, eos
):
  path = word_run[0]
  text_file = tmp_path / name
  if name.endswith(".jsonl"):
    _write_records(text_file)
  else:
    text_file.write_text(TEXT, encoding="utf-8")
  out = _evaluate(capsys, "--workdir", path, "--text_file", str(text_file))
  assert out["unit"] == "word" and "bpb" not in out
  assert out["tokens"] == len(TEXT.split()) + eos
  assert out["unk_tokens"] >= 1  # 'zzqqxx' at least; the tiny vocabulary may lack others
  assert math.isfinite(out["ppl"])


def test_evaluate_refuses_ids_outside_the_vocabulary_in_one_line(byte_run, tmp_path, monkeypatch):
  """Ids the model has no row for (a tokenizer that disagrees with it): one line, not a NaN."""
  text_file = tmp_path / "text.txt"
  text_file.write_text("abc")
  encode = lambda vocab, text: (np.asarray([1, vocab.size, 2]), 3, 0)
  monkeypatch.setattr(evaluate, "encode_text", encode)
  with pytest.raises(SystemExit) as e:
    evaluate.main(["--workdir", byte_run[0], "--text_file", str(text_file)])
  v = json.load(open(os.path.join(byte_run[0], "corpus.json")))["vocab_size"]
  assert str(e.value.code) == (
    f"evaluate: Trainer.evaluate: tokens: the id {v} is outside the vocabulary [0, {v})"
  )


def test_a_run_is_self_contained_and_records_absolute_paths(byte_run, word_run):
  path = byte_run[0]
  corpus = json.load(open(os.path.join(path, "corpus.json")))
  tokens = corpus.pop("tokens")  # the corpus record: what a resume and the tools check
  assert corpus == {
    "bos_id": 10,
    "builder_version": 2,
    "name": "pydoc-byte",
    "tokenizer": "byte",
    "unit": "byte",
    "vocab_size": 256,
  }
  assert set(tokens) == {"train", "validation", "test"} and min(tokens.values()) > 0
  config = json.load(open(os.path.join(path, "config.json")))
  assert os.path.isabs(config["data"]["data_dir"])
  words = open(os.path.join(word_run[0], "vocab.txt"), encoding="utf-8").read().splitlines()
  assert "<eos>" in words and "<unk>" in words


def test_training_shows_validation_profile_config_and_sample(byte_run):
  path, _, stdout = byte_run
  assert "step 2: validation loss" in stdout and "bpb" in stdout
  tb = os.path.join(path, "tensorboard")
  traces = [f for _, _, fs in os.walk(os.path.join(tb, "plugins", "profile")) for f in fs]
  assert any(f.endswith(".xplane.pb") for f in traces), traces
  events = b"".join(
    open(os.path.join(tb, f), "rb").read() for f in os.listdir(tb) if "tfevents" in f
  )
  assert b"config" in events and b"sample" in events and b"learning_rate" in events
  # The HPARAMS tab: the run's flattened settings, in the run's own event file.
  (start,) = [
    HParamsPluginData.FromString(v.metadata.plugin_data.content).session_start_info
    for event in _events(tb)
    for v in event.summary.value
    if v.tag == "_hparams_/session_start_info"
  ]
  config = json.load(open(os.path.join(path, "config.json")))
  assert start.hparams["model.mixing"].string_value == config["model"]["mixing"]
  assert start.hparams["learning_rate"].number_value == config["learning_rate"]
  assert start.hparams["model.d_model"].number_value == config["model"]["d_model"]


def _events(logdir):
  """The Event protos of the TFRecord event files in ``logdir`` (length, CRC, record, CRC)."""
  for name in sorted(f for f in os.listdir(logdir) if "tfevents" in f):
    data = open(os.path.join(logdir, name), "rb").read()
    pos = 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos : pos + 8])
      yield Event.FromString(data[pos + 12 : pos + 12 + n])
      pos += 12 + n + 4


def test_a_stream_is_scored_with_the_whole_past(stream_run, tmp_path, capsys):
  """A stream's default: the text (8 x max_len) as one sequence, one forward pass's mean NLL, as
  ``score_stream`` gives it in chunks with the state carried; --stride: the trainer's windows."""
  from aft_jax import decode
  from aft_jax.tools import trained

  path = stream_run[0]
  text = (TEXT * 3)[:224]
  text_file = tmp_path / "text.txt"
  text_file.write_text(text, encoding="utf-8")
  out = _evaluate(capsys, "--workdir", path, "--text_file", str(text_file))
  assert out["protocol"] == "whole_past" and "stride" not in out
  assert out["tokens"] == len(text.encode()) == 224
  run = trained.load_run(path)
  ids = np.asarray(run.vocab.encode(text), np.int32)
  inputs = np.concatenate([[run.bos_id], ids[:-1]]).astype(np.int32)
  nll = np.asarray(run.model.apply({"params": run.params}, inputs[None], ids[None]), np.float64)
  assert out["nll"] == pytest.approx(nll.mean(), rel=1e-5)
  chunked = decode.score_stream(run.model, run.params, ids, run.bos_id, 10)  # 23 chunks
  assert chunked["nll"] == pytest.approx(out["nll"], rel=1e-5) and chunked["tokens"] == 224
  windows = _evaluate(capsys, "--workdir", path, "--text_file", str(text_file), "--stride", "0")
  assert windows["protocol"] == "disjoint_windows" and windows["tokens"] == 224
  assert windows["nll"] != pytest.approx(out["nll"], rel=1e-7)  # a window sees less
