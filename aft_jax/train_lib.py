"""Training and evaluation: ``train_and_evaluate(config, workdir)`` (the Flax lm1b example's shape).

One jitted train step (AdamW, warmup + cosine decay, global-norm clipping, optional gradient
accumulation with ``optax.MultiSteps``) on a device mesh, sharded by logical axis rules;
exact evaluation over whole splits; Orbax checkpoints that also hold the data-iterator position,
so rerunning the same command resumes exactly; SIGTERM / Ctrl-C save a checkpoint and exit.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from aft_jax import data as data_lib
from aft_jax import decode as decode_lib
from aft_jax import files
from aft_jax import sharding
from aft_jax.config_check import check_config, resume_conflicts
from aft_jax.metrics import MetricWriter
from aft_jax.model import ModelConfig, TransformerLM, count_params


@contextlib.contextmanager
def _on_mesh(mesh, rules):
  """The mesh and logical axis rules that flax's logical constraints resolve against."""
  with warnings.catch_warnings():
    # jax 0.10 deprecates `with mesh:` in favour of jax.set_mesh, which also switches to
    # explicit-sharding semantics that flax's logical partitioning does not use yet.
    warnings.filterwarnings("ignore", message=".*context manager has been deprecated.*")
    with mesh, nn.logical_axis_rules(rules):
      yield


class TrainState(train_state.TrainState):
  """Parameters, optimizer state and step; ``skipped`` counts updates dropped as non-finite."""

  skipped: jax.Array = None


def model_config(config, vocab_size: int) -> ModelConfig:
  m = config.model
  cutoffs = m.get("adaptive_cutoffs", None)
  return ModelConfig(
    vocab_size=vocab_size,
    max_len=m.max_len,
    num_layers=m.num_layers,
    d_model=m.d_model,
    num_heads=m.num_heads,
    mlp_dim=m.mlp_dim,
    mixing=m.mixing,
    window=m.window,
    kernel_size=m.kernel_size,
    factor_dim=m.factor_dim,
    dropout_rate=m.dropout_rate,
    dtype=jnp.dtype(m.dtype),
    param_dtype=jnp.dtype(m.param_dtype),
    remat=m.remat,
    scan_layers=m.scan_layers,
    tie_embeddings=m.tie_embeddings,
    adaptive_cutoffs=tuple(cutoffs) if cutoffs else None,
    adaptive_factor=m.get("adaptive_factor", 4.0),
  ).validate()


def learning_rate_schedule(config):
  """Linear warmup from 0 over ``warmup_steps`` updates, then cosine decay to 10% of the peak.

  Counted in optimizer updates (``num_train_steps // grad_accum_steps``).
  """
  updates = max(1, config.num_train_steps // config.grad_accum_steps)
  warmup = min(config.warmup_steps, updates - 1)
  decay = optax.cosine_decay_schedule(config.learning_rate, max(1, updates - warmup), alpha=0.1)
  if warmup == 0:
    return decay
  return optax.join_schedules(
    [optax.linear_schedule(0.0, config.learning_rate, warmup), decay], [warmup]
  )


def make_optimizer(config):
  tx = optax.chain(
    optax.clip_by_global_norm(config.grad_clip_norm),
    optax.adamw(
      learning_rate_schedule(config), b1=config.b1, b2=config.b2, weight_decay=config.weight_decay
    ),
  )
  if config.grad_accum_steps > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=config.grad_accum_steps)
  return tx


def _weighted_nll(model, params, batch, *, train, rng=None):
  nll = model.apply(
    {"params": params},
    batch["inputs"],
    batch["targets"],
    train=train,
    rngs={"dropout": rng} if train else None,
  )
  weights = batch.get("weights")
  if weights is None:
    weights = jnp.ones_like(nll)
  return jnp.sum(nll * weights), jnp.sum(weights)


