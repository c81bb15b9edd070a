"""aft_jax.tools.evaluate on tiny trained runs, and what a run shows while it trains."""

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
from aft_jax import decode
from aft_jax.tools import evaluate, trained
from aft_jax.trainer import train_lib

TEXT = "The quick brown fox jumps over the lazy dog.\nzzqqxx is not a word of the docs.\n"


@pytest.fixture(scope="module")
def word_run(tmp_path_factory):
  """Its final protocol (sliding windows, stride 16) differs from training's (disjoint)."""

  def build(folder):
    config = tiny_config(num_train_steps=2, final_eval_stride=16, **{"data.tokenizer": "word"})
    with contextlib.redirect_stdout(io.StringIO()):
      return train_lib.train_and_evaluate(config, str(folder / "run"))

  folder, results = shared.once(tmp_path_factory, "word_run", build)
  return str(folder / "run"), results


@pytest.fixture
def texts(tmp_path):
  """TEXT as text.txt, and as text.jsonl: a record per line (a field before the text)."""
  (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
  records = [json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXT.splitlines())]
  (tmp_path / "text.jsonl").write_text("".join(records))
  return tmp_path


def _evaluate(capsys, *flags):
  evaluate.main(list(flags))
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("split, prefix", [("test", "test"), ("validation", "valid")])
def test_evaluate_on_a_split_equals_the_trainers_final_number(trained_run, capsys, split, prefix):
  path, results, _ = trained_run
  out = _evaluate(capsys, "--workdir", path, "--split", split)
  assert out["nll"] == pytest.approx(results[f"{prefix}_loss"], rel=1e-6)
  assert out["ppl"] == pytest.approx(results[f"{prefix}_ppl"], rel=1e-6)
  assert out["tokens"] == results[f"{prefix}_tokens"] and out["step"] == 4
  assert out["bpb"] == pytest.approx(out["nll"] / math.log(2))


def test_evaluate_a_split_uses_the_final_protocol_of_results_json(word_run, capsys):
  path, results = word_run
  assert results["eval_protocol"]["stride"] == 16 and results["train_eval_protocol"]["stride"] == 32
  out = _evaluate(capsys, "--workdir", path, "--split", "validation")
  assert out["stride"] == 16 and out["tokens"] == results["valid_tokens"]
  assert out["ppl"] == pytest.approx(results["valid_ppl"], rel=1e-6)
  disjoint = _evaluate(capsys, "--workdir", path, "--split", "validation", "--stride", "0")
  assert disjoint["stride"] == 0 and disjoint["nll"] != pytest.approx(out["nll"], rel=1e-6)


def test_evaluate_a_text_file_byte_model_with_a_stride(trained_run, texts, capsys):
  path, text_file = trained_run[0], texts / "text.txt"
  disjoint = _evaluate(capsys, "--workdir", path, "--text_file", str(text_file))
  assert disjoint["tokens"] == len(TEXT.encode()) == disjoint["bytes"]
  assert math.isfinite(disjoint["bpb"]) and "unk_tokens" not in disjoint
  sliding = _evaluate(capsys, "--workdir", path, "--text_file", str(text_file), "--stride", "8")
  assert sliding["tokens"] == disjoint["tokens"] and sliding["stride"] == 8
  assert sliding["nll"] != disjoint["nll"]  # tokens after the first window see more context
  # The same lines as two records: each text then the boundary (an end of line), not the JSON.
  scored = _evaluate(capsys, "--workdir", path, "--text_file", str(texts / "text.jsonl"))
  assert scored["tokens"] == disjoint["tokens"] and scored["bytes"] == disjoint["bytes"]
  assert scored["nll"] == pytest.approx(disjoint["nll"], rel=1e-6)


# A line's end is <eos>; a record's text, as a split's document, is followed by one more.
@pytest.mark.parametrize("name, eos", [("text.txt", 2), ("text.jsonl", 4)])
def test_evaluate_a_text_file_word_model_counts_unknown_words(word_run, texts, capsys, name, eos):
  out = _evaluate(capsys, "--workdir", word_run[0], "--text_file", str(texts / name))
  assert out["unit"] == "word" and "bpb" not in out
  assert out["tokens"] == len(TEXT.split()) + eos
  assert out["unk_tokens"] >= 1  # 'zzqqxx' at least; the tiny vocabulary may lack others
  assert math.isfinite(out["ppl"])


def test_a_run_is_self_contained_and_records_absolute_paths(trained_run, word_run):
  path = trained_run[0]
  corpus = json.load(open(os.path.join(path, "corpus.json")))
  tokens = corpus.pop("tokens")  # the corpus record: what a resume and the tools check
  byte = dict(bos_id=10, builder_version=2, name="pydoc-byte", tokenizer="byte", unit="byte")
  assert corpus == {**byte, "vocab_size": 256}
  assert set(tokens) == {"train", "validation", "test"} and min(tokens.values()) > 0
  config = json.load(open(os.path.join(path, "config.json")))
  assert os.path.isabs(config["data"]["data_dir"])
  words = open(os.path.join(word_run[0], "vocab.txt"), encoding="utf-8").read().splitlines()
  assert "<eos>" in words and "<unk>" in words


def test_training_shows_validation_profile_config_and_sample(trained_run):
  path, _, stdout = trained_run
  assert "step 2: validation loss" in stdout and "bpb" in stdout
  tb = os.path.join(path, "tensorboard")
  traces = [f for _, _, fs in os.walk(os.path.join(tb, "plugins", "profile")) for f in fs]
  assert any(f.endswith(".xplane.pb") for f in traces), traces
  values = [v for event in _events(tb) for v in event.summary.value]
  assert {"config", "sample", "learning_rate"} <= {v.tag.split("/")[0] for v in values}
  # The HPARAMS tab: the run's flattened settings, in the run's own event file.
  (start,) = [v for v in values if v.tag == "_hparams_/session_start_info"]
  start = HParamsPluginData.FromString(start.metadata.plugin_data.content).session_start_info
  config = json.load(open(os.path.join(path, "config.json")))
  assert start.hparams["model.mixing"].string_value == config["model"]["mixing"]
  assert start.hparams["learning_rate"].number_value == config["learning_rate"]
  assert start.hparams["model.d_model"].number_value == config["model"]["d_model"]


def _events(logdir):
  """The Event protos of ``logdir``'s TFRecord files (length, CRC, record, CRC)."""
  for name in sorted(f for f in os.listdir(logdir) if "tfevents" in f):
    data = open(os.path.join(logdir, name), "rb").read()
    pos = 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos : pos + 8])
      yield Event.FromString(data[pos + 12 : pos + 12 + n])
      pos += 12 + n + 4


def test_a_stream_is_scored_with_the_whole_past(stream_run, tmp_path, capsys):
  """By default the text (8 x max_len) as one forward pass, as ``score_stream``'s chunks give it."""
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
