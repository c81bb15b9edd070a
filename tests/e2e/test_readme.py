"""The README's commands and examples are the ones that run."""

import contextlib
import io
import os
import re

from tests.support.helpers import ROOT

README = open(os.path.join(ROOT, "README.md")).read()


def _blocks(lang):
  return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _commands(block):
  return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_readme_opens_with_the_quickstart_and_the_test_command():
  first, second = _blocks("bash")[:2]
  (install_and_train,) = _commands(first)
  (install_and_test,) = _commands(second)
  assert install_and_train.startswith("python3 -m pip install -e . && python3 train.py")
  assert "--config configs/quickstart.py" in install_and_train
  assert os.path.exists(os.path.join(ROOT, "configs", "quickstart.py"))
  # The deviceless compile tests need the GPU/TPU compilers, which the command installs first.
  assert install_and_test.startswith(
    'python3 -m pip install -e ".[test]" && python3 -m aft_jax.deviceless install && '
    "python3 -m pytest"
  )
  ci = open(os.path.join(ROOT, ".ci", "run")).read()
  assert install_and_test in ci


def test_readme_is_a_front_page_that_says_how_to_ask_what_fits():
  assert len(README.splitlines()) <= 300
  section = README[README.index("## Does it fit my GPU?") :].split("\n## ")[0]
  assert "python train.py --config " in section and "--dry_run --target NAME" in section
  assert "[--num_devices N]" in section and "(docs/what_fits.md)" in section


def test_using_the_layers_example_runs():
  (example,) = [b for b in _blocks("python") if "AFTLocal" in b]
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(example, "README.md", "exec"), {})
  assert out.getvalue().strip() == "(4, 100, 64)"


def test_readme_says_the_blog_formula_is_not_aft():
  assert "`sigma(Q) * (K^T V)`; that is not\nAFT" in README or "that is not AFT" in README


def test_help_on_the_layers_reads_well():
  import pydoc

  import aft_jax

  text = pydoc.render_doc(aft_jax.layers.AFTLocal, renderer=pydoc.plaintext)
  assert "AFT-local (paper Eq. 4)" in text and "window" in text
  for name in ("aft_full", "aft_local", "aft_simple", "aft_conv1d", "aft_conv2d"):
    doc = getattr(aft_jax.ops, name).__doc__
    assert "Args:" in doc and "Returns:" in doc and "[..., " in doc, name
