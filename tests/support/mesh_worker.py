"""Mesh checks on 8 simulated CPU devices, a process of their own (tests/test_sharding.py):
``python -m tests.support.mesh_worker sharding|sequence|layouts|collectives``."""

import math
import os
import re
import sys
import tempfile

# The fast-compile flags come from the test session's environment (tests/support/helpers.py).
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from aft_jax import data as data_lib  # noqa: E402
from aft_jax import ops, sharding  # noqa: E402
from aft_jax.trainer import checkpointing, train_lib  # noqa: E402
from aft_jax.trainer.run_config import RunConfig  # noqa: E402
from tests.support.helpers import tiny_config  # noqa: E402

STEPS = 3


def _trainer(config, corpus, devices):
  return train_lib.make_trainer(RunConfig.from_tree(config), corpus.vocab.size, devices)


def train_losses(trainer, train_tokens, steps: int) -> list[float]:
  """The losses of ``trainer``'s first ``steps`` steps (seed 0, batches of seed 0, key 1)."""
  train = trainer.config.train
  state = trainer.init_state(0)
  it = data_lib.train_iterator(
    train_tokens, seq_len=train.seq_len, global_batch_size=train.batch_size, seed=0
  )
  rng, losses = jax.random.key(1), []
  for _ in range(steps):
    state, metrics = trainer.train_step(state, next(it), rng)
    losses.append(float(metrics["loss"]))
  return losses


MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8)]


def _sharding_config(mesh=(1, 1, 1), **overrides):
  # d_model 16, mlp 32, vocab 256 (bytes), 16 AFT channels: all divisible by every mesh axis.
  # aft_full: its train step compiles in about half the time of aft_local's / aft_simple's.
  keys = {"model.mixing": "aft_full", "model.dropout_rate": 0.0, "batch_size": 8}
  c = tiny_config(**{**keys, "eval_batch_size": 8, **overrides})
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


# AFT's key bias cancels between numerator and denominator (exp(K + b) / sum exp(K + b)), so its
# gradient is 0 up to rounding, and Adam turns that rounding noise into updates of size ~lr whose
# sign depends on the summation order: it cannot match across meshes, and is not compared.
NOISE_ONLY = ("['mix']['key']['bias']",)


def _max_diff(a, b):
  flat = lambda t: {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(t)}
  a, b = flat(a), flat(b)
  assert a.keys() == b.keys()

  def diff(k):
    d = np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64))
    if k.endswith("['pos_bias']"):
      # Causal position 0 averages a single term, so w[0, 0] cancels exactly like the key
      # bias: its gradient is rounding noise that Adam scales up to +-lr per step.
      d[0, 0] = 0.0
    return float(np.max(d))

  return max(diff(k) for k in a if not k.endswith(NOISE_ONLY))


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


