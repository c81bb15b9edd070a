"""aft_jax.nnx_modules: each layer and the model as an nnx.Module, the linen module's twin."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import aft_jax
from aft_jax import nnx_modules, sharding
from aft_jax.data import pipeline
from aft_jax.model import ModelConfig
from aft_jax.tools import evaluate, export, trained

T, D = 6, 8
X_BTD = jax.random.normal(jax.random.key(0), (2, T, D))
LAYERS = {  # all causal but AFTConv2D; "_uv": the factored bias w = u v^T
  "aft_full": (nnx_modules.AFTFull, dict(max_len=T, causal=True)),
  "aft_local": (nnx_modules.AFTLocal, dict(max_len=T, window=2, causal=True)),
  "aft_local_uv": (nnx_modules.AFTLocal, dict(max_len=T, window=2, factor_dim=3, causal=True)),
  "aft_simple_bfloat16": (nnx_modules.AFTSimple, dict(causal=True, dtype=jnp.bfloat16)),
  "aft_decay": (nnx_modules.AFTDecay, dict(causal=True)),
  "aft_conv1d": (nnx_modules.AFTConv1D, dict(num_heads=2, kernel_size=3, causal=True)),
  "aft_conv2d": (nnx_modules.AFTConv2D, dict(num_heads=2, kernel_size=3)),
  "softmax": (nnx_modules.MultiHeadAttention, dict(num_heads=2, max_len=T, causal=True)),
}
CALL = nnx.jit(lambda m, x: m(x))
STEP = nnx.jit(lambda m, x, state: m(x, state=state))
LOSS = lambda y: jnp.sum(jnp.sin(y.astype(jnp.float32)))  # noqa: E731


def _same_as_linen(module, x):
  """``module``'s parameters (tree, dtypes, logical names), output and gradients are its linen
  module's on the same weights; returns the output."""
  linen, params = module.definition, module.linen_params()
  abstract = jax.eval_shape(linen.init, jax.random.key(0), x)["params"]
  chex.assert_trees_all_equal_shapes_and_dtypes(params, nn.unbox(abstract))
  names = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(module, nnx.Param)))
  assert names == nn.get_partition_spec(abstract)
  y = CALL(module, x)
  chex.assert_trees_all_equal(y, jax.jit(linen.apply)({"params": params}, x))
  grads = nnx.jit(nnx.grad(lambda m, x: LOSS(m(x))))(module, x)
  want = jax.jit(jax.grad(lambda p: LOSS(linen.apply({"params": p}, x))))(params)
  chex.assert_trees_all_close(nnx.to_pure_dict(grads), want, atol=1e-6)
  return y


def _decoded(module, x, chunk: int):
  """``module`` decoding ``x``: its first ``chunk`` tokens in one call (0: none), then one a
  call, the state passed along."""
  state, ys = module.init_state(x[:, :1]), []
  for t0, t1 in [(0, chunk)][: int(chunk > 0)] + [(t, t + 1) for t in range(chunk, T)]:
    y, state = STEP(module, x[:, t0:t1], state)
    ys.append(y)
  return jnp.concatenate(ys, axis=1)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_each_layer_is_its_linen_layer_forward_backward_and_decoding(name):
  cls, settings = LAYERS[name]
  layer = cls(D, rngs=nnx.Rngs(0), **settings)  # from sizes, no example input
  assert layer.query.kernel.shape[0] == D and layer.query.kernel.dtype == jnp.float32
  if name == "aft_conv2d":
    _same_as_linen(layer, X_BTD.reshape(2, 2, 3, D))
    return
  y = _same_as_linen(layer, X_BTD)
  tol = 2e-2 if "bfloat16" in name else 1e-5
  chex.assert_trees_all_close(_decoded(layer, X_BTD, 3 * layer.definition.chunks), y, atol=tol)


def test_the_model_is_its_linen_model_and_decodes_a_prompt_chunk_then_tokens():
  cfg = ModelConfig(vocab_size=20, num_layers=2, d_model=D, num_heads=2, mlp_dim=16, max_len=T)
  model = nnx_modules.TransformerLM(cfg, rngs=nnx.Rngs(0))
  tokens_BT = jax.random.randint(jax.random.key(1), (2, T), 0, 20)
  logp_BTV = _same_as_linen(model, tokens_BT)
  assert logp_BTV.shape == (2, T, 20) and model.block_1.mix.pos_bias.shape == (T, T)
  chex.assert_trees_all_close(_decoded(model, tokens_BT, 2), logp_BTV, atol=1e-5)
  bad = {**model.linen_params(), "ln_final": {"scale": jnp.ones(D)}}
  with pytest.raises(ValueError, match=r"differ .*: \{'ln_final/bias': \(None, \(8,\)\)\}$"):
    nnx_modules.TransformerLM(cfg, params=bad)
  with pytest.raises(ValueError, match=r"^TransformerLM: give rngs \(new parameters\) or params"):
    nnx_modules.TransformerLM(cfg)


