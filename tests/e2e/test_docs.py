"""The docs' commands, flags, recipes, config keys, targets, examples, links and paths are real;
the README's opening and notebooks/quickstart.ipynb agree."""

import contextlib
import glob
import importlib.util
import io
import itertools
import os
import pydoc
import re
import shlex
import sys
import tomllib

import nbformat

import aft_jax
from aft_jax import deviceless
from aft_jax.trainer import recipes
from tests.e2e import test_recipes
from tests.support import prefork
from tests.support.helpers import ROOT

PAGES = ["README.md"] + sorted(
  os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
TEXT = {page: open(os.path.join(ROOT, page)).read() for page in PAGES}
README, DOCS = TEXT["README.md"], "".join(TEXT[page] for page in PAGES[1:])
PYPROJECT = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))
SCRIPTS = PYPROJECT["project"]["scripts"]
URL = PYPROJECT["project"]["urls"]["Repository"]
NOTEBOOK = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
# Programs that are not this project's: only their being installed is checked.
EXTERNAL = {"pip", "pytest", "ruff"}
SEPARATORS = {"&&", "||", ";", "|", "&"}


def blocks(page, lang):
  """(line number, text, the line before the fence) of each ```lang block."""
  text = TEXT[page]
  out = []
  for m in re.finditer(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M):
    before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
    out.append((text.count("\n", 0, m.start()) + 1, m.group(1), before))
  return out


def _tokens(line):
  """shlex tokens of a shell line, quoted commands split too."""
  out = []
  for tok in shlex.split(line, comments=True):
    out.extend(_tokens(tok) if re.search(r"\s", tok) else [tok])
  return out


def commands():
  """(where, (kind: script, module or entry, name), args) of this project's commands."""
  out = []
  for page in PAGES:
    for lineno, block, _ in blocks(page, "bash"):
      for line in block.replace("\\\n", " ").splitlines():
        for is_separator, group in itertools.groupby(_tokens(line), lambda t: t in SEPARATORS):
          segment = list(group)
          heads = [i for i, t in enumerate(segment) if t in SCRIPTS or t in ("python", "python3")]
          if is_separator or not heads:
            continue
          i = heads[0]
          if segment[i] in SCRIPTS:
            prog, rest = ("entry", segment[i]), segment[i + 1 :]
          elif segment[i + 1] == "-m":
            prog, rest = ("module", segment[i + 2]), segment[i + 3 :]
          else:
            prog, rest = ("script", segment[i + 1]), segment[i + 2 :]
          out.append((f"{page}:{lineno}: {' '.join(segment)}", prog, rest))
  return out


def help_text(kind, name):
  """A program's absl --helpfull, else its argparse --help (status 2 for --helpfull)."""
  if kind == "entry":
    module, fn = SCRIPTS[name].split(":")  # run as its launcher runs it
    code = f"import sys; sys.argv[0] = {name!r}; from {module} import {fn}; sys.exit({fn}())"
    argv = ["-c", code]
  else:
    argv = ["-m", name] if kind == "module" else [name]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for flag in ("--helpfull", "--help"):
    done = prefork.run([sys.executable, *argv, flag], cwd=ROOT, env=env, timeout=600)
    if done.returncode != 2:  # argparse: an unknown argument
      break
  return done.stdout + done.stderr


def program_flags(text):
  """The long flags a program's help text names."""
  flags = set()
  for negatable, flag in re.findall(r"(?<![\w-])--(\[no\])?([A-Za-z][\w.-]*)", text):
    flags |= {flag, "no" + flag} if negatable else {flag}
  return flags


def _is_placeholder(value):
  return bool(re.search(r"[<>$]", value))


def _has_key(config, key):
  for part in key.split("."):
    if not hasattr(config, "keys") or part not in config.keys():
      return False
    config = config[part]
  return True


def _values(rest, flag):
  return re.findall(rf"(?<!\S)--{flag}[= ](\S+)", " ".join(rest))


def test_every_command_names_a_program_flags_recipe_config_keys_and_target_that_exist():
  assert {prog[0] for _, prog, _ in commands()} == {"script", "module", "entry"}
  for where, (kind, name), _ in commands():
    if kind == "script":
      assert os.path.isfile(os.path.join(ROOT, name)), where
    else:
      module = name if kind == "module" else SCRIPTS[name].split(":")[0]
      assert importlib.util.find_spec(module) is not None, where
  todo = [(w, p, r) for w, p, r in commands() if not (p[0] == "module" and p[1] in EXTERNAL)]
  texts = {prog: help_text(*prog) for prog in sorted({prog for _, prog, _ in todo})}
  for prog, text in texts.items():
    assert "Traceback" not in text and text.strip(), (prog, text[-2000:])
  for where, prog, rest in todo:
    for tok in rest:
      if tok.startswith("--") and not tok.startswith("--config."):
        assert tok[2:].split("=", 1)[0] in program_flags(texts[prog]), (where, tok)
  checked = 0
  for where, _, rest in commands():
    for spec in _values(rest, "config"):
      if _is_placeholder(spec):
        continue
      config = test_recipes.load(spec)
      checked += 1
      for tok in rest:
        if tok.startswith("--config."):
          key = tok[len("--config.") :].split("=", 1)[0]
          assert _has_key(config, key), (where, key)
    for target in _values(rest, "target"):
      assert target in deviceless.TARGETS, (where, target)
  assert checked > 10


