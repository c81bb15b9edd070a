"""Runs in its own process with 4 simulated CPU devices (see tests/test_sharding.py).

    python -m tests.support.sequence_worker OUT.json

Context parallelism. The ops: aft_simple, aft_local and aft_conv1d with T sharded over a
4-device mesh axis (``axis_name=``, inside ``jax.shard_map``) against the unsharded op, values
and the gradients of every input, logits of std 1 and 40, windows and kernels within one shard
and reaching two shards back. Training: the quickstart recipe (configs/quickstart.py, dropout
0) with ``mesh.sequence = 4`` trains AFT-local, AFT-simple and AFT-conv1d to the losses of one
device, step by step; softmax attention with mesh.sequence > 1 is a config error. Every check
is an assert; the differences and losses go to OUT.json.
"""

import json
import os
import sys

# Must precede the first jax import: the device count is fixed when the CPU backend starts.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from aft_jax import data as data_lib  # noqa: E402
from aft_jax import ops, sharding  # noqa: E402
from aft_jax.trainer import train_lib  # noqa: E402
from aft_jax.trainer.run_config import RunConfig  # noqa: E402
from configs import quickstart  # noqa: E402
from tests.support.helpers import train_losses  # noqa: E402

STEPS = 3

T = 16  # 4 positions per device
# (op, window or kernel size, logit std): a window within one shard (3) and one reaching two
# shards back (6).
CASES = [
  ("simple", 0, 40.0),
  ("local", 3, 40.0),
  ("local_factors", 6, 1.0),  # w as its factors (u, v): each device forms its block only
  ("conv1d", 6, 40.0),
]


def _inputs(op, size, scale):
  rng = np.random.default_rng(0)
  f = lambda *s, sc=1.0: np.asarray(rng.normal(size=s) * sc, np.float32)
  if op == "conv1d":
    return f(2, T, 2, 2), f(2, T, 2, sc=scale), f(2, T, 2, 2), f(2, size, sc=scale)
  if op == "local_factors":  # u, v [T, 2]: w = u v^T of std ~ scale
    return (
      f(2, T, 3),
      f(2, T, 3, sc=scale),
      f(2, T, 3),
      (f(T, 2, sc=scale**0.5), f(T, 2, sc=scale**0.5)),
    )
  return f(2, T, 3), f(2, T, 3, sc=scale), f(2, T, 3), f(T, T, sc=scale)


def _op(op, size, q, k, v, bias, **kw):
  if op == "simple":
    return ops.aft_simple(q, k, v, causal=True, **kw)
  if op.startswith("local"):
    return ops.aft_local(q, k, v, bias, window=size, causal=True, **kw)
  return ops.aft_conv1d(q, k, v, bias, causal=True, **kw)


def _check(op, size, scale, mesh):
  args = _inputs(op, size, scale)
  ct = np.random.default_rng(1).normal(size=args[0].shape).astype(np.float32)
  seq = P(None, "seq")
  sharded = jax.shard_map(
    lambda q, k, v, b: _op(op, size, q, k, v, b, axis_name="seq"),
    mesh=mesh,
    in_specs=(seq, seq, seq, P()),
    out_specs=seq,
  )
  plain = lambda *a: _op(op, size, *a)
  run = lambda f: jax.jit(
    lambda *a: (f(*a), jax.grad(lambda *b: jnp.sum(f(*b) * ct), argnums=(0, 1, 2, 3))(*a))
  )(*args)
  (y1, g1), (y2, g2) = run(sharded), run(plain)
  diffs = {}
  for name, a, b, rel in [("y", y1, y2, 1e-5)] + [
    (f"d{n}", x, y, 1e-4) for n, x, y in zip("qkvw", g1, g2)
  ]:
    a, b = np.asarray(a), np.asarray(b)
    assert np.all(np.isfinite(a)), (op, scale, name)
    diffs[name] = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    assert diffs[name] < rel, (op, scale, name, diffs[name])
  return diffs


def _config(mixing, sequence):
  c = quickstart.get_config()
  c.model.mixing = mixing
  c.model.num_layers = 1  # one block shows the split; the rest is the same again
  # AFT-local's bias as factors u v^T: each device forms only its block of w (the full bias's
  # sharded path is the ops' check above).
  c.model.factor_dim = 8 if mixing == "aft_local" else 0
  c.batch_size = 4
  c.mesh.data, c.mesh.sequence = (1, sequence) if sequence > 1 else (-1, 1)
  return c


def _losses(config, corpus, devices):
  cfg = RunConfig.from_tree(config).with_vocab(corpus.vocab.size)
  trainer = train_lib.Trainer(cfg, sharding.make_mesh(cfg.mesh, devices))
  return trainer, train_losses(trainer, corpus.splits["train"], STEPS)


def main(out_path):
  assert jax.device_count() == 4, jax.devices()
  mesh = Mesh(np.array(jax.devices()), ("seq",))
  report = {"ops": {}}
  for op, size, scale in CASES:
    report["ops"][f"{op} size {size} std {scale:g}"] = _check(op, size, scale, mesh)
  corpus = data_lib.load_corpus(RunConfig.from_tree(_config("aft_local", 1)).data)
  for mixing in ("aft_local", "aft_simple", "aft_conv1d"):
    _, one = _losses(_config(mixing, 1), corpus, jax.devices()[:1])
    trainer, split = _losses(_config(mixing, 4), corpus, jax.devices())
    assert dict(trainer.mesh.shape)["sequence"] == 4, trainer.mesh
    # The op really ran per shard: the step exchanges the shards' states.
    hlo = trainer.lower_train_step().as_text()
    assert "all_gather" in hlo, mixing
    assert ("collective_permute" in hlo) == (mixing != "aft_simple"), mixing  # the last keys
    np.testing.assert_allclose(split, one, rtol=0, atol=1e-4)
    report[mixing] = {"one_device": one, "sequence_4": split}
  try:
    RunConfig.from_tree(_config("softmax", 4))
  except ValueError as e:
    report["softmax_error"] = str(e)
  assert "mixes every pair of positions" in report.get("softmax_error", ""), report
  with open(out_path, "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
