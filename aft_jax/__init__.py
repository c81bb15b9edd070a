"""aft-jax: the Attention Free Transformer (Zhai et al., 2021, arXiv 2105.14103) in JAX/Flax."""

__version__ = "0.1.0"