def test_every_python_example_runs(tmp_path, monkeypatch, trained_run):
  monkeypatch.chdir(tmp_path)
  os.symlink(trained_run[0], "run")  # the workdir docs/nnx.md loads
  for page in PAGES[1:]:
    for lineno, block, before in blocks(page, "python"):
      if re.fullmatch(r"<!-- not run: .{10,} -->", before.strip()):
        continue
      with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block, f"{page}:{lineno}", "exec"), {})
  (example,) = [b for _, b, _ in blocks("README.md", "python") if "AFTLocal" in b]
  with contextlib.redirect_stdout(io.StringIO()) as out:
    exec(compile(example, "README.md", "exec"), {})
  assert out.getvalue().strip() == "(4, 100, 64)"


def _slug(heading):
  """GitHub's anchor for a heading."""
  text = re.sub(r"[`*_]", "", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _without_code(text):
  return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_every_link_and_repository_path_exists_and_the_readme_links_each_page():
  checked = 0
  for page in PAGES:
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(TEXT[page])):
      if re.match(r"[a-z]+:", target):
        continue
      file, _, anchor = target.partition("#")
      path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), file))
      path = path if file else os.path.join(ROOT, page)
      assert os.path.exists(path), (page, target)
      if anchor and path.endswith(".md"):
        headings = re.findall(r"^#+ (.*)$", _without_code(open(path).read()), flags=re.M)
        assert anchor in {_slug(h) for h in headings}, (page, target)
      checked += 1
    tops = "aft_jax|benchmarks|configs|docs|notebooks|tests|\\.ci"
    for path in re.findall(rf"`((?:{tops})/[^`\s]*)`", TEXT[page]):
      path = path.split(":")[0]
      assert _is_placeholder(path) or os.path.exists(os.path.join(ROOT, path)), (page, path)
    assert page == "README.md" or f"]({page})" in README, page
  assert checked > 20


def test_readme_opens_with_the_quickstart_and_the_test_command_and_help_reads_well():
  (install_and_train,), (install_and_test,) = [
    [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    for _, block, _ in blocks("README.md", "bash")[:2]
  ]
  assert install_and_train.startswith("python3 -m pip install -e . && python3 train.py")
  assert "--config configs/quickstart.py" in install_and_train
  assert install_and_test.startswith(
    'python3 -m pip install -e ".[test]" && python3 -m aft_jax.deviceless install && '
    "python3 -m pytest"
  )
  assert install_and_test in open(os.path.join(ROOT, ".ci", "run")).read()
  assert len(README.splitlines()) <= 300
  section = README[README.index("## Does it fit my GPU?") :].split("\n## ")[0]
  assert "python train.py --config " in section and "--dry_run --target NAME" in section
  assert "[--num_devices N]" in section and "(docs/what_fits.md)" in section
  assert "`sigma(Q) * (K^T V)`; that is not\nAFT" in README or "that is not AFT" in README
  # help() on the layers and ops reads well
  text = pydoc.render_doc(aft_jax.layers.AFTLocal, renderer=pydoc.plaintext)
  assert "AFT-local (paper Eq. 4)" in text and "window" in text
  for name in ("aft_full", "aft_local", "aft_simple", "aft_conv1d", "aft_conv2d", "aft_decay"):
    doc = getattr(aft_jax.ops, name).__doc__
    assert "Args:" in doc and "Returns:" in doc and "[..., " in doc, name


def test_the_notebook_is_clean_and_agrees_on_the_repository_jax_and_recipes():
  for cell in NOTEBOOK.cells:  # no outputs
    assert cell.cell_type != "code" or (not cell.outputs and cell.execution_count is None)
  owner_repo = re.fullmatch(r"https://github\.com/([\w.-]+/[\w.-]+)", URL).group(1)
  colab = "https://colab.research.google.com/github"
  badge = f"{colab}/{owner_repo}/blob/main/notebooks/quickstart.ipynb"
  install_cell = NOTEBOOK.cells[1].source
  for where, text in [("README", README), ("notebook", NOTEBOOK.cells[0].source)]:
    links = re.findall(r"https://colab\.research\.google\.com/github/[^)\s]+", text)
    assert links == [badge], (where, links)
  # Every pip source that names a repository names this one.
  sources = re.findall(r"git\+(https://[^\s\"']+)", README + DOCS + install_cell)
  assert f'"aft-jax @ git+{URL}"' in install_cell
  assert sources and set(sources) == {URL}, sources
  first_block = README[README.index("## Install") :].split("```")[1]
  joined = "\n".join(line for line in first_block.splitlines() if "pip install" in line)
  for extra in ("", "[cuda12]", "[tpu]"):
    assert f'"aft-jax{extra} @ git+{URL}"' in joined, extra
  extras = PYPROJECT["project"]["optional-dependencies"]
  assert extras["cuda12"] == ["jax[cuda12]"] and extras["tpu"] == ["jax[tpu]"]
  (jax_req,) = [r for r in PYPROJECT["project"]["dependencies"] if re.match(r"jax\b", r)]
  assert f"needs jax >= {jax_req.split('>=')[1]}" in install_cell
  text = README + DOCS + "".join(c.source for c in NOTEBOOK.cells)
  names = re.findall(r"aft-train --config ([\w:]+)", text)
  assert "quickstart" in names
  for name in names:
    assert os.path.exists(recipes.resolve(name).split(":")[0]), name
