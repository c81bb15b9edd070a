"""notebooks/quickstart.ipynb runs top to bottom in quick mode, from a clean kernel."""

import os

import nbformat
from nbclient import NotebookClient

from conftest import ROOT

PATH = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


def test_committed_notebook_has_no_outputs():
  nb = nbformat.read(PATH, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None


def test_notebook_runs_in_quick_mode(monkeypatch):
  monkeypatch.setenv("AFT_QUICK", "1")
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  nb = nbformat.read(PATH, as_version=4)
  NotebookClient(
    nb,
    timeout=600,
    kernel_name="python3",
    resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}},
  ).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "quick mode" in text
  assert "AFTSimple matches the NumPy equation" in text
  assert "validation perplexity" in text
  assert text.count("The ") >= 1
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 2  # the loss curve and the bias heatmap
