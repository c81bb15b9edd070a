"""The training recipes by name (``--config wikitext103:ARG``): ``configs/NAME.py`` in a checkout,
the package ``aft_jax.configs`` in a wheel; a config file path is accepted wherever a name is.
"""

import importlib.util
import os

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # aft_jax/


def recipe_dir() -> str:
  """The folder holding the recipes: the installed package's copy, else the checkout's."""
  installed = os.path.join(_PACKAGE, "configs")
  if os.path.isdir(installed):
    return installed
  root = os.path.dirname(_PACKAGE)
  # Only a checkout of this project (a pyproject.toml beside aft_jax/), not any folder "configs".
  if os.path.isfile(os.path.join(root, "pyproject.toml")):
    return os.path.join(root, "configs")
  raise FileNotFoundError(f"no recipes found: neither {installed} nor a checkout around {_PACKAGE}")


def available() -> list[str]:
  """The recipe names, sorted."""
  files = os.listdir(recipe_dir())
  return sorted(f[:-3] for f in files if f.endswith(".py") and not f.startswith("_"))


def resolve(spec: str) -> str:
  """``spec`` as the config flag loads it: ``NAME[:ARG]`` -> ``<recipe_dir>/NAME.py[:ARG]``."""
  name, sep, arg = spec.partition(":")
  if "/" in name or os.sep in name or name.endswith(".py"):
    if not os.path.isfile(name):
      where = "" if os.path.isabs(name) else f" (from {os.getcwd()})"
      raise ValueError(
        f"no config file {name!r}{where}: give the path of a config file, or a recipe name: "
        f"{', '.join(available())}"
      )
    return spec
  names = available()
  if name not in names:
    raise ValueError(
      f"unknown recipe {name!r}; the recipes are: {', '.join(names)} "
      "(give NAME or NAME:ARG, or the path of a config file)"
    )
  return os.path.join(recipe_dir(), name + ".py") + sep + arg


def load(spec: str):
  """``spec``'s config: its file's get_config(ARG), or get_config() if no ``:ARG`` is given."""
  path, sep, arg = resolve(spec).partition(":")
  module_spec = importlib.util.spec_from_file_location("config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if sep else module.get_config()