def test_a_stack_of_layers_under_nnx_vmap_scan_remat_and_a_vmapped_decoding_state():
  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=0, out_axes=0)
  def stack(rngs):
    return nnx_modules.AFTLocal(D, max_len=T, window=2, causal=True, rngs=rngs)

  layers = stack(nnx.Rngs(0))

  @nnx.jit
  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
  def forward(x, layer):
    return nnx.remat(lambda m, x: m(x))(layer, x)

  graph, state = nnx.split(layers)
  one = [nnx.merge(graph, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(3)]
  want = X_BTD
  for layer in one:
    want = layer(want)
  chex.assert_trees_all_close(forward(X_BTD, layers), want, atol=1e-6)
  # Two sequences' states side by side (vmap), each the state its own decoding gives.
  xs = X_BTD[:, None, :1]  # [2 sequences, 1, 1, D]
  states = jax.vmap(one[0].init_state)(xs)
  ys, _ = nnx.vmap(lambda m, x, s: m(x, state=s), in_axes=(None, 0, 0))(one[0], xs, states)
  alone, _ = one[0](X_BTD[:, :1], state=one[0].init_state(X_BTD[:, :1]))
  chex.assert_trees_all_close(ys[:, 0], alone, atol=1e-6)


def test_parameters_are_placed_by_the_mesh_and_the_logical_axis_rules():
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=1, sequence=1))
  rules = sharding.DEFAULT_RULES
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    layer = nnx_modules.AFTConv1D(D, num_heads=2, causal=True, rngs=nnx.Rngs(0))
  kernel, gamma = layer.query.kernel[...], layer.bias.gamma[...]
  assert kernel.sharding.spec == nn.logical_to_mesh_axes(("embed", "heads", "kv"), rules)
  assert gamma.sharding.spec == nn.logical_to_mesh_axes(("heads",), rules)
  with jax.set_mesh(mesh):  # no rules: nothing to place by (not an error)
    assert nnx_modules.AFTSimple(D, rngs=nnx.Rngs(0))(X_BTD).shape == X_BTD.shape


def test_a_trained_workdir_and_its_export_load_as_nnx_score_as_aft_evaluate_and_fine_tune(
  trained_run, tmp_path
):
  workdir = trained_run[0]
  out = str(tmp_path / "model.msgpack")
  export.export_main(export.parse_args(["--workdir", workdir, "--out", out]))
  model, vocab = aft_jax.load_pretrained(workdir, api="nnx")  # its newest checkpoint
  from_export, _ = aft_jax.load_pretrained(out, api="nnx")
  _, params, _ = aft_jax.load_pretrained(workdir)
  chex.assert_trees_all_equal(model.linen_params(), from_export.linen_params(), params)
  with pytest.raises(ValueError, match=r"^load_pretrained: api must be 'linen' or 'nnx'; got 'x'$"):
    aft_jax.load_pretrained(out, api="x")

  text_file = tmp_path / "text.txt"
  text_file.write_text("An attention free transformer reads text left to right. " * 8)
  args = ["--workdir", workdir, "--text_file", str(text_file), "--stride", "0"]
  want = evaluate.evaluate_main(evaluate.parse_args(args))
  run = trained.load_run(workdir)
  tokens = evaluate.encode_text(vocab, text_file.read_text())[0]
  kw = dict(seq_len=run.config.train.seq_len, global_batch_size=run.config.eval.eval_batch_size)
  (batch,) = pipeline.eval_batches(tokens, bos_id=run.bos_id, **kw)
  nll = nnx.jit(lambda m, b: (m(b["inputs"], b["targets"]) * b["weights"]).sum())(model, batch)
  # (float32 sums in another order than the trainer's evaluation step)
  assert float(nll) / batch["weights"].sum() == pytest.approx(want["nll"], rel=1e-5)

  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    weighted = lambda m: (m(batch["inputs"], batch["targets"]) * batch["weights"]).sum()
    loss, grads = nnx.value_and_grad(weighted)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer, batch)) for _ in range(4)]
  assert losses[0] == pytest.approx(float(nll), rel=1e-5) and losses[-1] < losses[0]
