"""Train on your own text: any UTF-8 files, one document each, with a subword vocabulary.

    aft-train --config text --workdir runs/mine --config.data.train_files="~/notes/**/*.md"
    aft-train --config "text:~/notes/**/*.md" --workdir runs/mine       # the same

By default it trains on the Python standard library's own sources (the ``*.py`` files beside
``os.py``: about 170 files, 4.7 MB, on every machine with Python), so it runs as it is. The
vocabulary is a 4,096-piece SentencePiece model learned on the train split (docs/data.md says
why SentencePiece); results.json gives validation and test perplexity per piece and bits per
byte, which compares across vocabularies. The model (AFT-local, 4 layers of d 256, context 256)
is sized for a few MB of text on one GPU, or a patient CPU; the keys marked EDIT are the ones to
change for your data.
"""

import os

from aft_jax.trainer.default_config import get_config as _base

STDLIB = os.path.dirname(os.__file__)


def get_config(files: str = ""):
  """``files``: the train files' globs (the part after ``text:``); default the stdlib's."""
  config = _base()
  data = config.data
  data.dataset = "text"
  # EDIT: your files, comma-separated globs ("**" recurses); each file is one document
  data.train_files = files or os.path.join(STDLIB, "*.py")
  # EDIT: held-out files (globs); left empty, valid_fraction / test_fraction of the train
  # files' documents are held out instead (chosen by a hash of each path: deterministic)
  data.valid_files = ""
  data.test_files = ""
  data.valid_fraction = 0.1
  data.test_fraction = 0.1
  data.encoding = "utf-8"  # EDIT if your files are not UTF-8 (e.g. "latin-1")
  # EDIT: 'subword' (learned on the train split), 'byte' (256 ids, nothing to learn) or 'word'
  data.tokenizer = "subword"
  # EDIT: subword pieces; a few MB of text: 2k-8k; hundreds of MB: 16k-32k (bytes and words
  # have their own sizes: with them, set 0, or the run notes that it is not used)
  data.vocab_size = 4096
  # EDIT: True fills training rows with whole documents (each seeing only itself); measured
  # on this recipe (docs/data.md, "Packing, measured") it gave the same bpb after 20 steps at
  # 4.1x the step time (AFT-local's packed path), so it is off here: turn it on for many short
  # documents (JSONL corpora), where stream rows mix documents
  data.packing = False

  m = config.model
  m.mixing = "aft_local"  # EDIT: aft_local, aft_simple, aft_full, aft_conv1d or softmax
  m.num_layers = 4  # EDIT: model size: layers ...
  m.d_model = 256  # ... width ...
  m.mlp_dim = 1024  # ... and MLP width (4 x d_model)
  m.window = 64  # AFT-local's window s (positions with a learned bias)
  m.max_len = 256
  m.dropout_rate = 0.1
  config.seq_len = 256  # EDIT: context in pieces (<= model.max_len)
  config.batch_size = 32  # EDIT: sequences per step, over all devices
  config.num_train_steps = 5000  # EDIT: training length
  config.learning_rate = 1e-3
  config.warmup_steps = 200
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.eval_batch_size = 32
  config.sample.prompt = "def "
  config.sample.length = 200
  return config
