"""The default configuration: every key a config may set, with its type and meaning.

Recipes in ``configs/`` start from ``get_config()`` and change what they need; ``check_config``
refuses any key that is not here. ``config.model`` is built from ``aft_jax.model.ModelConfig``
(where each model setting is defined and documented), so the two cannot disagree.
"""

import ml_collections

from aft_jax import sharding
from aft_jax.model import model_config_dict


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  config.data = ml_collections.ConfigDict()
  config.data.dataset = "pydoc"  # 'pydoc' (ships with Python), 'wikitext103' or 'enwik8'
  config.data.tokenizer = "byte"  # 'byte' or 'word'
  config.data.variant = "v1"  # WikiText-103: 'v1' (tokenised, <unk>) or 'raw_v1'
  # prepared datasets live in <data_dir>/prepared; '': $AFT_JAX_DATA, else ~/.cache/aft_jax
  config.data.data_dir = ""
  config.data.manual_dir = ""  # a folder holding the official zip or its extracted files
  # is the source the official release? 'auto': judge by its line counts / size (a file under
  # an official name with other counts is an error), 'yes': require it, 'no': a custom corpus
  config.data.official = "auto"

  config.model = model_config_dict()  # see aft_jax.model.ModelConfig for each key

  config.seed = 0  # parameters, dropout and the data order
  config.num_train_steps = 1000  # micro-steps (each one batch); updates = this / grad_accum_steps
  config.batch_size = 16  # global, in sequences, summed over all devices and processes
  config.seq_len = 128  # tokens per training sequence (<= model.max_len)
  config.learning_rate = 1e-3  # peak AdamW rate
  config.warmup_steps = 100  # linear warmup (updates), then cosine decay to 10% of the peak
  config.weight_decay = 0.01  # AdamW decoupled weight decay
  config.b1 = 0.9  # AdamW first-moment decay
  config.b2 = 0.98  # AdamW second-moment decay
  config.grad_clip_norm = 1.0  # clip the global gradient norm to this
  config.grad_accum_steps = 1  # > 1: optax.MultiSteps, one update every k steps

  config.log_every_steps = 50  # metrics to the console, metrics.jsonl and TensorBoard
  config.eval_every_steps = 500  # validation perplexity during training
  config.checkpoint_every_steps = 500  # Orbax checkpoints (also at the end and on SIGTERM)
  config.keep_checkpoints = 2  # how many recent checkpoints to keep
  config.eval_batch_size = 16  # global, in windows of seq_len tokens
  config.eval_stride = 0  # validation during training: > 0 sliding windows, 0 disjoint windows
  # The final valid/test numbers in results.json: 0 disjoint windows of seq_len; S > 0 sliding
  # windows that score S new tokens each (1: every token with seq_len - 1 tokens of context)
  config.final_eval_stride = 0
  config.nonfinite = "skip"  # non-finite loss/gradient: 'skip' the update or 'stop'
  # 'skip': stop the run when this many updates in a row were skipped (diverged); 0: never
  config.max_consecutive_skips = 10
  # (start, stop): a jax.profiler trace of steps start+1 .. stop in <workdir>/tensorboard
  # (TensorBoard's profile tab); () or None: no trace
  config.profile_steps = ()

  config.sample = ml_collections.ConfigDict()  # the sample printed at the end of a run
  config.sample.prompt = ""  # text to continue ('' starts after an end-of-line)
  config.sample.length = 200  # tokens to generate (0: no sample)
  config.sample.temperature = 0.8  # 0: greedy
  config.sample.top_k = 0  # sample among the k most likely tokens (0: all)

  config.mesh = ml_collections.ConfigDict()  # device mesh; data x fsdp x tensor = #devices
  config.mesh.data = -1  # data parallelism; -1: all remaining devices
  config.mesh.fsdp = 1  # data parallelism with sharded parameters and optimizer state
  config.mesh.tensor = 1  # tensor parallelism (MLP units, AFT channels, heads, vocabulary)
  # logical axis name -> mesh axes (a list of [name, axis] pairs; only settable in a file)
  config.logical_axis_rules = [list(r) for r in sharding.DEFAULT_RULES]
  return config


def override(config: ml_collections.ConfigDict, values: dict) -> ml_collections.ConfigDict:
  """Sets dotted keys (``{"model.d_model": 16}``) in place, as ``--config.KEY=VALUE`` does."""
  for key, value in values.items():
    node = config
    *parents, leaf = key.split(".")
    for name in parents:
      node = node[name]
    node[leaf] = value
  return config
