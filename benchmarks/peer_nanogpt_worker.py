"""One aft-jax run of ``benchmarks.peer_nanogpt`` in a process of its own: trains a mixing at
nanoGPT's recipe with the trainer's jitted step, timed as nanoGPT times its steps, and scores
the validation windows. SPEC.json is written by ``peer_nanogpt`` (``run_aft``).

    python -m benchmarks.peer_nanogpt_worker SPEC.json RECORD.json
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np

from aft_jax import files
from aft_jax.trainer import recipes, train, train_lib
from aft_jax.trainer.default_config import get_config, override
from aft_jax.trainer.run_config import RunConfig
from benchmarks import common
from benchmarks.peer_nanogpt import median_ms, score_batch, timed_steps


# nanoGPT's recipe keys and aft-jax's config keys for them.
RECIPE_KEYS = {"n_layer": "model.num_layers", "n_head": "model.num_heads",
               "n_embd": "model.d_model", "dropout": "model.dropout_rate",
               "batch_size": "batch_size", "max_iters": "num_train_steps",
               "learning_rate": "learning_rate", "warmup_iters": "warmup_steps", "beta2": "b2",
               "weight_decay": "weight_decay", "grad_clip": "grad_clip_norm"}  # fmt: skip


def aft_config(mixing: str, recipe: dict, overrides: dict):
  """aft-jax's config for nanoGPT's ``recipe`` and ``mixing`` (dotted ``overrides`` last)."""
  config = get_config()
  config.data.dataset, config.data.tokenizer = "pydoc", "byte"  # unused: the batches are given
  block, stream = recipe["block_size"], recipes.load("stream").model
  settings = {aft: recipe[key] for key, aft in RECIPE_KEYS.items()}
  if mixing == stream.mixing:  # the streaming recipe's model (configs/stream.py)
    settings["model.position_embedding"] = stream.position_embedding
  override(config, {**settings, **{
    "model.mixing": mixing,
    "model.mlp_dim": 4 * recipe["n_embd"],
    "model.max_len": block,
    "model.window": min(32, block // 2),  # AFT-local: the AFT paper's s = 32
    "model.kernel_size": min(32, block // 2),  # AFT-conv1d: the same causal offsets
    "seq_len": block,
    # nanoGPT's (GPT-2's) choices where aft-jax has an option (docs/training.md).
    "model.init": "gpt2",
    "model.use_bias": False,  # nanoGPT's recipe: bias=False
    "model.gelu_approximate": False,  # torch's nn.GELU(): exact
    "weight_decay_on": "matrices",  # nanoGPT decays parameters of rank >= 2 only
  }})  # fmt: skip
  return override(config, overrides)


def score(trainer, params, inputs, targets) -> float:
  total, count, batch = 0.0, 0, score_batch(inputs)
  for i in range(0, len(inputs), batch):
    b = {"inputs": inputs[i : i + batch], "targets": targets[i : i + batch]}
    b["weights"] = np.ones(b["targets"].shape, np.float32)
    if len(b["inputs"]) < batch:  # pad to one compiled shape; padding rows weigh nothing
      pad = batch - len(b["inputs"])
      b = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in b.items()}
    s, c = trainer._eval_step(params, b)  # pylint: disable=protected-access
    total, count = total + float(s), count + float(c)
  return total / count


def run(spec: dict) -> dict:
  mixing, recipe, seed = spec["mixing"], spec["recipe"], spec["seed"]
  train, windows = np.load(spec["train"]), np.load(spec["windows"])
  cfg = RunConfig.from_tree(aft_config(mixing, recipe, spec["overrides"]))
  trainer = train_lib.make_trainer(cfg, spec["vocab_size"], say=lambda line: None)
  state = trainer.init_state(seed)
  rng, dropout_rng = np.random.default_rng(seed), jax.random.key(seed + 1)
  block, batch = recipe["block_size"], recipe["batch_size"]
  ms, losses = {}, []
  start = t0 = time.perf_counter()
  for step in range(recipe["max_iters"]):
    ix = rng.integers(0, len(train) - block, batch)
    x = np.stack([train[i : i + block] for i in ix]).astype(np.int32)
    y = np.stack([train[i + 1 : i + 1 + block] for i in ix]).astype(np.int32)
    state, metrics = trainer.train_step(state, {"inputs": x, "targets": y}, dropout_rng)
    losses.append(float(metrics["loss"]))  # to the host every step, as nanoGPT's loss.item()
    t1 = time.perf_counter()
    ms[step], t0 = 1e3 * (t1 - t0), t1
  wall = time.perf_counter() - start
  loss = score(trainer, state.params, windows["inputs"], windows["targets"])
  rec = dict(model=f"aft-jax {mixing}", mixing=mixing, valid_loss=loss)
  rec.update(
    valid_tokens=int(windows["targets"].size),
    ms_per_step=median_ms(ms, timed_steps(spec["timed"], recipe["max_iters"])),
  )
  rec.update(final_train_loss=losses[-1], steps=recipe["max_iters"], wall_s=wall)
  return dict(rec, machine=common.machine_info())


def main(argv=None) -> dict:
  spec_path, out_path = argv or sys.argv[1:]
  spec = json.load(open(spec_path, encoding="utf-8"))
  if spec["cpu_devices"] != 1:  # before anything starts jax's backends (the count is fixed then)
    jax.config.update("jax_num_cpu_devices", spec["cpu_devices"])
  record = run(spec)
  files.atomic_write_json(out_path, record)
  return record


if __name__ == "__main__":
  train.restart_with_huge_pages()  # as aft-train does
  main()
