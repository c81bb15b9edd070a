"""train.py on the WikiText-103 recipe, with fake data in the official format given offline: the
command line with a recipe argument, data flags and the adaptive softmax.
(tests/e2e/test_recipes.py trains every variant of both recipes in-process, enwik8 from its
official zip, through ``train_and_evaluate``, the function train.py runs.)"""

import json
import os

import numpy as np
import pytest

from tests.support import prefork
from tests.support import fake_wikitext
from tests.support.helpers import ROOT, train_py


@pytest.mark.slow
def test_wikitext_recipe_trains_on_fake_data(tmp_path):
  manual = str(tmp_path / "manual")
  fake_wikitext.write_extracted(manual, "v1")
  data_dir, workdir = str(tmp_path / "data"), str(tmp_path / "run")
  cmd = train_py(
    workdir,
    f"--config.data.data_dir={data_dir}",
    f"--config.data.manual_dir={manual}",
    "--config.num_train_steps=2",
    "--config.model.num_layers=1",
    "--config.model.d_model=16",
    "--config.model.num_heads=2",
    "--config.model.mlp_dim=32",
    "--config.seq_len=32",
    "--config.model.max_len=32",
    "--config.model.window=8",
    "--config.batch_size=4",
    "--config.eval_batch_size=8",
    "--config.model.adaptive_cutoffs=(8,16)",
    "--config.model.dtype=float32",
    "--config.sample.length=5",
    "--config.log_every_steps=1",
    config="configs/wikitext103.py:aft_local",
  )
  out = prefork.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  results = json.load(open(os.path.join(workdir, "results.json")))
  assert results["steps"] == 2 and np.isfinite(results["valid_ppl"])
  # Evaluation covers every token of the split, counted by the protocol: words + one <eos>
  # per line.
  text = fake_wikitext.texts("v1")
  for split, key in (("validation", "valid_tokens"), ("test", "test_tokens")):
    expected = sum(len(line.split()) + 1 for line in text[split].split("\n")[:-1])
    assert results[key] == expected, (split, results[key], expected)
  assert "Sample:\nThe " in out.stdout
