"""A run's workdir: its files' names, reading and writing (docs/training.md, "What lands in the
workdir")."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import os

from aft_jax import files
from aft_jax.data import record, subword
from aft_jax.data import vocab as vocab_lib


@dataclasses.dataclass(frozen=True)
class Workdir:
  """The workdir at ``path`` (made absolute); nothing is created until something is written."""

  path: str

  def __post_init__(self):
    if not str(self.path).strip():  # '' would be the current directory, ' ' a folder named ' '
      raise ValueError(f"the workdir {str(self.path)!r} is blank: name a folder")
    object.__setattr__(self, "path", os.path.abspath(os.path.expanduser(self.path)))

  @classmethod
  def of(cls, workdir: str | Workdir) -> Workdir:
    return workdir if isinstance(workdir, Workdir) else cls(workdir)

  def __str__(self) -> str:
    return self.path

  def __fspath__(self) -> str:  # os and open() take a Workdir where they take its path
    return self.path

  def _file(self, name: str) -> str:
    return os.path.join(self.path, name)

  config_file = property(lambda self: self._file("config.json"))
  corpus_file = property(lambda self: self._file("corpus.json"))
  vocab_file = property(lambda self: self._file(vocab_lib.VOCAB_FILENAME))
  subword_file = property(lambda self: self._file(subword.MODEL_FILENAME))
  metrics_file = property(lambda self: self._file("metrics.jsonl"))
  results_file = property(lambda self: self._file("results.json"))
  final_eval_file = property(lambda self: self._file("final_eval.json"))
  lock_file = property(lambda self: self._file("trainer.lock"))
  tensorboard_dir = property(lambda self: self._file("tensorboard"))
  checkpoints_dir = property(lambda self: self._file("checkpoints"))
  damaged_checkpoints_dir = property(lambda self: self._file("damaged_checkpoints"))

  def write_config(self, config: dict) -> None:
    os.makedirs(self.path, exist_ok=True)
    files.atomic_write_json(self.config_file, config)

  def read_config(self) -> dict | None:
    return _read_json(self.config_file)

  def write_results(self, results: dict) -> None:
    """Strict JSON: a NaN or infinite number is null, its key and value in ``not_finite``."""
    results, not_finite = dict(results), {}
    for key, value in results.items():
      if isinstance(value, float) and not math.isfinite(value):
        results[key], not_finite[key] = None, str(value)
    if not_finite:
      results["not_finite"] = not_finite
    files.atomic_write_json(self.results_file, results, allow_nan=False)

  def write_final_eval(self, progress: dict) -> None:
    files.atomic_write_json(self.final_eval_file, progress)

  def read_final_eval(self) -> dict | None:
    return _read_json(self.final_eval_file)

  def save_corpus(self, corpus) -> None:
    os.makedirs(self.path, exist_ok=True)
    if isinstance(corpus.vocab, vocab_lib.WordVocab):
      corpus.vocab.save(self.vocab_file)
    if isinstance(corpus.vocab, subword.SubwordVocab):
      corpus.vocab.save(self.subword_file)
    files.atomic_write_json(self.corpus_file, record.of_corpus(corpus))

  def check_trained_vocab(self, info: dict, vocab: vocab_lib.Vocab, saved: dict | None, since):
    """``record.DataChanged`` unless ``vocab`` is the one a checkpoint's record ``saved`` names."""
    now = {"tokenizer": info["tokenizer"], "vocab_size": vocab.size}
    if getattr(vocab, "sha256", None) is not None:
      now["vocab_sha256"] = vocab.sha256
    file = {"word": self.vocab_file, "subword": self.subword_file}.get(info["tokenizer"])
    what = f"{os.path.basename(file)} and corpus.json" if file else "corpus.json"
    saved = {k: v for k, v in (saved or {}).items() if k in now}
    hint = (
      f"the workdir's {what} were replaced after training (a refused run of an older aft_jax "
      "rewrote them): put the originals back, or rerun train.py on the original data to write "
      "them again"
    )
    record.check_corpus(saved, now, since, hint)

  def read_corpus(self) -> dict | None:
    return _read_json(self.corpus_file)

  def trained_corpus(self, items: dict) -> dict | None:
    """The checkpoint's corpus record, else corpus.json's, else an older run's; None: no run."""
    saved = items.get("corpus") or self.read_corpus()
    if saved is None and (items or os.path.isfile(self.config_file)):
      saved = record.unrecorded(_read_json(self.results_file), items.get("data"))
    return saved

  def load_vocab(self) -> tuple[dict, vocab_lib.Vocab] | None:
    info = self.read_corpus()
    if info is None:
      return None
    file = {"word": self.vocab_file, "subword": self.subword_file}.get(info["tokenizer"])
    if file is not None and not os.path.isfile(file):
      raise ValueError(
        f"--workdir {self.path}: the run's {info['tokenizer']} vocabulary {file} is missing "
        "(copy it with the workdir)"
      )
    try:
      if info["tokenizer"] == "word":
        vocab = vocab_from_info(info, vocab_lib.WordVocab.load(file).tokens)
        if info.get("vocab_sha256", vocab.sha256) != vocab.sha256:
          raise ValueError(
            f"the word vocabulary {file} is damaged: it does not match the SHA-256 recorded "
            "beside it"
          )
        return info, vocab
      if info["tokenizer"] == "subword":
        vocab = subword.SubwordVocab.load(file, info.get("vocab_sha256"))
        return info, _checked_size(vocab, info)
      return info, vocab_from_info(info)
    except ValueError as e:
      raise ValueError(f"--workdir {self.path}: {e}") from None

  def read_metrics(self) -> list[dict]:
    """The last record of each (step, kind): a resume logs again the steps since its checkpoint."""
    by_key = {}
    with open(self.metrics_file) as f:
      for line in f:
        rec = json.loads(line)
        by_key[(rec["step"], tuple(sorted(rec)))] = rec
    return sorted(by_key.values(), key=lambda r: r["step"])

  def checkpoint_steps(self) -> list[int]:
    if not os.path.isdir(self.checkpoints_dir):
      return []
    return sorted(int(d) for d in os.listdir(self.checkpoints_dir) if d.isdigit())

  def check(self, step: int | None = None) -> int:
    if not os.path.isdir(self.path):
      raise ValueError(f"--workdir {self.path} does not exist")
    if not os.path.exists(self.config_file):
      raise ValueError(
        f"--workdir {self.path} has no config.json: not a workdir written by train.py"
      )
    steps = self.checkpoint_steps()
    if not steps:
      raise ValueError(f"--workdir {self.path} has no checkpoint yet: train it first")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise ValueError(f"--step {step}: no such checkpoint in {self.path} (steps: {steps})")
    return step