class Trainer:
  """Holds the mesh, the jitted steps and their shardings for one model and config."""

  def __init__(self, config, model_cfg: ModelConfig, mesh):
    self.config, self.mesh = config, mesh
    self.rules = sharding.rules_from_config(config.get("logical_axis_rules"))
    self.model = TransformerLM(model_cfg)
    self.tx = make_optimizer(config)
    self.schedule = learning_rate_schedule(config)
    dummy = jnp.zeros((1, config.seq_len), jnp.int32)

    def init(rng):
      params = self.model.init(rng, dummy)["params"]
      return TrainState.create(
        apply_fn=self.model.apply, params=params, tx=self.tx, skipped=jnp.zeros((), jnp.int32)
      )

    with _on_mesh(mesh, self.rules):
      abstract = jax.eval_shape(init, jax.random.key(0))
      self.state_shardings = sharding.logical_shardings(abstract, mesh, self.rules)
      self._init = jax.jit(lambda rng: nn.unbox(init(rng)), out_shardings=self.state_shardings)
    self.abstract_state = jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      nn.unbox(abstract),
      self.state_shardings,
    )
    batch_sh = sharding.batch_sharding(mesh)
    repl = sharding.replicated(mesh)
    self._train_step = jax.jit(
      self._train_step_fn,
      donate_argnums=(0,),
      in_shardings=(self.state_shardings, batch_sh, repl),
      out_shardings=(self.state_shardings, repl),
    )
    self._eval_step = jax.jit(
      self._eval_step_fn, in_shardings=(self.state_shardings.params, batch_sh), out_shardings=repl
    )

  def init_state(self, seed: int) -> TrainState:
    with _on_mesh(self.mesh, self.rules):
      return self._init(jax.random.key(seed))

  def _train_step_fn(self, state: TrainState, batch, rng):
    rng = jax.random.fold_in(rng, state.step)  # same dropout for a step, resumed or not

    def loss_fn(params):
      total, count = _weighted_nll(self.model, params, batch, train=True, rng=rng)
      return total / jnp.maximum(count, 1.0), count

    (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grad_norm = optax.tree_utils.tree_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = state.apply_gradients(grads=grads)
    if self.config.nonfinite == "skip":
      # A non-finite step leaves parameters and optimizer state untouched.
      keep = lambda new, old: jnp.where(finite, new, old)
      new_state = new_state.replace(
        params=jax.tree_util.tree_map(keep, new_state.params, state.params),
        opt_state=jax.tree_util.tree_map(keep, new_state.opt_state, state.opt_state),
      )
    new_state = new_state.replace(skipped=state.skipped + (~finite).astype(jnp.int32))
    metrics = {
      "loss": loss,
      "grad_norm": grad_norm,
      "finite": finite,
      "tokens": count,
      "learning_rate": self.schedule(state.step // self.config.grad_accum_steps),
    }
    return new_state, metrics

  def _eval_step_fn(self, params, batch):
    return _weighted_nll(self.model, params, batch, train=False)

  def train_step(self, state, batch, rng):
    with _on_mesh(self.mesh, self.rules):
      return self._train_step(state, sharding.put_batch(batch, self.mesh), rng)

  def evaluate(self, params, tokens: np.ndarray, bos_id: int, desc: str = "eval") -> dict:
    """Exact NLL over every token of ``tokens``: sum of NLL / number of tokens, no step cap."""
    cfg = self.config
    kw = dict(
      seq_len=cfg.seq_len, global_batch_size=cfg.eval_batch_size, stride=cfg.eval_stride or None
    )
    n = data_lib.num_eval_batches(len(tokens), **kw)
    batches = data_lib.eval_batches(
      tokens,
      bos_id=bos_id,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      **kw,
    )
    total, count = 0.0, 0.0
    with _on_mesh(self.mesh, self.rules):
      for batch in tqdm(batches, total=n, desc=desc, leave=False, disable=jax.process_index() != 0):
        s, c = self._eval_step(params, sharding.put_batch(batch, self.mesh))
        total += float(s)
        count += float(c)
    return {"nll": total / count, "ppl": math.exp(total / count), "tokens": int(count)}


def unigram_ppl(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int) -> float:
  """Perplexity of the training split's add-one-smoothed unigram distribution on eval_tokens."""
  counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64)
  logp = np.log((counts + 1.0) / (counts.sum() + vocab_size))
  return float(np.exp(-logp[eval_tokens].mean()))


class _Interrupt:
  """Turns SIGTERM / SIGINT into a flag checked after each step (the step in flight finishes)."""

  def __init__(self):
    self.signal = None
    self._old = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread
        pass
    return self

  def _handle(self, signum, frame):
    if self.signal is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C stops at once
    self.signal = signum

  def should_stop(self, step: int, every: int) -> bool:
    """Whether to save and stop after ``step``; all processes agree on the same step.

    One process stops at once. Several processes each see the signal at their own time, so
    they compare flags every ``every`` steps (where logging already syncs) and stop together.
    """
    if jax.process_count() == 1:
      return self.signal is not None
    if step % every:
      return False
    flags = multihost_utils.process_allgather(np.int32(self.signal is not None))
    if np.any(flags) and self.signal is None:
      self.signal = "from another process"
    return bool(np.any(flags))

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def checkpoint_manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
    os.path.abspath(os.path.join(workdir, "checkpoints")),
    options=ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, enable_async_checkpointing=False
    ),
  )


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [
    jnp.all(jnp.isfinite(x))
    for x in jax.tree_util.tree_leaves(tree)
    if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _save(mngr, step, state, data_iter):
  """Saves state + data position atomically (Orbax writes a tmp dir, then renames it).

  Never writes non-finite parameters or optimizer state, and turns a failed write (a full
  disk, say) into an error that says the previous checkpoint is intact.
  """
  if not bool(_all_finite((state.params, state.opt_state))):
    raise FloatingPointError(
      f"refusing to checkpoint non-finite parameters at step {step}; the last checkpoint "
      f"(step {mngr.latest_step()}) is intact"
    )
  try:
    mngr.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_iter.get_state())
      ),
      force=True,
    )
    mngr.wait_until_finished()
  except Exception as e:
    raise OSError(
      f"saving the checkpoint at step {step} failed ({type(e).__name__}: {e}); the previous "
      f"checkpoint (step {mngr.latest_step()}) is intact: free disk space and rerun the same "
      "command to resume from it"
    ) from e


