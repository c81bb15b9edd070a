"""A trained run loaded back from its workdir, for generate, evaluate and export."""

from __future__ import annotations

import dataclasses
import sys

import jax

from aft_jax import sharding
from aft_jax.data import vocab as vocab_lib
from aft_jax.model import TransformerLM
from aft_jax.trainer import checkpointing, train_lib
from aft_jax.trainer.run_config import RunConfig
from aft_jax.data import record
from aft_jax.workdir import Workdir


@dataclasses.dataclass
class TrainedRun:
  config: RunConfig  # the model's vocabulary size filled in
  step: int
  model: TransformerLM
  params: dict
  vocab: vocab_lib.Vocab
  corpus_info: dict  # corpus.json's dict
  trainer: train_lib.Trainer  # on one device
  record: dict | None = None  # the corpus record the checkpoint was trained on (trained_corpus)

  @property
  def bos_id(self) -> int:
    return self.corpus_info["bos_id"]


def since(step: int) -> str:
  return f"the checkpoint at step {step} was written"


def run_config(workdir: str | Workdir, step: int | None = None) -> RunConfig:
  wd = Workdir.of(workdir)
  wd.check(step)
  return RunConfig.from_saved(wd.read_config())


def load_run(
  workdir: str | Workdir, step: int | None = None, *, check=None, config: RunConfig | None = None
) -> TrainedRun:
  """The run at ``step`` (default: the newest intact one) on one device; ``check(step, corpus
  record or None)`` runs before any array is read, and raises to refuse."""
  wd = Workdir.of(workdir)
  explicit = step is not None
  config = run_config(wd, step) if config is None else config
  saved = wd.load_vocab()
  if saved is None:
    from aft_jax import data as data_lib  # pylint: disable=g-import-not-at-top  (TFDS: slow)

    built_by = record.built_by(wd.trained_corpus({}), config.data.dataset)
    corpus = data_lib.load_corpus(config.data, built_by)
    saved = record.of_corpus(corpus), corpus.vocab
  info, vocab = saved

  def check_checkpoint(at: int, items: dict):
    trained_on = items.get("corpus")
    wd.check_trained_vocab(info, vocab, trained_on, since(at))
    if check is not None:
      check(at, trained_on)

  config = config.with_vocab(vocab.size)
  one = sharding.MeshConfig(data=1, fsdp=1, tensor=1, sequence=1)
  trainer = train_lib.Trainer(config, sharding.make_mesh(one, jax.devices()[:1]))
  mngr = checkpointing.checkpoint_manager(wd, config.checkpoint)
  # An explicit --step is that checkpoint or a one-line error that names the others.
  steps = [step] if explicit else sorted(wd.checkpoint_steps(), reverse=True)
  try:
    restored, skipped = checkpointing.restore_readable(
      mngr, steps, trainer.abstract_state, check_checkpoint
    )
  except record.DataChanged as e:
    raise record.DataChanged(f"--workdir {wd}: {e}") from None
  except ValueError as e:
    others = [s for s in wd.checkpoint_steps() if s != step] if explicit else []
    hint = f"; the other checkpoints: --step {', '.join(map(str, others))}" if others else ""
    raise ValueError(f"--workdir {wd}: {e}{hint}") from None
  for bad, why in skipped:
    print(
      f"note: skipped the damaged checkpoint at step {bad} ({why}); using step "
      f"{restored.step}, the newest one that reads",
      file=sys.stderr,
    )
  if restored.unverified:
    print(
      f"note: the checkpoint at step {restored.step} was {restored.unverified}", file=sys.stderr
    )
  params = restored.state.params
  trained_on = wd.trained_corpus(restored.items)
  return TrainedRun(config, restored.step, trainer.model, params, vocab, info, trainer, trained_on)
