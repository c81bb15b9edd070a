"""What a run keeps in its workdir besides checkpoints, and how to load a trained run back.

    <workdir>/config.json          the config of the run (``aft_jax.checkpointing``)
    <workdir>/corpus.json          the corpus: name, unit, tokenizer, bos_id, vocabulary size
    <workdir>/vocab.txt            word-level runs: the vocabulary, one token per line, id order
    <workdir>/checkpoints/<step>/  Orbax checkpoints

With ``corpus.json`` (and ``vocab.txt``) a workdir is self-contained: sampling, evaluating a
text file and exporting need neither the dataset nor a data folder, so a copied workdir works on
another machine. Only evaluating a split of the corpus reads the data again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import ml_collections

from aft_jax import files
from aft_jax.data import vocab as vocab_lib

CORPUS_FILE = "corpus.json"


def save_vocab(workdir: str, corpus) -> None:
  """Writes ``corpus.json`` (and ``vocab.txt`` for a word vocabulary) into ``workdir``."""
  os.makedirs(workdir, exist_ok=True)
  vocab = corpus.vocab
  info = {
    "name": corpus.name,
    "unit": corpus.unit,
    "tokenizer": vocab.unit,
    "bos_id": int(corpus.bos_id),
    "vocab_size": int(vocab.size),
  }
  if isinstance(vocab, vocab_lib.WordVocab):
    vocab.save(os.path.join(workdir, vocab_lib.VOCAB_FILENAME))
  files.atomic_write_json(os.path.join(workdir, CORPUS_FILE), info)


def vocab_from_info(info: dict, tokens: list[str] | None = None) -> vocab_lib.Vocab:
  """The vocabulary ``corpus.json``'s dict describes (``tokens``: a word vocabulary's list)."""
  if info["tokenizer"] == "byte":
    vocab = vocab_lib.ByteVocab()
  else:
    if tokens is None:
      raise ValueError(f"a word vocabulary needs its tokens ({info['name']})")
    vocab = vocab_lib.WordVocab(tokens)
  if vocab.size != info["vocab_size"]:
    raise ValueError(
      f"vocabulary has {vocab.size} entries, corpus.json says {info['vocab_size']}: damaged?"
    )
  return vocab


def load_vocab(workdir: str) -> tuple[dict, vocab_lib.Vocab] | None:
  """(corpus.json's dict, vocabulary) saved in ``workdir``; None for a run saved without them."""
  path = os.path.join(workdir, CORPUS_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    info = json.load(f)
  tokens = None
  if info["tokenizer"] == "word":
    tokens = vocab_lib.WordVocab.load(os.path.join(workdir, vocab_lib.VOCAB_FILENAME)).tokens
  return info, vocab_from_info(info, tokens)


def checkpoint_steps(workdir: str) -> list[int]:
  """Steps of the complete checkpoints in ``workdir`` (Orbax names them by step)."""
  path = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(path):
    return []
  return sorted(int(d) for d in os.listdir(path) if d.isdigit())


@dataclasses.dataclass
class TrainedRun:
  """A run loaded back from its workdir, ready to sample or evaluate."""

  config: ml_collections.ConfigDict
  step: int
  model: object  # aft_jax.model.TransformerLM
  params: dict
  vocab: vocab_lib.Vocab
  corpus_info: dict  # corpus.json's dict
  trainer: object  # aft_jax.train_lib.Trainer on one device

  @property
  def bos_id(self) -> int:
    return self.corpus_info["bos_id"]


def check_workdir(workdir: str, step: int | None = None) -> int:
  """The checkpoint step to load (default: the latest); a one-line ValueError if there is none.

  Reads only: a workdir without checkpoints is left as it is (nothing is created).
  """
  if not os.path.isdir(workdir):
    raise ValueError(f"--workdir {workdir} does not exist")
  if not os.path.exists(os.path.join(workdir, "config.json")):
    raise ValueError(f"--workdir {workdir} has no config.json: not a workdir written by train.py")
  steps = checkpoint_steps(workdir)
  if not steps:
    raise ValueError(f"--workdir {workdir} has no checkpoint yet: train it first")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise ValueError(f"--step {step}: no such checkpoint in {workdir} (steps: {steps})")
  return step


def load_run(workdir: str, step: int | None = None) -> TrainedRun:
  """The run in ``workdir`` at checkpoint ``step`` (default: the latest), on one device.

  The vocabulary comes from the workdir; runs saved before it kept one load the corpus.
  """
  import jax  # pylint: disable=g-import-not-at-top  (keeps this module light to import)

  from aft_jax import checkpointing, sharding, train_lib  # pylint: disable=g-import-not-at-top
  from aft_jax.model import ModelConfig  # pylint: disable=g-import-not-at-top

  workdir = os.path.abspath(workdir)
  step = check_workdir(workdir, step)
  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  saved = load_vocab(workdir)
  if saved is None:
    from aft_jax import data as data_lib  # pylint: disable=g-import-not-at-top

    corpus = data_lib.load_corpus(config.data)
    info = {
      "name": corpus.name,
      "unit": corpus.unit,
      "tokenizer": corpus.vocab.unit,
      "bos_id": int(corpus.bos_id),
      "vocab_size": int(corpus.vocab.size),
    }
    saved = info, corpus.vocab
  info, vocab = saved
  model_cfg = ModelConfig(vocab_size=vocab.size, **config.model).validate()
  one = ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1})
  trainer = train_lib.Trainer(config, model_cfg, sharding.make_mesh(one, jax.devices()[:1]))
  mngr = checkpointing.checkpoint_manager(workdir, config.keep_checkpoints)
  state, _ = checkpointing.restore(mngr, step, trainer.abstract_state, with_data=False)
  return TrainedRun(config, step, trainer.model, state.params, vocab, info, trainer)


def run_command(name: str, command, args, *, print_json: bool = False) -> None:
  """Runs ``command(args)`` for ``python -m aft_jax.<name>``: Orbax's INFO logs silenced, and a
  ValueError (a bad flag, workdir or file) printed as one line on stderr with exit status 1.
  ``print_json``: the command's result (a dict) is printed as the last stdout line, as JSON."""
  from absl import logging  # pylint: disable=g-import-not-at-top

  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  try:
    result = command(args)
  except ValueError as e:
    sys.exit(f"{name}: {e}")  # no traceback: the message says what to fix
  if print_json:
    print(json.dumps(result, sort_keys=True), flush=True)
