"""No import cycle in ``aft_jax``, no lower layer imports a higher one (every import statement)."""

import ast
import graphlib
import os

from tests.support.helpers import ROOT

# Layer -> the packages and modules it must not import (ever, even inside a function).
FORBIDDEN = {
  "aft_jax.ops": ("aft_jax.layers", "aft_jax.model", "aft_jax.data", "aft_jax.trainer"),
  "aft_jax.layers": ("aft_jax.model", "aft_jax.trainer", "aft_jax.tools", "aft_jax.data"),
  "aft_jax.model": ("aft_jax.trainer", "aft_jax.tools", "aft_jax.data"),
  "aft_jax.nnx_modules": ("aft_jax.trainer", "aft_jax.tools", "aft_jax.data"),
  "aft_jax.data": ("aft_jax.ops", "aft_jax.layers", "aft_jax.model", "aft_jax.trainer"),
  "aft_jax.sharding": ("aft_jax.model", "aft_jax.trainer", "aft_jax.tools", "aft_jax.data"),
  "aft_jax.workdir": ("aft_jax.trainer", "aft_jax.tools", "aft_jax.model"),
  "aft_jax.trainer": ("aft_jax.tools",),
}


def test_no_import_cycle_and_no_lower_layer_imports_a_higher_one():
  modules = {}  # "aft_jax.trainer.train_lib": its path
  for folder, _, names in os.walk(os.path.join(ROOT, "aft_jax")):
    for path in (os.path.join(folder, n) for n in names if n.endswith(".py")):
      name = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
      modules[name.removesuffix(".__init__")] = path

  def known(name):
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name

  graph = {}
  for module, path in modules.items():
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    deps = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
      if isinstance(node, ast.Import):
        deps |= {known(a.name) for a in node.names if a.name.split(".")[0] == "aft_jax"}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the package, level - 1 packages up
          parts = package.split(".")[: len(package.split(".")) - node.level + 1]
          base = ".".join(parts + ([base] if base else []))
        if base.split(".")[0] == "aft_jax":
          for a in node.names:
            full = f"{base}.{a.name}"
            deps.add(full if full in modules else known(base))
    graph[module] = deps - {module, ""}  # (``from x import y``: x.y if a module, else x)
  assert len(graph) > 30 and "aft_jax.trainer.train_lib" in graph  # the walk found the package
  assert {"aft_jax.workdir", "aft_jax.trainer.step_log"} <= graph["aft_jax.trainer.train_lib"]
  graphlib.TopologicalSorter(graph).prepare()  # a CycleError names a cycle
  wrong = [
    f"{module} imports {d}"
    for module, deps in graph.items()
    for layer, banned in FORBIDDEN.items()
    if module == layer or module.startswith(layer + ".")
    for d in deps
    if any(d == b or d.startswith(b + ".") for b in banned)
  ]
  assert wrong == []
