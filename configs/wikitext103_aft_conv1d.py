"""WikiText-103, small setting (16 layers, d_model 128, context 256, adaptive input/softmax):
AFT mixing layer aft_conv1d. Needs the data (python -m aft_jax.data.prepare) and a GPU/TPU."""

from aft_jax.default_config import wikitext103_small


def get_config():
  return wikitext103_small("aft_conv1d")
