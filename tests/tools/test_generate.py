"""Sampling (aft_jax.decode) and its command (aft_jax.tools.generate) on a tiny trained run."""

import os
import shutil

import jax
import numpy as np
import pytest

from tests.support.helpers import listing
from aft_jax import decode
from aft_jax.tools import evaluate, export, generate, trained
from aft_jax import data as data_lib
from aft_jax.data import corpus as corpus_lib
from aft_jax.data import vocab as vocab_lib


@pytest.fixture(scope="module")
def run_dir(trained_run):
  return trained_run[0]


@pytest.fixture(scope="module")
def run(run_dir):
  return trained.load_run(run_dir)


def _greedy(run, prompt_BP, length):
  return decode.generate(
    run.model, run.params, prompt_BP, length, rng=jax.random.key(0), temperature=0
  )


def test_generate_past_max_len_slides_and_keeps_the_non_sliding_prefix(run):
  max_len = run.model.cfg.max_len  # 32
  prompt_BP = np.asarray([run.vocab.encode("class Foo:\n")], np.int32)
  p = prompt_BP.shape[1]
  within = _greedy(run, prompt_BP, max_len - p)
  longer = _greedy(run, prompt_BP, 3 * max_len)
  np.testing.assert_array_equal(longer[:, : max_len - p], within)
  # A slid step predicts from the last max_len tokens.
  seq = np.concatenate([prompt_BP, longer], axis=1)
  n = p + max_len + 5
  logp = run.model.apply({"params": run.params}, seq[:, n - max_len : n])[:, -1]
  assert int(np.argmax(logp)) == seq[0, n]
  # A prompt longer than max_len is read through its last max_len tokens.
  long_prompt = np.tile(prompt_BP, (1, 4))[:, : max_len + 7]
  out = _greedy(run, long_prompt, 5)
  np.testing.assert_array_equal(out, _greedy(run, long_prompt[:, -max_len:], 5))


def test_prompt_prefill_in_one_pass_gives_the_token_by_token_samples(run, monkeypatch):
  assert run.model.cfg.mixing in decode.CHUNKED
  prompt_BP = np.asarray([run.vocab.encode("def main(args):\n  ")] * 2, np.int32)
  sample = lambda: decode.generate(
    run.model, run.params, prompt_BP, 12, rng=jax.random.key(3), temperature=0.8
  )
  chunked = sample()
  monkeypatch.setattr(decode, "CHUNKED", ())  # token by token, as before the prefill
  np.testing.assert_array_equal(chunked, sample())


def test_a_tiny_temperature_is_greedy_and_top_p_keeps_the_likeliest_tokens_of_that_mass():
  """Near 0 (not token 0: every logit overflowed to -inf); top_p 0.7 keeps 0.5 + 0.3."""
  logp = np.log(np.asarray([[0.05, 0.1, 0.6, 0.25], [0.7, 0.1, 0.1, 0.1]], np.float32))
  for temperature in (1e-45, 1e-30, 1e-6):
    for i in range(5):
      got = decode.sample_logits(jax.random.key(i), logp, temperature, top_k=3, top_p=0.9)
      np.testing.assert_array_equal(got, [2, 0])
  logp = np.log(np.asarray([[0.5, 0.3, 0.15, 0.05]], np.float32))
  seen = {int(decode.sample_logits(jax.random.key(i), logp, 1.0, top_p=0.7)[0]) for i in range(200)}
  assert seen == {0, 1}
  assert int(decode.sample_logits(jax.random.key(0), logp, 1.0, top_p=1e-6)[0]) == 0
  with pytest.raises(ValueError, match="top_p = 0"):
    decode.check_sampling(1.0, 0, 0.0)


def test_more_samples_than_memory_holds_is_one_line_before_any_allocation(run):
  with pytest.raises(ValueError, match=r"num_samples = 100000000: .* GiB here, more than the"):
    decode.sample_texts(run.model, run.params, run.vocab, "The ", 5, num_samples=100_000_000)
  assert len(decode.sample_texts(run.model, run.params, run.vocab, "The ", 3, num_samples=2)) == 2


def test_word_prompt_maps_unknown_words_to_unk_or_refuses_them():
  vocab = vocab_lib.WordVocab.build(vocab_lib.count_words(["the cat sat\n"]), add_unk=True)
  ids, unknown = decode.encode_prompt(vocab, "the dog sat")
  assert unknown == 1 and ids == list(vocab.encode_tokens(["the", "<unk>", "sat"]))
  strict = vocab_lib.WordVocab.build(vocab_lib.count_words(["the cat sat\n"]))
  with pytest.raises(ValueError, match="'dog' is not in the vocabulary"):
    decode.encode_prompt(strict, "the dog")


