"""notebooks/quickstart.ipynb is committed clean, and it, the README, docs/ and pyproject.toml agree
on the repository. (tests/e2e/test_wheel.py runs the notebook, against the installed wheel.)"""

import glob
import os
import re
import tomllib

import nbformat

from tests.support.helpers import ROOT

PATH = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
NOTEBOOK = nbformat.read(PATH, as_version=4)
README = open(os.path.join(ROOT, "README.md")).read()
DOCS = "".join(open(p).read() for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))))
PYPROJECT = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))
URL = PYPROJECT["project"]["urls"]["Repository"]


def test_committed_notebook_has_no_outputs():
  for cell in NOTEBOOK.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None


def test_the_repository_url_is_the_one_in_pyproject():
  owner_repo = re.fullmatch(r"https://github\.com/([\w.-]+/[\w.-]+)", URL).group(1)
  badge = (
    f"https://colab.research.google.com/github/{owner_repo}/blob/main/notebooks/quickstart.ipynb"
  )
  install_cell = NOTEBOOK.cells[1].source
  for where, text in [("README", README), ("notebook", NOTEBOOK.cells[0].source)]:
    links = re.findall(r"https://colab\.research\.google\.com/github/[^)\s]+", text)
    assert links == [badge], (where, links)
  # Every pip source that names a repository names this one: the install cell's default and
  # the install lines of the README and docs/.
  sources = re.findall(r"git\+(https://[^\s\"']+)", README + DOCS + install_cell)
  assert f'"aft-jax @ git+{URL}"' in install_cell
  assert sources and set(sources) == {URL}, sources


def test_install_lines_for_each_platform_and_the_jax_the_notebook_names():
  install = README[README.index("## Install") :]
  first_block = install.split("```")[1]  # the section starts with the install lines
  joined = "\n".join(line for line in first_block.splitlines() if "pip install" in line)
  for extra in ("", "[cuda12]", "[tpu]"):
    assert f'"aft-jax{extra} @ git+{URL}"' in joined, extra
  extras = PYPROJECT["project"]["optional-dependencies"]
  assert extras["cuda12"] == ["jax[cuda12]"] and extras["tpu"] == ["jax[tpu]"]
  # The install cell's message says which jax aft-jax needs: pyproject.toml's lower bound.
  (jax_req,) = [r for r in PYPROJECT["project"]["dependencies"] if re.match(r"jax\b", r)]
  floor = jax_req.split(">=")[1]
  assert f"needs jax >= {floor}" in NOTEBOOK.cells[1].source


def test_every_recipe_the_notebook_and_readme_name_exists():
  from aft_jax.trainer import recipes

  text = README + DOCS + "".join(c.source for c in NOTEBOOK.cells)
  names = re.findall(r"aft-train --config ([\w:]+)", text)
  assert "quickstart" in names
  for name in names:
    assert os.path.exists(recipes.resolve(name).split(":")[0]), name
