"""Samples text from a trained run: python -m aft_jax.generate --workdir runs/x --prompt "The "

Loads the run's saved config and its latest (or --step) checkpoint, then decodes incrementally.
"""

import json
import os

import jax
import ml_collections
from absl import app, flags, logging

flags.DEFINE_string("workdir", None, "A workdir written by train.py.")
flags.DEFINE_string("prompt", "", "Text to continue.")
flags.DEFINE_integer("length", 200, "Tokens to generate (bounded by the model's max_len).")
flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 is greedy.")
flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0: all).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS


def load_run(workdir: str, step: int | None = None):
  """(config, corpus, model, params) of the run in ``workdir`` at ``step`` (default latest)."""
  from aft_jax import checkpointing, sharding, train_lib
  from aft_jax import data as data_lib
  from aft_jax.model import ModelConfig

  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  corpus = data_lib.load_corpus(config.data)
  model_cfg = ModelConfig(vocab_size=corpus.vocab.size, **config.model).validate()
  one = ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1})
  trainer = train_lib.Trainer(config, model_cfg, sharding.make_mesh(one, jax.devices()[:1]))
  mngr = checkpointing.checkpoint_manager(workdir, config.keep_checkpoints)
  step = mngr.latest_step() if step is None else step
  if step is None:
    raise ValueError(f"no checkpoint in {os.path.join(workdir, 'checkpoints')}")
  state, _ = checkpointing.restore(mngr, step, trainer.abstract_state, with_data=False)
  return config, corpus, trainer.model, state.params


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from aft_jax import decode

  _, corpus, model, params = load_run(FLAGS.workdir, FLAGS.step)
  text = decode.sample_text(
    model,
    params,
    corpus.vocab,
    FLAGS.prompt,
    FLAGS.length,
    temperature=FLAGS.temperature,
    top_k=FLAGS.top_k,
    seed=FLAGS.seed,
  )
  print(FLAGS.prompt + text)


if __name__ == "__main__":
  app.run(main)
