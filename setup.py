"""The packages in the wheel: aft_jax/ and its subpackages, plus the recipes.

The recipes stay in the top-level configs/ folder (``python train.py --config
configs/quickstart.py`` in a checkout); the wheel carries the same files as the package
``aft_jax.configs``, so that an installed ``aft-train --config quickstart`` finds them by name
without the repository. pyproject.toml cannot say this: its package finder does not follow a
package-dir mapping. Everything else about the project is in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
  packages=find_packages(include=["aft_jax", "aft_jax.*"]) + ["aft_jax.configs"],
  package_dir={"aft_jax.configs": "configs"},
  # The GPU descriptions that deviceless compiles (aft_jax.deviceless, --dry_run) target.
  package_data={"aft_jax": ["gpu_specs/*.txtpb", "gpu_specs/README.md"]},
)