def test_generate_command_samples_a_copied_workdir_without_data(
  run_dir, tmp_path, monkeypatch, capsys
):
  copy = str(tmp_path / "copied")
  shutil.copytree(run_dir, copy)
  monkeypatch.setattr(data_lib, "load_corpus", None)  # generate must not load the corpus
  monkeypatch.setattr(corpus_lib, "load_corpus", None)
  monkeypatch.setenv("AFT_JAX_DATA", str(tmp_path / "no-such-data"))
  prompt_file = tmp_path / "prompt.txt"
  prompt_file.write_text("def main():\n    ")
  args = ["--workdir", copy, "--prompt_file", str(prompt_file), "--length", "70"]
  generate.main(args + ["--num_samples", "3", "--top_p", "0.9", "--seed", "1"])
  samples = capsys.readouterr().out.split("--- sample ")[1:]
  assert len(samples) == 3 and all("def main():\n    " in s for s in samples)
  generate.main(["--workdir", copy, "--length", "300", "--stop_at_eos", "--temperature", "0"])
  text, err = capsys.readouterr()
  assert "note: the text passes max_len = 32 tokens: from there each token" in err
  assert text.endswith("\n") and text.count("\n") <= 2  # the sample ends at its first newline
  assert not os.path.exists(str(tmp_path / "no-such-data"))


# (tool, flags after --workdir RUN, message). "{tmp}": a pipe (never a device), "bare" (a config).
REFUSED = [
  ("generate", ["--length", "-5"], "--length = -5 must be >= 1"),
  ("generate", ["--temperature", "-1"], "--temperature = -1.0 must be >= 0"),
  ("generate", ["--top_p", "1.5"], "--top_p = 1.5 must be in (0, 1]"),
  ("generate", ["--step", "999"], "--step 999: no such checkpoint"),
  ("generate", ["--save_state", "{tmp}/pipe"], "--save_state {tmp}/pipe is not a regular file"),
  ("generate", ["--save_state", "{tmp}/s"], "is no stream: only model.position_embedding 'none'"),
  ("generate", ["--workdir", "{tmp}/bare"], "--workdir {tmp}/bare has no checkpoint yet"),
  ("generate", ["--workdir", "{tmp}/gone"], "--workdir {tmp}/gone does not exist"),
  ("evaluate", ["--split", "dev"], "--split 'dev' must be one of"),
  ("evaluate", ["--text_file", "/no/such/file"], "--text_file /no/such/file: No such file"),
  ("evaluate", ["--text_file", "/no/such/f.jsonl"], "--text_file /no/such/f.jsonl: No such file"),
  ("evaluate", ["--stride", "999"], "--stride = 999 must be in [0, seq_len = 32]"),
  ("export", ["--out", "{tmp}/no/m.msgpack"], "--out {tmp}/no/m.msgpack: folder {tmp}/no does not"),
  ("export", ["--out", "{tmp}/m.npz"], "--format stablehlo exports a stream's decoding step"),
]


@pytest.mark.parametrize("tool, flags, message", REFUSED)
def test_a_refused_command_is_one_line_and_changes_no_file(run_dir, tmp_path, tool, flags, message):
  tmp = os.path.realpath(tmp_path)
  os.mkfifo(tmp_path / "pipe")
  (tmp_path / "bare").mkdir()
  shutil.copy(os.path.join(run_dir, "config.json"), tmp_path / "bare" / "config.json")
  files = lambda: (listing(run_dir), listing(tmp_path / "bare"), sorted(os.listdir(tmp_path)))  # noqa: E731
  before = files()
  main = {"generate": generate.main, "evaluate": evaluate.main, "export": export.main}[tool]
  with pytest.raises(SystemExit) as e:
    main(["--workdir", run_dir, *(f.format(tmp=tmp) for f in flags)])
  line = str(e.value.code)
  assert line.startswith(f"{tool}: ") and message.format(tmp=tmp) in line and "\n" not in line
  assert files() == before


# ---------------------------------------------------------------- streams


@pytest.fixture(scope="module")
def stream(stream_run):
  return trained.load_run(stream_run[0])