def check_sharding(workdir):
  """Four (data, fsdp, tensor) meshes train as one device, split as DEFAULT_RULES say; a (2, 2,
  2) checkpoint continues on (8, 1, 1); a batch the mesh does not split is refused at once."""
  base = _sharding_config()
  corpus = data_lib.load_corpus(RunConfig.from_tree(base).data)
  it = data_lib.train_iterator(
    corpus.splits["train"], seq_len=base.seq_len, global_batch_size=base.batch_size, seed=0
  )
  batches = [next(it) for _ in range(STEPS + 1)]
  rng = jax.random.key(1)

  def run(config, devices, steps):
    trainer = _trainer(config, corpus, devices)
    state = trainer.init_state(0)
    losses = []
    for batch in batches[:steps]:
      state, metrics = trainer.train_step(state, batch, rng)
      losses.append(float(metrics["loss"]))
    return trainer, state, losses

  trainer1, s1, ref_losses = run(base, jax.devices()[:1], STEPS)
  ref_params3 = jax.device_get(s1.params)  # after STEPS steps on one device
  _, m = trainer1.train_step(s1, batches[STEPS], rng)
  ref_losses.append(float(m["loss"]))

  for shape in MESHES:  # (8, 1, 1) first: the checkpoint check restores onto it
    trainer, state, losses = run(_sharding_config(shape), jax.devices(), STEPS)
    assert dict(trainer.mesh.shape) == dict(zip(sharding.MESH_AXES, shape + (1,)))
    _check_sharded(state, shape)
    diff = _max_diff(jax.device_get(state.params), ref_params3)
    np.testing.assert_allclose(losses, ref_losses[:STEPS], rtol=1e-5, atol=1e-5)
    assert diff < 1e-5, (shape, diff)
    if shape == (8, 1, 1):
      trainer811 = trainer
    if shape == (2, 2, 2):
      # A checkpoint written on (2, 2, 2) restores onto (8, 1, 1) and continues identically.
      mngr = checkpointing.checkpoint_manager(
        os.path.join(workdir, "ckpt"), checkpointing.CheckpointConfig(keep_checkpoints=1)
      )
      checkpointing.save(mngr, STEPS, state, it)
      mngr.wait_until_finished()
      restored = checkpointing.restore_readable(mngr, [STEPS], trainer811.abstract_state)[0].state
      mngr.close()
      assert int(restored.step) == STEPS
      _check_sharded(restored, (8, 1, 1))
      assert _max_diff(jax.device_get(restored.params), jax.device_get(state.params)) == 0.0
      _, m = trainer811.train_step(restored, batches[STEPS], rng)
      np.testing.assert_allclose(float(m["loss"]), ref_losses[STEPS], rtol=1e-5, atol=1e-5)

  # A dimension the mesh cannot split evenly (a word vocabulary, say) is replicated, not an error.
  mesh = sharding.make_mesh(RunConfig.from_tree(_sharding_config((1, 4, 2))).mesh)
  odd = {
    "embed": nn.Partitioned(jax.ShapeDtypeStruct((255, 16), np.float32), ("vocab", "embed")),
    "mlp": nn.Partitioned(jax.ShapeDtypeStruct((16, 32), np.float32), ("embed", "mlp")),
  }
  sh = sharding.logical_shardings(odd, mesh, sharding.DEFAULT_RULES)
  assert sh["embed"].spec == P(None, "fsdp") and sh["mlp"].spec == P("fsdp", "tensor"), sh

  # A batch size data x fsdp does not divide: an error before any Trainer is built.
  def built(*args, **kwargs):
    raise AssertionError("a Trainer was built")

  train_lib.Trainer.__init__ = built
  bad_batches = [((8, 1, 1), "batch_size", 12, 8), ((2, 2, 2), "eval_batch_size", 2, 4)]
  for shape, name, bad, dp in bad_batches:
    try:
      train_lib.train_and_evaluate(_sharding_config(shape, **{name: bad}), f"{workdir}/{name}")
      raise AssertionError(f"{name}={bad} on mesh {shape} was accepted")
    except ValueError as e:
      want = f"{name} = {bad} is not divisible by the {dp} data-parallel devices (mesh data x fsdp)"
      assert want in str(e), e


T = 16  # 4 positions per device
# (op, window or kernel size, logit std): a window within one shard (3), one two shards back (6);
# AFT-local's w also as its factors (u, v): each device forms its block only.
CASES = [("simple", 0, 40.0), ("local", 3, 40.0), ("local_factors", 6, 1.0), ("conv1d", 6, 40.0)]
CASES += [("decay", 0, 1.0), ("decay", 0, 40.0)]  # decays 0, 1e-6, 30 per step and a bonus


def _inputs(op, size, scale):
  rng = np.random.default_rng(0)
  f = lambda *s, sc=1.0: np.asarray(rng.normal(size=s) * sc, np.float32)
  if op == "conv1d":
    return f(2, T, 2, 2), f(2, T, 2, sc=scale), f(2, T, 2, 2), f(2, size, sc=scale)
  qkv = f(2, T, 3), f(2, T, 3, sc=scale), f(2, T, 3)
  if op == "decay":
    return (*qkv, (np.array([0.0, 1e-6, 30.0], np.float32), f(3)))
  if op == "local_factors":  # u, v [T, 2]: w = u v^T of std ~ scale
    return (*qkv, (f(T, 2, sc=scale**0.5), f(T, 2, sc=scale**0.5)))
  return (*qkv, f(T, T, sc=scale))


def _op(op, size, q, k, v, bias, **kw):
  if op == "simple":
    return ops.aft_simple(q, k, v, causal=True, **kw)
  if op == "decay":
    return ops.aft_decay(q, k, v, *bias, **kw)
  if op.startswith("local"):
    return ops.aft_local(q, k, v, bias, window=size, causal=True, **kw)
  return ops.aft_conv1d(q, k, v, bias, causal=True, **kw)


