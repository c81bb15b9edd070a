"""The default configuration: every key a config may set, with its type (configs/ override it)."""

import ml_collections

from aft_jax import sharding


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  config.data = ml_collections.ConfigDict()
  config.data.dataset = "pydoc"  # 'pydoc' (ships with Python, no download) or 'wikitext103'
  config.data.tokenizer = "byte"  # 'byte' or 'word'
  config.data.variant = "v1"  # WikiText-103: 'v1' (tokenised, <unk>) or 'raw_v1'
  config.data.data_dir = "data"
  config.data.manual_dir = ""  # a folder holding the official zip or its extracted files

  config.model = ml_collections.ConfigDict()
  config.model.mixing = "aft_local"  # aft_full, aft_local, aft_simple, aft_conv1d, softmax
  config.model.num_layers = 2
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.mlp_dim = 512
  config.model.max_len = 256
  config.model.window = 32
  config.model.kernel_size = 7
  config.model.factor_dim = 0
  config.model.dropout_rate = 0.1
  config.model.dtype = "float32"  # compute dtype; bfloat16 on GPU/TPU
  # AFT ops' implementation: "auto" (Pallas kernels on GPU where one exists, XLA elsewhere),
  # "xla", "pallas" (error where no kernel exists) or "pallas_interpret" (kernels on CPU: tests).
  config.model.impl = "auto"
  config.model.param_dtype = "float32"
  config.model.remat = False
  config.model.scan_layers = False
  config.model.tie_embeddings = True
  config.model.adaptive_cutoffs = ml_collections.FieldReference(None, field_type=tuple)
  config.model.adaptive_factor = 4.0

  config.seed = 0
  config.num_train_steps = 1000
  config.batch_size = 16  # global, in sequences
  config.seq_len = 128
  config.learning_rate = 1e-3
  config.warmup_steps = 100
  config.weight_decay = 0.01
  config.b1 = 0.9
  config.b2 = 0.98
  config.grad_clip_norm = 1.0
  config.grad_accum_steps = 1  # > 1: optax.MultiSteps, one update every k steps

  config.log_every_steps = 50
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.keep_checkpoints = 2
  config.eval_batch_size = 16
  config.eval_stride = 0  # > 0: sliding-window evaluation with this stride
  config.nonfinite = "skip"  # non-finite loss/gradient: 'skip' the update or 'stop'

  config.sample = ml_collections.ConfigDict()
  config.sample.prompt = ""
  config.sample.length = 200
  config.sample.temperature = 0.8
  config.sample.top_k = 0

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1  # -1: all remaining devices
  config.mesh.fsdp = 1
  config.mesh.tensor = 1
  config.logical_axis_rules = [list(r) for r in sharding.DEFAULT_RULES]
  return config


def wikitext103_small(mixing: str) -> ml_collections.ConfigDict:
  """The WikiText-103 "small" setting of the linear-attention literature (DESIGN.md section 5):
  16 layers, d_model 128, 8 heads, MLP 2048, context 256, adaptive input and softmax
  (cutoffs 20k / 40k / 200k, tied), word level; ~40M parameters, mostly embeddings."""
  config = get_config()
  config.data.dataset = "wikitext103"
  config.data.tokenizer = "word"
  config.data.variant = "v1"
  m = config.model
  m.mixing = mixing
  m.num_layers = 16
  m.d_model = 128
  m.num_heads = 8
  m.mlp_dim = 2048
  m.max_len = 256
  m.window = 32  # the paper's AFT-local-32
  m.kernel_size = 31
  m.factor_dim = 0
  m.dropout_rate = 0.1
  m.dtype = "bfloat16"
  m.scan_layers = True
  m.adaptive_cutoffs = (20000, 40000, 200000)
  config.seq_len = 256
  config.batch_size = 96
  config.num_train_steps = 120_000
  config.learning_rate = 1e-3
  config.warmup_steps = 2000
  config.weight_decay = 0.01
  config.log_every_steps = 200
  config.eval_every_steps = 10_000
  config.checkpoint_every_steps = 2000
  config.eval_batch_size = 32
  config.sample.prompt = "The"
  config.sample.length = 50
  return config
