"""Quickstart: AFT-local, byte-level, on the Python documentation text (no download), CPU.

Finishes in a minute or two on 2 CPU cores, at a valid perplexity of about 4.5 on pydoc bytes
(2.16-2.17 bits per byte). For this budget (about 2M training bytes) short contexts win: 64
bytes of context and 32 sequences per step learn faster than 128 x 16 (the same bytes per step),
and a higher peak rate with a longer warmup trains stably; max_len = seq_len, so sampling never
reaches positions that training did not (past 64 bytes the context slides).
"""

from aft_jax.trainer.default_config import get_config as _base


def get_config():
  config = _base()
  config.data.dataset = "pydoc"
  config.data.tokenizer = "byte"
  config.model.mixing = "aft_local"
  config.model.num_layers = 2
  config.model.d_model = 128
  config.model.mlp_dim = 384
  config.model.max_len = 64
  config.model.window = 32
  config.model.dropout_rate = 0.0
  config.seq_len = 64
  config.batch_size = 32
  config.num_train_steps = 1000
  config.learning_rate = 5e-3
  config.warmup_steps = 100
  config.log_every_steps = 50
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 200
  config.eval_batch_size = 64
  config.sample.prompt = "The "
  config.sample.length = 200
  return config
