"""Runs in its own process with 8 simulated CPU devices (see tests/test_sharding.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python -m tests.support.sharding_worker OUT.json

Trains the same tiny model for 3 steps on one device and on several (data, fsdp, tensor) meshes,
checks that parameters are really sharded the way the logical axis rules say, round-trips a
checkpoint from one mesh to another, and checks the batch-size divisibility error. Every check
is an assert; the results (losses, max parameter differences) go to OUT.json for the test to
report. One jit per mesh keeps the compile time down.
"""

import json
import os
import sys
import time

# Must precede the first jax import: the device count is fixed when the CPU backend starts.
# (The fast-compile flags come from the test session's environment: tests/support/helpers.py.)
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tests.support.helpers import tiny_config  # noqa: E402
from aft_jax import data as data_lib  # noqa: E402
from aft_jax.trainer import checkpointing, train_lib  # noqa: E402
from aft_jax import sharding  # noqa: E402
from aft_jax.trainer.run_config import RunConfig  # noqa: E402

MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8)]
STEPS = 3


def _config(mesh=(1, 1, 1), **overrides):
  # d_model 16, mlp 32, vocab 256 (bytes), 16 AFT channels: all divisible by every mesh axis.
  # aft_full: its train step compiles in about half the time of aft_local's / aft_simple's.
  c = tiny_config(
    **{
      "model.mixing": "aft_full",
      "model.dropout_rate": 0.0,
      "batch_size": 8,
      "eval_batch_size": 8,
      **overrides,
    }
  )
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


def _flat(tree):
  return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


# AFT's key bias cancels between numerator and denominator (exp(K + b) / sum exp(K + b)), so its
# gradient is 0 up to rounding, and Adam turns that rounding noise into updates of size ~lr whose
# sign depends on the summation order: it cannot match across meshes, and is not compared.
NOISE_ONLY = ("['mix']['key']['bias']",)


def _max_diff(a, b):
  a, b = _flat(a), _flat(b)
  assert a.keys() == b.keys()

  def diff(k):
    d = np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64))
    if k.endswith("['pos_bias']"):
      # Causal position 0 averages a single term, so w[0, 0] cancels exactly like the key
      # bias: its gradient is rounding noise that Adam scales up to +-lr per step.
      d[0, 0] = 0.0
    return float(np.max(d))

  return max(diff(k) for k in a if not k.endswith(NOISE_ONLY))


def _trainer(config, corpus, devices):
  cfg = RunConfig.from_tree(config).with_vocab(corpus.vocab.size)
  return train_lib.Trainer(cfg, sharding.make_mesh(cfg.mesh, devices))


