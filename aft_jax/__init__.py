"""aft-jax: the Attention Free Transformer (Zhai et al., 2021, arXiv 2105.14103) in JAX/Flax.

    Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w[t, t']) V_t' / sum_t' exp(K_t' + w[t, t'])

Packages and modules, lowest first (each imports only those above it):
  ops        the AFT maths as pure functions (aft_full, aft_local, aft_simple, aft_conv1d/2d)
             and their Pallas kernels
  layers     Flax linen modules: AFTFull, AFTLocal, AFTSimple, AFTConv1D, AFTConv2D and the
             softmax MultiHeadAttention baseline, with incremental decoding
  model      the decoder-only language model (ModelConfig, TransformerLM); adaptive: adaptive
             input and softmax; decode: sampling
  nnx_bridge the layers and the model from Flax NNX (flax.nnx.bridge.ToNNX): init, apply, decode
  data, sharding, workdir, deviceless   corpora, device meshes, a run's files, compiling for
             devices that are not here (imported on demand)
  trainer    train_and_evaluate, checkpoints, the command line (aft-train)
  tools      generate, evaluate, export: commands for a trained run

load_pretrained(path) -> (model, params, vocab) reads a file written by aft_jax.tools.export.

``import aft_jax`` imports no module (and so not jax): ``aft_jax.ops`` and the others load on
first use, so that a command (``aft-train``, ``aft-evaluate``) can say in one line what is wrong
with a JAX_* environment variable, which jax reads, and may refuse, when it is imported.
"""

import importlib

_SUBMODULES = ("adaptive", "layers", "model", "ops")


def __getattr__(name: str):
  """``aft_jax.ops`` and the other ``_SUBMODULES``, imported on first use."""
  if name in _SUBMODULES:
    return importlib.import_module(f"aft_jax.{name}")
  raise AttributeError(f"module 'aft_jax' has no attribute {name!r}")


def load_pretrained(path: str):
  """(model, params, vocab) from a file written by ``python -m aft_jax.tools.export``.

  ``model`` is an ``aft_jax.model.TransformerLM``, ``params`` its parameters, ``vocab`` its
  ``aft_jax.data.Vocab``; needs neither Orbax nor the run's workdir nor its dataset.
  """
  # Imported here, not at the top, so that `python -m aft_jax.tools.export` runs a fresh module.
  from aft_jax.tools import export  # pylint: disable=g-import-not-at-top

  return export.load_pretrained(path)


__version__ = "0.1.0"
__all__ = ["adaptive", "layers", "load_pretrained", "model", "ops"]
