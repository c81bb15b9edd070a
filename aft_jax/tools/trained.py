"""A trained run loaded back from its workdir: what ``generate``, ``evaluate`` and ``export``
start from."""

from __future__ import annotations

import dataclasses
import sys

import jax
import ml_collections

from aft_jax import sharding
from aft_jax.data import vocab as vocab_lib
from aft_jax.model import ModelConfig, TransformerLM
from aft_jax.trainer import checkpointing, train_lib
from aft_jax.workdir import Workdir, corpus_info


@dataclasses.dataclass
class TrainedRun:
  """A run loaded back from its workdir, ready to sample or evaluate."""

  config: ml_collections.ConfigDict
  step: int
  model: TransformerLM
  params: dict
  vocab: vocab_lib.Vocab
  corpus_info: dict  # corpus.json's dict
  trainer: train_lib.Trainer  # on one device

  @property
  def bos_id(self) -> int:
    return self.corpus_info["bos_id"]


def load_run(workdir: str | Workdir, step: int | None = None) -> TrainedRun:
  """The run in ``workdir`` at checkpoint ``step`` (default: the latest), on one device.

  The vocabulary comes from the workdir; runs saved before it kept one load the corpus.
  """
  wd = Workdir.of(workdir)
  explicit = step is not None
  step = wd.check(step)
  config = ml_collections.ConfigDict(wd.read_config())
  saved = wd.load_vocab()
  if saved is None:
    from aft_jax import data as data_lib  # pylint: disable=g-import-not-at-top  (TFDS: slow)

    corpus = data_lib.load_corpus(config.data)
    saved = corpus_info(corpus), corpus.vocab
  info, vocab = saved
  model_cfg = ModelConfig(vocab_size=vocab.size, **config.model).validate()
  one = ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1})
  trainer = train_lib.Trainer(config, model_cfg, sharding.make_mesh(one, jax.devices()[:1]))
  mngr = checkpointing.checkpoint_manager(wd, config.keep_checkpoints)
  # The latest checkpoint, or the newest intact one before it (saying so); an explicit --step
  # is that checkpoint or a one-line error that names the others.
  steps = [step] if explicit else sorted(wd.checkpoint_steps(), reverse=True)
  try:
    step, state, skipped = checkpointing.restore_readable(mngr, steps, trainer.abstract_state)
  except ValueError as e:
    others = [s for s in wd.checkpoint_steps() if s != step] if explicit else []
    hint = f"; the other checkpoints: --step {', '.join(map(str, others))}" if others else ""
    raise ValueError(f"--workdir {wd}: {e}{hint}") from None
  for bad, why in skipped:
    print(
      f"note: skipped the damaged checkpoint at step {bad} ({why}); using step {step}, the "
      "newest one that reads",
      file=sys.stderr,
    )
  return TrainedRun(config, step, trainer.model, state.params, vocab, info, trainer)
