"""aft-jax: the Attention Free Transformer (Zhai et al., 2021, arXiv 2105.14103) in JAX/Flax.

    Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w[t, t']) V_t' / sum_t' exp(K_t' + w[t, t'])

Modules:
  ops        the AFT maths as pure functions (aft_full, aft_local, aft_simple, aft_conv1d/2d)
  layers     Flax linen modules: AFTFull, AFTLocal, AFTSimple, AFTConv1D, AFTConv2D and the
             softmax MultiHeadAttention baseline, with incremental decoding
  model      the decoder-only language model (ModelConfig, TransformerLM)
  adaptive   adaptive input and adaptive softmax
  data, sharding, train_lib, decode   the trainer's pieces (imported on demand)
  generate, evaluate, export           commands for a trained run (python -m aft_jax.<name>)

load_pretrained(path) -> (model, params, vocab) reads a file written by aft_jax.export.
"""

from aft_jax import adaptive, layers, model, ops


def load_pretrained(path: str):
  """(model, params, vocab) from a file written by ``python -m aft_jax.export``.

  ``model`` is an ``aft_jax.model.TransformerLM``, ``params`` its parameters, ``vocab`` its
  ``aft_jax.data.Vocab``; needs neither Orbax nor the run's workdir nor its dataset.
  """
  # Imported here, not at the top, so that `python -m aft_jax.export` runs a fresh module.
  from aft_jax import export  # pylint: disable=g-import-not-at-top

  return export.load_pretrained(path)


__version__ = "0.1.0"
__all__ = ["adaptive", "layers", "load_pretrained", "model", "ops"]