# (the call on a run, the argument its ValueError names, the bad id; "V": the vocabulary size)
BAD_IDS = {
  "prompt_negative": (lambda r, v: _generate(r, [[1, -1]]), "generate: prompt", -1),
  "score_tokens": (lambda r, v: _score(r, [3, -100], 0), "score_stream: tokens", -100),
  "score_bos": (lambda r, v: _score(r, [3], v), "score_stream: bos_id", "V"),
  "evaluate_bos": (lambda r, v: _evaluate(r, [1], -1), "Trainer.evaluate: bos_id", -1),
  "evaluate_tokens": (lambda r, v: _evaluate(r, [1, v, 2], 0), "Trainer.evaluate: tokens", "V"),
}
_generate = lambda r, ids: decode.generate(r.model, r.params, ids, 2, rng=jax.random.key(0))
_score = lambda r, ids, bos: decode.score_stream(r.model, r.params, ids, bos, 4)
_evaluate = lambda r, ids, bos: r.trainer.evaluate(r.params, np.asarray(ids), bos)


@pytest.mark.parametrize("case", BAD_IDS)
def test_scoring_and_generation_refuse_ids_outside_the_vocabulary_in_one_line(stream, case):
  call, name, bad = BAD_IDS[case]
  v = stream.model.cfg.vocab_size
  bad = v if bad == "V" else bad
  with pytest.raises(ValueError) as e:
    call(stream, v)
  assert str(e.value) == f"{name}: the id {bad} is outside the vocabulary [0, {v})"


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.9, 7)])
def test_a_saved_stream_continues_exactly_as_one_uninterrupted_run(
  stream_run, stream, tmp_path, capsys, temperature, seed
):
  """Past max_len (16) and seq_len (32); the second command prints only its new text."""
  prompt = "def main():\n  "
  ids = np.tile(np.asarray([stream.vocab.encode(prompt)], np.int32), (2, 1))
  whole = decode.generate(
    stream.model, stream.params, ids, 50, rng=jax.random.key(seed), temperature=temperature
  )
  state = str(tmp_path / "s.state")
  sampling = ["--temperature", str(temperature), "--num_samples", "2"]
  generate.main(["--workdir", stream_run[0], "--prompt", prompt, "--length", "30",
                 "--seed", str(seed), "--save_state", state, *sampling])  # fmt: skip
  first = capsys.readouterr().out
  generate.main(["--workdir", stream_run[0], "--state", state, "--length", "20", *sampling])
  second, err = capsys.readouterr()
  want = lambda head, ids: [f"{i + 1} of 2\n{head}{stream.vocab.decode(ids[i])}\n" for i in (0, 1)]
  assert first.split("--- sample ")[1:] == want(prompt, whole[:, :30])
  assert second.split("--- sample ")[1:] == want("", whole[:, 30:])
  assert "max_len" not in err  # a stream has no length limit to note


def test_a_stream_state_from_another_model_or_damaged_is_refused_in_one_line(
  stream_run, stream, tmp_path, capsys
):
  from aft_jax import stream_file

  prompt_BP = np.asarray([stream.vocab.encode("x = 1")], np.int32)
  _, after = decode.generate(
    stream.model, stream.params, prompt_BP, 3, rng=jax.random.key(0), return_stream=True
  )
  assert after.position == prompt_BP.shape[1] + 3
  good, other = str(tmp_path / "good.state"), str(tmp_path / "other.state")
  fingerprint = stream_file.fingerprint(stream.model.cfg, stream.params)
  other_params = jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1), stream.params)
  assert stream_file.fingerprint(stream.model.cfg, other_params) != fingerprint
  stream_file.save(good, after, fingerprint)
  stream_file.save(other, after, "0" * 64)  # as another model would have written it
  loaded = stream_file.load(good, stream.model, fingerprint)
  assert loaded.position == after.position
  data = bytearray(open(good, "rb").read())
  data[-3] ^= 0x40
  (tmp_path / "damaged.state").write_bytes(bytes(data))
  (tmp_path / "cut.state").write_bytes(bytes(data[: len(data) // 2]))
  for name, message in [
    ("other", "is the state of another model"),
    ("damaged", "is damaged: its contents do not match their SHA-256"),
    ("cut", "is damaged or not a stream state"),
    ("missing", "cannot read it"),
  ]:
    with pytest.raises(ValueError, match=message) as e:
      stream_file.load(str(tmp_path / f"{name}.state"), stream.model, fingerprint)
    assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="num_samples = 2: the state holds 1"):
    decode.sample_texts(
      stream.model, stream.params, stream.vocab, "", 2, num_samples=2, stream=loaded
    )
  with pytest.raises(SystemExit, match="generate: --state .*other.state is the state of another"):
    generate.main(["--workdir", stream_run[0], "--state", other, "--length", "2"])
  generate.main(["--workdir", stream_run[0], "--state", good, "--prompt", "yz", "--length", "4"])
  out = capsys.readouterr().out
  assert out.startswith("yz") and len(out) >= len("yz") + 1