def _check_op(op, size, scale, mesh):  # values and gradients within 1e-5 and 1e-4
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
  for name, a, b, rel in [("y", y1, y2, 1e-5)] + [
    (f"d{n}", x, y, 1e-4) for n, x, y in zip("qkvw", g1, g2)
  ]:
    a, b = np.asarray(a), np.asarray(b)
    assert np.all(np.isfinite(a)), (op, scale, name)
    diff = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    assert diff < rel, (op, scale, name, diff)


def check_sequence(workdir):
  """The ops with T split over 4 devices (``axis_name`` in ``jax.shard_map``) give the unsharded
  values and gradients."""
  mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
  for op, size, scale in CASES:
    _check_op(op, size, scale, mesh)


# mixing: its (data, fsdp, tensor, sequence) layouts on 4 and 8 devices, T split with the batch
# and the parameters (data and fsdp) or the channels (tensor), and T alone over 4 (AFT-full's:
# ``check_sharding``); "_factors": AFT-local's w as u v^T.
LAYOUTS = {
  "aft_local": [(2, 2, 1, 2), (2, 1, 1, 4)],
  "aft_local_factors": [(1, 1, 1, 4)],
  "aft_simple": [(2, 2, 1, 2)],
  "aft_conv1d": [(2, 1, 2, 2)],
  "aft_decay": [(2, 1, 1, 2)],
  "softmax": [(2, 2, 2, 1)],
}


def _layout_losses(name, layout, corpus):
  mixing = name.removesuffix("_factors")
  keys = {"model.mixing": mixing, "model.dropout_rate": 0.0, "warmup_steps": 0}
  config = tiny_config(**keys, **({"model.factor_dim": 8} if mixing != name else {}))
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor, config.mesh.sequence = layout
  trainer = _trainer(config, corpus, jax.devices()[: math.prod(layout)])
  assert tuple(trainer.mesh.shape.values()) == layout, trainer.mesh
  # Where T is split (once a mixing), the op ran per shard: the step exchanges the shards' states.
  if layout[3] > 1 and layout == LAYOUTS[name][-1]:
    hlo = trainer.lower_train_step().as_text()
    assert "all_gather" in hlo, name
    last_keys = mixing not in ("aft_simple", "aft_decay")  # exchanged with collective_permute
    assert ("collective_permute" in hlo) == last_keys, name
  return train_losses(trainer, corpus.splits["train"], STEPS)


def check_layouts(workdir):
  """Each mixing layer trained on ``LAYOUTS`` (dropout 0, no warmup) gives one device's losses
  within 1e-4, step by step."""
  corpus = data_lib.load_corpus(RunConfig.from_tree(tiny_config()).data)
  for name, layouts in LAYOUTS.items():
    one = _layout_losses(name, (1, 1, 1, 1), corpus)
    for layout in layouts:
      losses = _layout_losses(name, layout, corpus)
      np.testing.assert_allclose(losses, one, rtol=0, atol=1e-4, err_msg=f"{name} {layout}")


COLLECTIVES = ("all-reduce", "all-to-all", "collective-permute", "all-gather", "reduce-scatter")


def check_collectives(workdir):
  """On data = 2 the causal ops' train steps hold only softmax's collectives (in_mesh_shards)."""
  counts = {}
  for mixing in ("softmax", "aft_simple", "aft_local", "aft_full"):
    config = tiny_config(**{"model.mixing": mixing, "model.num_heads": 2})
    trainer = train_lib.make_trainer(RunConfig.from_tree(config), 256, jax.devices()[:2])
    text = trainer.lower_train_step().compile().as_text()
    counts[mixing] = {op: len(re.findall(f" {op}[.(]", text)) for op in COLLECTIVES}
  for mixing in ("aft_simple", "aft_local", "aft_full"):
    assert counts[mixing] == counts["softmax"], counts
  assert counts["softmax"]["all-to-all"] == counts["softmax"]["collective-permute"] == 0, counts
  assert counts["softmax"]["all-reduce"] >= 1, counts


if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  with tempfile.TemporaryDirectory() as workdir:
    globals()["check_" + sys.argv[1]](workdir)