def _read_json(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  try:
    with open(path, "rb") as f:
      obj = json.loads(f.read())
  except ValueError as e:  # not UTF-8, or not JSON
    raise ValueError(f"{path} is damaged: it is not JSON ({str(e).splitlines()[0]})") from None
  if not isinstance(obj, dict):
    raise ValueError(f"{path} is damaged: it holds a {type(obj).__name__}, not a JSON object")
  return obj


def vocab_payload(vocab: vocab_lib.Vocab) -> list[str] | str | None:
  """An export's vocabulary: tokens, a subword model in base64, or None."""
  if isinstance(vocab, vocab_lib.WordVocab):
    return vocab.tokens
  if isinstance(vocab, subword.SubwordVocab):
    return base64.b64encode(vocab.model).decode("ascii")
  return None


def vocab_from_info(info: dict, payload: list[str] | str | None = None) -> vocab_lib.Vocab:
  if info["tokenizer"] == "byte":
    vocab = vocab_lib.ByteVocab()
  elif payload is None:
    raise ValueError(f"a {info['tokenizer']} vocabulary needs its contents ({info['name']})")
  elif info["tokenizer"] == "subword":
    model = base64.b64decode(payload, validate=True)
    sha256 = info.get("vocab_sha256")
    if sha256 is not None and hashlib.sha256(model).hexdigest() != sha256:
      raise ValueError("the subword vocabulary does not match its recorded SHA-256")
    vocab = subword.SubwordVocab(model)
  else:
    vocab = vocab_lib.WordVocab(payload)
  return _checked_size(vocab, info)


def _checked_size(vocab: vocab_lib.Vocab, info: dict) -> vocab_lib.Vocab:
  if vocab.size != info["vocab_size"]:
    raise ValueError(
      f"vocabulary has {vocab.size} entries, corpus.json says {info['vocab_size']}: damaged?"
    )
  return vocab