def _check_sharded(state, mesh_shape):
  """Parameters (and Adam moments) are split as DEFAULT_RULES say, not silently replicated."""
  data, fsdp, tensor = mesh_shape
  p = state.params
  mu = state.opt_state[1][0].mu  # chain(clip, adamw): adamw's ScaleByAdamState
  expected = {
    # name: (array, logical names -> mesh spec, global shape)
    "mlp_in": (p["block_0"]["mlp_in"]["kernel"], P("fsdp", "tensor"), (16, 32)),
    "mlp_in (adam mu)": (mu["block_0"]["mlp_in"]["kernel"], P("fsdp", "tensor"), (16, 32)),
    "mlp_out": (p["block_0"]["mlp_out"]["kernel"], P("tensor", "fsdp"), (32, 16)),
    "query": (p["block_0"]["mix"]["query"]["kernel"], P("fsdp", "tensor"), (16, 16)),
    "key": (p["block_0"]["mix"]["key"]["kernel"], P("fsdp", "tensor"), (16, 16)),
    "value": (p["block_0"]["mix"]["value"]["kernel"], P("fsdp", "tensor"), (16, 16)),
    "out": (p["block_0"]["mix"]["out"]["kernel"], P("tensor", "fsdp"), (16, 16)),
    "embed": (p["embed"]["embedding"], P("tensor", "fsdp"), (256, 16)),
    "pos_bias": (p["block_0"]["mix"]["pos_bias"], P(None, None), (32, 32)),
  }
  split = {"fsdp": fsdp, "tensor": tensor, None: 1}
  for name, (arr, spec, shape) in expected.items():
    assert arr.shape == shape, (name, arr.shape)
    assert arr.sharding.spec == spec, (name, mesh_shape, arr.sharding.spec)
    local = tuple(s // split[a] for s, a in zip(shape, spec))
    shapes = {sh.data.shape for sh in arr.addressable_shards}
    assert shapes == {local}, (name, mesh_shape, shapes, local)
    assert len(arr.addressable_shards) == 8


def main(out_path):
  t0 = time.perf_counter()
  assert jax.device_count() == 8, jax.devices()
  base = _config()
  corpus = data_lib.load_corpus(RunConfig.from_tree(base).data)
  it = data_lib.train_iterator(
    corpus.splits["train"], seq_len=base.seq_len, global_batch_size=base.batch_size, seed=0
  )
  batches = [next(it) for _ in range(STEPS + 1)]
  rng = jax.random.key(1)
  report = {"meshes": {}}

  def run(config, devices, steps):
    trainer = _trainer(config, corpus, devices)
    state = trainer.init_state(0)
    losses = []
    for batch in batches[:steps]:
      state, metrics = trainer.train_step(state, batch, rng)
      losses.append(float(metrics["loss"]))
    return trainer, state, losses

  trainer1, s1, ref_losses = run(base, jax.devices()[:1], STEPS)
  assert len(s1.params["block_0"]["mlp_in"]["kernel"].addressable_shards) == 1
  ref_params3 = jax.device_get(s1.params)  # after STEPS steps on one device
  _, m = trainer1.train_step(s1, batches[STEPS], rng)
  ref_losses.append(float(m["loss"]))
  report["one_device"] = {"losses": ref_losses, "seconds": time.perf_counter() - t0}

  workdir = os.path.dirname(os.path.abspath(out_path))
  for shape in MESHES:  # (8, 1, 1) first: the checkpoint check restores onto it
    t = time.perf_counter()
    trainer, state, losses = run(_config(shape), jax.devices(), STEPS)
    assert dict(trainer.mesh.shape) == dict(zip(sharding.MESH_AXES, shape + (1,)))
    _check_sharded(state, shape)
    diff = _max_diff(jax.device_get(state.params), ref_params3)
    np.testing.assert_allclose(losses, ref_losses[:STEPS], rtol=1e-5, atol=1e-5)
    assert diff < 1e-5, (shape, diff)
    report["meshes"][str(shape)] = {
      "losses": losses,
      "max_param_diff": diff,
      "seconds": time.perf_counter() - t,
    }
    if shape == (8, 1, 1):
      trainer811 = trainer
    if shape == (2, 2, 2):
      # A checkpoint written on (2, 2, 2) restores onto (8, 1, 1) and continues identically.
      mngr = checkpointing.checkpoint_manager(
        os.path.join(workdir, "ckpt"), checkpointing.CheckpointConfig(keep_checkpoints=1)
      )
      checkpointing.save(mngr, STEPS, state, it)
      restored, _ = checkpointing.restore(mngr, STEPS, trainer811.abstract_state)
      mngr.close()
      assert int(restored.step) == STEPS
      _check_sharded(restored, (8, 1, 1))
      assert restored.params["block_0"]["mlp_in"]["kernel"].sharding.mesh.shape["data"] == 8
      restore_diff = _max_diff(jax.device_get(restored.params), jax.device_get(state.params))
      assert restore_diff == 0.0, restore_diff
      _, m = trainer811.train_step(restored, batches[STEPS], rng)
      next_loss = float(m["loss"])
      np.testing.assert_allclose(next_loss, ref_losses[STEPS], rtol=1e-5, atol=1e-5)
      report["checkpoint"] = {"next_loss": next_loss, "ref_next_loss": ref_losses[STEPS]}

  # A dimension the mesh cannot split evenly (a word vocabulary, say) is replicated, not an error.
  mesh = sharding.make_mesh(RunConfig.from_tree(_config((1, 4, 2))).mesh)
  odd = {
    "embed": nn.Partitioned(jax.ShapeDtypeStruct((255, 16), np.float32), ("vocab", "embed")),
    "mlp": nn.Partitioned(jax.ShapeDtypeStruct((16, 32), np.float32), ("embed", "mlp")),
  }
  sh = sharding.logical_shardings(odd, mesh, sharding.DEFAULT_RULES)
  assert sh["embed"].spec == P(None, "fsdp") and sh["mlp"].spec == P("fsdp", "tensor"), sh

  # batch_size not divisible by data x fsdp: a clear error before anything is built or compiled.
  built = []
  orig = train_lib.Trainer.__init__

  def spy(self, *a, **k):
    built.append(1)
    orig(self, *a, **k)

  train_lib.Trainer.__init__ = spy
  for shape, name, bad in [
    ((8, 1, 1), "batch_size", 12),
    ((2, 2, 2), "batch_size", 6),
    ((2, 2, 2), "eval_batch_size", 2),
  ]:
    try:
      train_lib.train_and_evaluate(
        _config(shape, **{name: bad}), os.path.join(workdir, f"bad_{name}")
      )
    except ValueError as e:
      msg = str(e)
      assert f"{name} = {bad} is not divisible by the 4" in msg or (
        f"{name} = {bad} is not divisible by the 8" in msg
      ), msg
      assert "data x fsdp" in msg, msg
    else:
      raise AssertionError(f"{name}={bad} on mesh {shape} was accepted")
  assert not built
  report["batch_error"] = msg
  report["seconds"] = time.perf_counter() - t0
  with open(out_path, "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