def _config_path(workdir):
  return os.path.join(workdir, "config.json")


def _check_workdir_config(config, workdir: str, allow_config_change: bool):
  """Saves the config, or refuses to resume a run whose config differs in what matters."""
  path = _config_path(workdir)
  current = json.loads(config.to_json_best_effort())
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    conflicts = resume_conflicts(saved, current)
    if conflicts and not allow_config_change:
      raise ValueError(
        f"workdir {workdir} holds a run with a different config ({'; '.join(conflicts)}); "
        "use another --workdir, or pass --allow_config_change to resume it anyway"
      )
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    files.atomic_write_json(path, current)


def train_and_evaluate(
  config: ml_collections.ConfigDict, workdir: str, *, allow_config_change: bool = False
) -> dict:
  """Trains ``config`` in ``workdir`` (resuming what is there) and returns results.json's dict."""
  check_config(config)
  workdir = os.path.abspath(workdir)
  corpus = data_lib.load_corpus(config.data)
  model_cfg = model_config(config, corpus.vocab.size)
  mesh = sharding.make_mesh(config.mesh)
  dp = sharding.data_parallel_size(mesh)
  for name in ("batch_size", "eval_batch_size"):
    if config[name] % dp:
      raise ValueError(
        f"{name} = {config[name]} is not divisible by the {dp} data-parallel "
        f"devices (mesh data x fsdp)"
      )
  if dp % jax.process_count():
    # Each process reads its own rows of every batch, so the batch axes must split across them.
    raise ValueError(
      f"mesh data x fsdp = {dp} is not a multiple of the {jax.process_count()} "
      "processes: each process feeds its own rows of the batch, so give the "
      "data or fsdp axis at least one slot per process"
    )
  _check_workdir_config(config, workdir, allow_config_change)
  is_main = jax.process_index() == 0

  trainer = Trainer(config, model_cfg, mesh)
  data_iter = data_lib.train_iterator(
    corpus.splits["train"],
    seq_len=config.seq_len,
    global_batch_size=config.batch_size,
    seed=config.seed,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
  )
  mngr = checkpoint_manager(workdir, config.keep_checkpoints)
  latest = mngr.latest_step()
  if latest is not None:
    restored = mngr.restore(
      latest,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(trainer.abstract_state), data=ocp.args.JsonRestore()
      ),
    )
    state = restored["state"]
    data_iter.set_state(restored["data"])
    if is_main:
      print(f"Resuming from the checkpoint at step {latest} in {workdir}", flush=True)
  else:
    state = trainer.init_state(config.seed)
  num_params = count_params(state.params)
  step = int(state.step)
  writer = MetricWriter(workdir, enabled=is_main)
  if is_main and latest is None:
    print(
      f"Model: {model_cfg.mixing}, {num_params:,} parameters; corpus {corpus.name} "
      f"({corpus.unit}-level, vocab {corpus.vocab.size:,}); mesh {dict(mesh.shape)}",
      flush=True,
    )

  tokens_per_step = config.batch_size * config.seq_len
  dropout_rng = jax.random.key(config.seed + 1)
  bar = tqdm(
    total=config.num_train_steps,
    initial=step,
    desc="train",
    disable=not is_main,
    dynamic_ncols=True,
  )
  pending, t_last, steps_since = [], time.perf_counter(), 0
  with _Interrupt() as interrupt:
    while step < config.num_train_steps:
      state, metrics = trainer.train_step(state, next(data_iter), dropout_rng)
      step += 1
      steps_since += 1
      pending.append(metrics)
      bar.update(1)
      last = step == config.num_train_steps
      if step % config.log_every_steps == 0 or last:
        stacked = jax.device_get(pending)  # the only host sync of the training loop
        elapsed = time.perf_counter() - t_last
        losses = [float(m["loss"]) for m in stacked if bool(m["finite"])]
        nonfinite = [i for i, m in enumerate(stacked) if not bool(m["finite"])]
        if nonfinite and config.nonfinite == "stop":
          bad = step - len(stacked) + nonfinite[0] + 1
          raise FloatingPointError(
            f"non-finite loss or gradient at step {bad}; the last checkpoint is step "
            f"{mngr.latest_step()} (set nonfinite='skip' to skip such updates)"
          )
        record = {
          "step": step,
          "loss": float(np.mean(losses)) if losses else float("nan"),
          "learning_rate": float(stacked[-1]["learning_rate"]),
          "grad_norm": float(np.mean([float(m["grad_norm"]) for m in stacked])),
          "tokens_per_sec": tokens_per_step * steps_since / elapsed,
          "step_time": elapsed / steps_since,
          "skipped_steps": int(state.skipped),
        }
        record["perplexity"] = math.exp(min(record["loss"], 50.0))
        writer.write(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
        if is_main:
          bar.write(
            f"step {step}: loss {record['loss']:.4f}  ppl {record['perplexity']:.2f}  "
            f"lr {record['learning_rate']:.2e}  grad_norm {record['grad_norm']:.3f}  "
            f"{record['tokens_per_sec']:.0f} tokens/s  {record['step_time'] * 1e3:.1f} "
            "ms/step"
          )
        pending, t_last, steps_since = [], time.perf_counter(), 0
      if step % config.eval_every_steps == 0 and not last:
        ev = trainer.evaluate(state.params, corpus.splits["validation"], corpus.bos_id)
        writer.write({"step": step, "valid_loss": ev["nll"], "valid_ppl": ev["ppl"]})
      if step % config.checkpoint_every_steps == 0 or last:
        _save(mngr, step, state, data_iter)
      if interrupt.should_stop(step, config.log_every_steps):
        if mngr.latest_step() != step:
          _save(mngr, step, state, data_iter)
        bar.close()
        if is_main:
          print(
            f"\nInterrupted (signal {interrupt.signal}): saved the checkpoint at step "
            f"{step}; run the same command again to resume.",
            flush=True,
          )
        return {"interrupted": True, "step": step}
  bar.close()

  results = {
    "steps": step,
    "num_params": num_params,
    "tokens_seen": step * tokens_per_step,
    "unit": corpus.unit,
    "mixing": model_cfg.mixing,
    "skipped_steps": int(state.skipped),
  }
  ev = trainer.evaluate(state.params, corpus.splits["validation"], corpus.bos_id, "valid")
  results.update(valid_loss=ev["nll"], valid_ppl=ev["ppl"], valid_tokens=ev["tokens"])
  if "test" in corpus.splits:
    ev = trainer.evaluate(state.params, corpus.splits["test"], corpus.bos_id, "test")
    results.update(test_loss=ev["nll"], test_ppl=ev["ppl"], test_tokens=ev["tokens"])
  results["unigram_valid_ppl"] = unigram_ppl(
    corpus.splits["train"], corpus.splits["validation"], corpus.vocab.size
  )
  if corpus.unit == "byte":
    results["valid_bpb"] = results["valid_loss"] / math.log(2)
  if is_main:
    files.atomic_write_json(os.path.join(workdir, "results.json"), results)
    print(
      f"validation perplexity {results['valid_ppl']:.3f} (unigram baseline "
      f"{results['unigram_valid_ppl']:.3f})"
      + (f", test perplexity {results['test_ppl']:.3f}" if "test_ppl" in results else ""),
      flush=True,
    )
  writer.write({"step": step, **{k: v for k, v in results.items() if isinstance(v, float)}})
  writer.close()
  if config.sample.length > 0:
    params = state.params
    if jax.process_count() > 1:
      # Process 0 samples alone, so it needs every parameter on its own devices; all processes
      # take part in the gather.
      params = jax.tree_util.tree_map(
        jnp.asarray, multihost_utils.process_allgather(params, tiled=True)
      )
  if config.sample.length > 0 and is_main:
    text = decode_lib.sample_text(
      trainer.model,
      params,
      corpus.vocab,
      config.sample.prompt,
      config.sample.length,
      temperature=config.sample.temperature,
      top_k=config.sample.top_k,
      seed=config.seed,
    )
    print(f"Sample:\n{config.sample.prompt}{text}", flush=True)
  return results
