"""aft_jax.workdir.Workdir: every file of a run under one folder, read back as written."""

import json
import os
import re

import pytest

from aft_jax.data import pydoc_corpus
from aft_jax.workdir import Workdir


def test_files_live_under_the_workdir_and_read_back(tmp_path):
  wd = Workdir(str(tmp_path / "run"))
  files = "config corpus vocab subword metrics results final_eval lock".split()
  dirs = "tensorboard checkpoints damaged_checkpoints".split()
  names = [getattr(wd, f"{n}_file") for n in files] + [getattr(wd, f"{n}_dir") for n in dirs]
  assert len(set(names)) == len(names) and all(os.path.dirname(n) == wd.path for n in names)
  assert not os.path.exists(wd.path)  # nothing is created before something is written
  assert wd.read_config() is None and wd.load_vocab() is None and wd.checkpoint_steps() == []
  wd.write_config({"seed": 3})
  assert wd.read_config() == {"seed": 3}
  for tokenizer in ("byte", "word"):
    corpus = pydoc_corpus(tokenizer)
    wd.save_corpus(corpus)
    info, vocab = wd.load_vocab()
    assert info["tokenizer"] == tokenizer and vocab.size == corpus.vocab.size
  assert Workdir.of(wd) is wd and os.fspath(wd) == str(wd) == wd.path


def test_check_names_what_is_missing(tmp_path):
  wd = Workdir(str(tmp_path))
  with pytest.raises(ValueError, match="has no config.json"):
    wd.check()
  wd.write_config({})
  with pytest.raises(ValueError, match="has no checkpoint yet"):
    wd.check()
  os.makedirs(os.path.join(wd.checkpoints_dir, "4"))
  os.makedirs(os.path.join(wd.checkpoints_dir, "8.orbax-checkpoint-tmp-1"))  # a save under way
  assert wd.checkpoint_steps() == [4] and wd.check() == 4
  with pytest.raises(ValueError, match=r"--step 5: no such checkpoint .*\(steps: \[4\]\)"):
    wd.check(5)
  with pytest.raises(ValueError, match="does not exist"):
    Workdir(str(tmp_path / "nothing")).check()


def test_metrics_keep_the_last_record_of_each_step(tmp_path):
  wd = Workdir(str(tmp_path))
  with open(wd.metrics_file, "w") as f:
    f.write('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n{"step": 1, "loss": 2.5}\n')
    f.write('{"step": 2, "valid_loss": 2.2}\n')
  got = wd.read_metrics()
  assert [r for r in got if "loss" in r] == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
  assert {"step": 2, "valid_loss": 2.2} in got


def test_results_are_strict_json_with_non_finite_numbers_named(tmp_path):
  wd = Workdir(str(tmp_path))
  wd.write_results({"valid_loss": float("nan"), "valid_ppl": float("inf"), "steps": 3})

  with open(wd.results_file) as f:
    got = json.load(f, parse_constant=pytest.fail)  # NaN, Infinity: strict readers refuse them
  assert got == {
    "valid_loss": None,
    "valid_ppl": None,
    "steps": 3,
    "not_finite": {"valid_loss": "nan", "valid_ppl": "inf"},
  }


def test_a_missing_or_damaged_vocabulary_file_is_one_line_naming_it(tmp_path):
  wd = Workdir(str(tmp_path / "run"))
  wd.save_corpus(pydoc_corpus("word"))
  with open(wd.vocab_file, "rb+") as f:
    f.truncate(os.path.getsize(wd.vocab_file) - 1)  # cut inside the last token
  with pytest.raises(ValueError, match=r"--workdir .*vocab\.txt is truncated"):
    wd.load_vocab()
  wd.save_corpus(pydoc_corpus("word"))
  tokens = open(wd.vocab_file, encoding="utf-8").read().split("\n")
  tokens[0], tokens[1] = tokens[1], tokens[0]  # whole and the same size, but not the one saved
  with open(wd.vocab_file, "w", encoding="utf-8") as f:
    f.write("\n".join(tokens))
  with pytest.raises(ValueError, match=r"word vocabulary .*vocab\.txt is damaged: it does not"):
    wd.load_vocab()
  os.remove(wd.vocab_file)
  with pytest.raises(ValueError, match=r"word vocabulary .*vocab\.txt is missing") as e:
    wd.load_vocab()
  assert "\n" not in str(e.value)


def test_a_damaged_json_file_is_one_line_naming_it(tmp_path):
  wd = Workdir(str(tmp_path))
  for damage in (b"\x00" * 40, b'{"seed": 3\xff}', b"[1, 2]"):
    with open(wd.config_file, "wb") as f:
      f.write(damage)
    with pytest.raises(ValueError, match=rf"{wd.config_file} is damaged: ") as e:
      wd.read_config()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("path", ["", " ", "\t "])
def test_a_blank_workdir_is_refused_by_the_trainer_and_the_tools(path, tmp_path, monkeypatch):
  """'' would be the current directory, ' ' a folder named ' ': refused before any write."""
  from aft_jax.trainer import train_lib
  from tests.support.helpers import tiny_config

  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=re.escape(f"the workdir {path!r} is blank: name a folder")):
    Workdir(path)
  with pytest.raises(ValueError, match="is blank"):
    train_lib.train_and_evaluate(tiny_config(), path)
  assert os.listdir(tmp_path) == []
