"""WikiText-103, the "small" setting of Schlag et al. (2021), "Linear Transformers Are Secretly
Fast Weight Programmers" (ICML; arXiv 2102.11174), one mixing layer each.

    python train.py --config configs/wikitext103.py:aft_local --workdir runs/wt103_local

The argument is the mixing layer: aft_local (default; the AFT paper's AFT-local-32), aft_simple,
aft_full, aft_conv1d (8 heads, kernel 31), aft_decay or softmax (the Transformer baseline). Needs
the data (python -m aft_jax.data.prepare --dataset wikitext103) and a GPU/TPU.

How many devices (compiled for the target without a device, docs/what_fits.md; check yours with
``--dry_run --target NAME [--num_devices N]``): the train step needs ~24 GiB on one device
(AFT-conv1d 31 GiB, softmax 29 GiB): one A100 (40 or 80 GB) fits all but AFT-conv1d on the 40
GB one; a T4 (16 GB) needs 8 devices (~4 GiB each) or
``--config.batch_size=24 --config.grad_accum_steps=4`` (6.7 GiB for AFT-local); a TPU v5e
chip (16 GiB) needs 8 chips.

Where each number comes from. "Script" is the small setting's published training script,
``example_scripts/2021_linear_transformers_are_secretly_fwps/small_standard_transformer_baseline.sh``
of github.com/IDSIA/lmtool-fwp; "train.py" is that project's ``src/train.py`` (its defaults apply
where the script passes no flag); "eval" is its ``src/eval_sliding_window.py``.

- Model (script): 16 layers, d_model 128, 8 heads of 16, MLP (d_inner) 2048, dropout 0.1,
  context (tgt_len) 256 with no memory (mem_len 0); adaptive input and softmax (--adaptive) with
  cutoffs 20000 / 40000 / 200000 (train.py, for wt103), every cluster of dimension d_model
  (div_val 1, train.py's default: ``adaptive_factor = 1``), tied (train.py: tied unless
  --not_tied). About 40M parameters, mostly the 267,735-word embedding.
- Optimiser (script): Adam (not AdamW: no weight decay) with PyTorch's default betas
  (0.9, 0.999), learning rate 2.5e-4, linear warmup over 2000 steps, 500,000 steps of 96
  sequences (about 119 epochs of the 103M training tokens); global-norm gradient clipping at
  0.25 (train.py's default --clip); cosine decay (train.py's default --scheduler) to eta_min 0.
  Float32 (the script passes no --fp16).
- Evaluation (eval, with the script's valid/eval commands): a sliding window of 256 tokens with
  batch 1 in which the first window scores all its tokens and every later window, one token
  further on, scores only its last token: ``final_eval_stride = 1`` here, used for
  ``valid_ppl`` / ``test_ppl`` in results.json (``eval_protocol`` says so). Training-time
  validation uses disjoint windows (``eval_stride = 0``) for speed, as theirs does.
- Published perplexities (valid / test, Table 2 of the paper, small setting): Transformer
  33.0 / 34.1, Linear Transformer 37.1 / 38.3, Performer 39.0 / 39.6 (the rows with the "sum"
  update rule).

Differences that remain (this trainer's, not the script's): our cosine ends at 10% of the peak,
not 0; our blocks are pre-LayerNorm (the script's baseline passes no --pre_lnorm, so it is
post-LN) with learned absolute positions; their first evaluation window does not score the
split's first token, ours scores it with ``<eos>`` as context (1 token in 245,569). AFT-local's
window 32 is the AFT paper's; AFT-conv1d's 8 heads and kernel 31 are our choice (no published
WikiText-103 AFT runs exist in this setting).
"""

from aft_jax.trainer.default_config import get_config as _base
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
  m.window = 32
  m.kernel_size = 31
  m.factor_dim = 0
  m.dropout_rate = 0.1
  m.dtype = "float32"
  m.scan_layers = True
  m.adaptive_cutoffs = (20000, 40000, 200000)
  m.adaptive_factor = 1.0
  m.tie_embeddings = True
  config.seq_len = 256
  config.batch_size = 96
  config.num_train_steps = 500_000
  config.learning_rate = 2.5e-4
  config.warmup_steps = 2000
  config.weight_decay = 0.0
  config.b1 = 0.9
  config.b2 = 0.999
  config.grad_clip_norm = 0.25
  config.log_every_steps = 200
  config.eval_every_steps = 10_000
  config.checkpoint_every_steps = 2000
  # Windows per evaluation batch: the final sliding-window pass scores one token per window,
  # so a split of n tokens is n windows; 256 of them fill a GPU better than batch 1 does.
  config.eval_batch_size = 256
  config.eval_stride = 0
  config.final_eval_stride = 1
  config.sample.prompt = "The"
  config.sample.length = 50
  return config
