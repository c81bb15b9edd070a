"""aft-jax: the Attention Free Transformer (Zhai et al., 2021, arXiv 2105.14103) in JAX/Flax.
``import aft_jax`` imports no module (not jax): a command checks JAX_* variables before jax."""

import importlib

_SUBMODULES = ("adaptive", "layers", "model", "nnx_modules", "ops")


def __getattr__(name: str):
  if name in _SUBMODULES:
    return importlib.import_module(f"aft_jax.{name}")
  raise AttributeError(f"module 'aft_jax' has no attribute {name!r}")


def load_pretrained(path: str, api: str = "linen"):
  """(TransformerLM, params, Vocab) from a file written by ``aft-export`` (no Orbax needed) or
  a workdir (its newest checkpoint); ``api="nnx"``: (the model as an ``nnx.Module``, Vocab)."""
  # Imported here, not at the top, so that `python -m aft_jax.tools.export` runs a fresh module.
  from aft_jax.tools import export  # pylint: disable=g-import-not-at-top

  return export.load_pretrained(path, api)


__version__ = "0.1.0"
__all__ = ["adaptive", "layers", "load_pretrained", "model", "nnx_modules", "ops"]
