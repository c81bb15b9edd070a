"""The wheel in a fresh venv playing a Colab runtime with the oldest supported jax: the notebook's
install cell keeps that jax, the notebook runs, aft-train finds a recipe (needs the registry)."""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import nbformat
import pytest
from nbclient import NotebookClient

from tests.support.helpers import ROOT, config_flags, tiny_config

from aft_jax.trainer import recipes

PYPROJECT = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))


def _run(cmd, name, **kw):
  proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
  assert proc.returncode == 0, f"{name} failed ({cmd}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
  return proc.stdout


def _source_tree(dest):
  """The files a clone has (tracked, and untracked ones not ignored): no caches, no build/."""
  git = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
  files = subprocess.run(git, cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
  for f in filter(None, (f.decode() for f in files)):
    if os.path.isfile(os.path.join(ROOT, f)):  # not deleted since the last commit
      os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
      shutil.copy2(os.path.join(ROOT, f), os.path.join(dest, f))


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_keeps_the_runtimes_jax(tmp_path, monkeypatch):
  assert not str(tmp_path).startswith(ROOT)
  deps = "\n".join(PYPROJECT["project"]["dependencies"])
  (jax_version,) = re.findall(r"^jax>=([\w.]+)", deps, re.M)  # pyproject.toml's lower bound
  monkeypatch.setenv("PIP_NO_COMPILE", "1")
  monkeypatch.delenv("PYTHONPATH", raising=False)  # nothing from the checkout in the venv

  # The wheel built (by uv: faster) while the venv is made; the install cell uses pip, as Colab.
  src, dist = tmp_path / "src", tmp_path / "dist"
  _source_tree(src)
  uv = [sys.executable, "-m", "uv"]
  build = [*uv, "build", "--wheel", "--out-dir", str(dist), "-q", str(src)]
  builder = subprocess.Popen(build, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

  # The runtime: the oldest supported jax, a kernel, matplotlib and Colab's JAX libraries.
  venv = tmp_path / "venv"
  _run([*uv, "venv", "-q", "--seed", "--python", sys.executable, str(venv)], "venv")
  py, bin_dir = str(venv / "bin" / "python"), venv / "bin"
  runtime = [f"jax=={jax_version}", f"jaxlib=={jax_version}", "ipykernel", "matplotlib"]
  runtime += ["flax", "optax", "chex", "orbax-checkpoint", "tensorflow-datasets"]
  _run([*uv, "pip", "install", "-q", "--python", py, *runtime], "runtime jax")
  log = builder.communicate()[0]
  assert builder.returncode == 0, f"uv build failed:\n{log[-3000:]}"
  (wheel,) = dist.glob("aft_jax-*.whl")

  # Asked for something that needs a newer jax, pip refuses and the cell says what to do.
  nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
  (tmp_path / "install_cell.py").write_text(nb.cells[1].source)
  env = dict(os.environ, AFT_JAX_SOURCE=f"jax>{jax_version}")
  proc = subprocess.run([py, "install_cell.py"], cwd=tmp_path, env=env, capture_output=True,
                        text=True)  # fmt: skip
  assert proc.returncode != 0, proc.stdout
  assert "conflicting dependencies" in proc.stdout, proc.stdout[-3000:]  # pip's, shown by the cell
  assert f"next to this runtime's jax {jax_version}" in proc.stderr, proc.stderr[-3000:]

  # The notebook in that runtime, its kernel outside the repository, no PYTHONPATH.
  kernels = tmp_path / "jupyter" / "kernels" / "wheel-venv"
  kernels.mkdir(parents=True)
  argv = [py, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
  (kernels / "kernel.json").write_text(json.dumps({"argv": argv, "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("AFT_QUICK", "1")
  monkeypatch.setenv("AFT_JAX_SOURCE", str(wheel))
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  NotebookClient(
    nb, timeout=600, kernel_name="wheel-venv", resources={"metadata": {"path": str(tmp_path)}}
  ).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  kept = {"jax": jax_version, "jaxlib": jax_version}
  assert f"kept {kept} on cpu" in text, text[:3000]
  said = ["quick mode", "AFTSimple matches the NumPy equation", "validation perplexity"]
  said.append("same log-probs: True")  # the NNX cell
  assert [s for s in said if s not in text] == []
  assert text.count("The ") >= 1
  assert "softmax attention" in text and "T=512" in text  # the timing cell's last length
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 3  # the loss curve, the bias heatmap, the timing plot

  show = "import importlib.metadata as m, importlib.util as u; print(u.find_spec('aft_jax')"
  show += ".origin, m.version('jax'), m.version('jaxlib'))"
  path, jax_now, jaxlib_now = _run([py, "-c", show], "versions", cwd=tmp_path).split()
  assert (jax_now, jaxlib_now) == (jax_version, jax_version)
  assert path.startswith(str(venv)) and "site-packages" in path

  # The recipes ship in the wheel and the console script finds one by name.
  workdir = tmp_path / "run"
  train = [str(bin_dir / "aft-train"), "--config", "quickstart", "--workdir", str(workdir)]
  _run(train + config_flags(tiny_config(num_train_steps=3)), "aft-train", cwd=tmp_path)
  results = json.load(open(workdir / "results.json"))
  assert results["steps"] == 3 and results["valid_ppl"] > 1


def test_the_wheel_ships_every_recipe_and_console_script(tmp_path, monkeypatch):
  scripts = {"aft-train", "aft-generate", "aft-evaluate", "aft-export", "aft-prepare"}
  assert scripts <= set(PYPROJECT["project"]["scripts"])
  # (each one's function runs in tests/e2e/test_docs.py, as the docs' commands name them all)
  assert "quickstart" in recipes.available()
  assert recipes.recipe_dir() == os.path.join(ROOT, "configs")
  # A recipe name resolves to the packaged file; an unknown one is named.
  for spec in ("quickstart", "quickstart:arg"):
    path, _, arg = recipes.resolve(spec).partition(":")
    assert path == os.path.join(ROOT, "configs", "quickstart.py") and arg == spec[11:]
  monkeypatch.chdir(ROOT)
  assert recipes.resolve("configs/quickstart.py:x") == "configs/quickstart.py:x"  # a path stays
  with pytest.raises(ValueError, match=r"unknown recipe 'nope'; the recipes are: .*quickstart"):
    recipes.resolve("nope")
  missing = str(tmp_path / "nope.py")
  with pytest.raises(ValueError, match=rf"no config file '{missing}': give the path of a"):
    recipes.resolve(missing + ":arg")
