"""Quickstart: AFT-local, byte-level, on the Python documentation text (no download), CPU.

Finishes in about 1.5 minutes on 2 CPU cores (valid perplexity ~4.6 on pydoc bytes).
"""

from aft_jax.default_config import get_config as _base


def get_config():
  config = _base()
  config.data.dataset = "pydoc"
  config.data.tokenizer = "byte"
  config.model.mixing = "aft_local"
  config.model.num_layers = 2
  config.model.d_model = 128
  config.model.mlp_dim = 384
  config.model.max_len = 128
  config.model.window = 16
  config.model.dropout_rate = 0.0
  config.seq_len = 128
  config.batch_size = 16
  config.num_train_steps = 1000
  config.learning_rate = 3e-3
  config.warmup_steps = 50
  config.log_every_steps = 50
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 200
  config.eval_batch_size = 64
  config.sample.prompt = "The "
  config.sample.length = 200
  return config
