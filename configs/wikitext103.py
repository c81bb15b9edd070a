"""WikiText-103, the "small" setting of the linear-attention literature, one mixing layer each.

    python train.py --config configs/wikitext103.py:aft_local --workdir runs/wt103_local

The argument is the mixing layer: aft_local (default; the paper's AFT-local-32), aft_simple,
aft_full, aft_conv1d (8 heads, kernel 31) or softmax (the Transformer baseline). The model is
the small setting of Schlag et al. (2021), "Linear Transformers Are Secretly Fast Weight
Programmers": 16 layers, d_model 128, 8 heads, MLP 2048, context 256, adaptive input and softmax
(cutoffs 20k / 40k / 200k, tied), word level; ~40M parameters, mostly embeddings. Needs the data
(python -m aft_jax.data.prepare --dataset wikitext103) and a GPU/TPU.
"""

from aft_jax.default_config import get_config as _base
from aft_jax.model import MIXINGS


def get_config(mixing: str = "aft_local"):
  if mixing not in MIXINGS:
    raise ValueError(f"configs/wikitext103.py:<mixing>: {mixing!r} is not one of {MIXINGS}")
  config = _base()
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
