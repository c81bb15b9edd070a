"""Training and evaluation: ``train_and_evaluate(config, workdir)``, an outline read top to
bottom (setup, restore or init, the training loop, final evaluation); the jitted train step is
the pure ``train_step`` bound by ``Trainer`` (docs/training.md).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from aft_jax import data as data_lib
from aft_jax import decode as decode_lib
from aft_jax import sharding
from aft_jax.data import config as data_config
from aft_jax.data import record as data_record
from aft_jax.model import TransformerLM, check_ids, count_params
from aft_jax.trainer import checkpointing, guards, optimizer, run_config, step_log
from aft_jax.trainer.evaluation import bits_per_byte, eval_protocol, perplexity, unigram_ppl
from aft_jax.trainer.run_config import RunConfig
from aft_jax.typed_config import flatten
from aft_jax.workdir import Workdir


class TrainState(train_state.TrainState):
  """Parameters, optimizer state and step; ``skipped`` counts updates dropped as non-finite."""

  skipped: jax.Array = None


# A packed batch's keys that go to the model: each row's documents and their positions.
PACKED_KEYS = ("segment_ids", "positions")


def weighted_nll(model, params, batch, *, train, rng=None):
  """(sum of weight * NLL, sum of weights) over a batch (packed rows: padding has weight 0)."""
  nll = model.apply(
    {"params": params},
    batch["inputs"],
    batch["targets"],
    train=train,
    rngs={"dropout": rng} if train else None,
    **{k: batch[k] for k in PACKED_KEYS if k in batch},
  )
  weights = batch.get("weights")
  if weights is None:
    weights = jnp.ones_like(nll)
  return jnp.sum(nll * weights), jnp.sum(weights)


def train_step(state: TrainState, batch, rng, *, model, schedule, accum: int, skip: bool):
  """One update: (new state, metrics); a non-finite one counted (and with ``skip`` dropped)."""
  rng = jax.random.fold_in(rng, state.step)  # same dropout for a step, resumed or not

  def loss_fn(params):
    total, count = weighted_nll(model, params, batch, train=True, rng=rng)
    return total / jnp.maximum(count, 1.0), count

  (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  grad_norm = optax.tree_utils.tree_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  new_state = state.apply_gradients(grads=grads)
  if skip:
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
    "learning_rate": schedule(state.step // accum),
  }
  return new_state, metrics


def eval_step(params, batch, *, model):
  """(sum of weighted NLL, sum of weights) of one evaluation batch."""
  return weighted_nll(model, params, batch, train=False)


# The steps' XLA:CPU compile options: YNNPACK takes the dots alone, XLA's own fusions the
# element-wise work (faster at these small shapes:
# benchmarks/results/peer_nanogpt_timing_block64.md).
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


def compiler_options(mesh) -> dict | None:
  """``CPU_COMPILER_OPTIONS`` where ``mesh``'s devices are CPUs, less any that XLA_FLAGS sets."""
  if mesh.devices.flat[0].platform != "cpu":
    return None
  flags = os.environ.get("XLA_FLAGS", "")
  return {k: v for k, v in CPU_COMPILER_OPTIONS.items() if k not in flags} or None


class Trainer:
  """One run's config (vocabulary size filled in), mesh, jitted steps, shardings (and workdir)."""

  def __init__(self, cfg: RunConfig, mesh):
    self.config, self.mesh = cfg, mesh
    self.workdir, self.corpus, self.record = None, None, None  # set by ``setup``, as are:
    self.allow_config_change, self.config_changes = False, []
    self.good_steps = set()
    self.tree = cfg.tree  # the config as plain data: what config.json and checkpoints record
    self.is_main = jax.process_index() == 0  # process 0 alone writes logs, metrics and results
    self.rules = sharding.rules_from_config(cfg.rules.logical_axis_rules)
    self.model = TransformerLM(cfg.model)
    steps = cfg.train.num_train_steps
    self.tx = optimizer.make_optimizer(cfg.optimizer, steps)
    self.schedule = optimizer.learning_rate_schedule(cfg.optimizer, steps)
    dummy = jnp.zeros((1, cfg.train.seq_len), jnp.int32)

    def init(rng):
      params = self.model.init(rng, dummy)["params"]
      return TrainState.create(
        apply_fn=self.model.apply, params=params, tx=self.tx, skipped=jnp.zeros((), jnp.int32)
      )

    key = jax.eval_shape(lambda: jax.random.key(0))  # (abstract: the mesh may have no device)
    with self.on_mesh():
      abstract = jax.eval_shape(init, key)
    # (outside the mesh: unboxing the abstract tree there would constrain its shape structs)
    self.state_shardings = sharding.logical_shardings(abstract, mesh, self.rules)
    self._init = jax.jit(lambda rng: nn.unbox(init(rng)), out_shardings=self.state_shardings)
    self.abstract_state = jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      nn.unbox(abstract),
      self.state_shardings,
    )
    batch_sh = sharding.batch_sharding(mesh)
    repl = sharding.replicated(mesh)
    step = functools.partial(
      train_step,
      model=self.model,
      schedule=self.schedule,
      accum=cfg.optimizer.grad_accum_steps,
      skip=cfg.step_log.nonfinite == "skip",
    )
    options = compiler_options(mesh)
    self.step = jax.jit(  # the train step: (state, global batch, rng) -> (state, metrics)
      step,
      donate_argnums=(0,),
      in_shardings=(self.state_shardings, batch_sh, repl),
      out_shardings=(self.state_shardings, repl),
      compiler_options=options,
    )
    self._eval_step = jax.jit(
      functools.partial(eval_step, model=self.model),
      in_shardings=(self.state_shardings.params, batch_sh),
      out_shardings=repl,
      compiler_options=options,
    )

  def specs(self, batch_size: int, weights: bool = False) -> dict:
    """A global batch's ShapeDtypeStructs, for the train step (``weights``: the eval step)."""
    sh = sharding.batch_sharding(self.mesh)
    tokens = jax.ShapeDtypeStruct((batch_size, self.config.train.seq_len), jnp.int32, sharding=sh)
    out = {"inputs": tokens, "targets": tokens}
    packed = self.config.data.packing and not weights
    if weights or packed:
      out["weights"] = jax.ShapeDtypeStruct(tokens.shape, jnp.float32, sharding=sh)
    if packed:
      out.update({k: tokens for k in PACKED_KEYS})
    return out

  def lower_train_step(self):
    rng = jax.eval_shape(lambda: jax.random.key(0))
    rng = jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=sharding.replicated(self.mesh))
    with self.on_mesh():
      batch = self.specs(self.config.train.batch_size)
      return self.step.lower(self.abstract_state, batch, rng)

  @contextlib.contextmanager
  def on_mesh(self):
    """The mesh and the logical axis rules that the layers' constraints resolve against."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield

  def init_state(self, seed: int) -> TrainState:
    with self.on_mesh():
      return self._init(jax.random.key(seed))

  def train_step(self, state, batch, rng):
    """``step`` on a host batch (notebooks, benchmarks)."""
    with self.on_mesh():
      return self.step(state, sharding.put_batch(batch, self.mesh), rng)

  def evaluate(
    self,
    params,
    tokens: np.ndarray,
    bos_id: int,
    desc: str = "eval",
    *,
    stride: int | None = None,
    should_stop=None,
  ) -> dict | None:
    """Exact NLL over every token of ``tokens`` (``stride``: docs/training.md, "Evaluation");
    ``should_stop(i)`` True before batch ``i`` stops it, returning None."""
    ev, seq_len = self.config.eval, self.config.train.seq_len
    check_ids("Trainer.evaluate: tokens", tokens, self.config.model.vocab_size)
    check_ids("Trainer.evaluate: bos_id", bos_id, self.config.model.vocab_size)
    if stride is None:
      stride = ev.eval_stride
    kw = dict(seq_len=seq_len, global_batch_size=ev.eval_batch_size, stride=stride or None)
    n = data_lib.num_eval_batches(len(tokens), **kw)
    batches = data_lib.eval_batches(
      tokens,
      bos_id=bos_id,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      **kw,
    )
    total, count = 0.0, 0.0
    with self.on_mesh():
      bar = tqdm(batches, total=n, desc=desc, leave=False, disable=jax.process_index() != 0)
      for i, batch in enumerate(bar):
        if should_stop is not None and should_stop(i):
          return None  # asked to stop (a signal): the caller says so
        s, c = self._eval_step(params, sharding.put_batch(batch, self.mesh))
        total += float(s)
        count += float(c)
    return {"nll": total / count, "ppl": perplexity(total / count), "tokens": int(count)}


def make_trainer(cfg: RunConfig, vocab_size: int, devices=None, say=print) -> Trainer:
  """The trainer that training and ``--dry_run`` build alike, over ``devices`` (default: all)."""
  cfg = cfg.with_vocab(vocab_size)
  mesh = sharding.make_mesh(cfg.mesh, devices)
  sharding.check_batch_split(
    mesh, batch_size=cfg.train.batch_size, eval_batch_size=cfg.eval.eval_batch_size
  )
  for note in (
    optimizer.warmup_note(cfg.optimizer, cfg.train.num_train_steps),
    data_config.vocab_size_note(cfg.data),
  ):
    if note:
      say(note)
  return Trainer(cfg, mesh)


def setup(cfg: RunConfig, workdir: str, allow_config_change: bool) -> Trainer:
  """The run's trainer, checked against the newest readable checkpoint's config; writes nothing."""
  workdir = Workdir(workdir)
  mngr = checkpointing.checkpoint_manager(workdir, cfg.checkpoint)
  newest = checkpointing.newest_items(mngr)
  if newest is None:
    since, saved, items = "config.json and corpus.json", workdir.read_config(), {}
  else:
    since, saved, items = f"the checkpoint at step {newest[0]}", newest[1].get("config"), newest[1]
  trained = workdir.trained_corpus(items)
  changes = run_config.check_resume(saved, cfg.tree, workdir, allow_config_change)
  data_record.check_sources(trained, data_record.sources(cfg.data), since)
  corpus = data_lib.load_corpus(cfg.data, data_record.built_by(trained, cfg.data.dataset))
  record = data_record.of_corpus(corpus)
  data_record.check_corpus(trained, record, since)
  say = print if jax.process_index() == 0 else lambda line: None
  trainer = make_trainer(cfg, corpus.vocab.size, say=say)
  trainer.workdir, trainer.corpus, trainer.record = workdir, corpus, record
  trainer.allow_config_change, trainer.config_changes = allow_config_change, changes
  return trainer


def restore_or_init(trainer: Trainer, mngr, data_iter) -> TrainState:
  """The newest intact checkpoint's state (checked before it is read), or a fresh one."""
  changes = {}

  def check(step, items):
    since = f"the checkpoint at step {step}"
    changes[step] = run_config.check_resume(
      items.get("config"), trainer.tree, trainer.workdir, trainer.allow_config_change
    )
    data_record.check_corpus(items.get("corpus"), trainer.record, since)
    data_iter.check_state(items["data"], since)

  restored = checkpointing.restore_newest_intact(mngr, trainer.abstract_state, check)
  allowed = trainer.config_changes if restored is None else changes[restored.step]
  if allowed and trainer.is_main:
    print(f"Resuming with a changed config (--allow_config_change): {'; '.join(allowed)}")
  # Every check has passed: the damaged checkpoints moved aside, then the corpus record, the
  # vocabulary and config.json written (sampling and evaluating need no dataset).
  if restored is not None:
    checkpointing.set_aside(mngr, restored)
  if trainer.is_main:
    trainer.workdir.save_corpus(trainer.corpus)
    trainer.workdir.write_config(trainer.tree)
  if restored is None:
    state = trainer.init_state(trainer.config.train.seed)
    if trainer.is_main:
      corpus = trainer.corpus
      print(
        f"Model: {trainer.config.model.mixing}, {count_params(state.params):,} parameters; corpus "
        f"{corpus.name} ({corpus.unit}-level, vocab {corpus.vocab.size:,}); mesh "
        f"{sharding.axis_sizes(trainer.mesh)}",
        flush=True,
      )
    return state
  data_iter.set_state(restored.items["data"])
  trainer.good_steps.add(restored.step)
  if trainer.is_main:
    note = f" ({restored.unverified})" if restored.unverified else ""
    print(
      f"Resuming from the checkpoint at step {restored.step} in {trainer.workdir}{note}", flush=True
    )
  return restored.state


def _checkpoint(trainer: Trainer, log: step_log.StepLog, mngr, step: int, state, data_iter) -> bool:
  """Saves the checkpoint at ``step`` unless its update was skipped (whether it did)."""
  log.settle()
  if log.skipped_since is not None:
    if trainer.is_main:
      print(
        f"Not checkpointing step {step}: the updates since step {log.skipped_since} were "
        f"non-finite and skipped; {log.last_good()}",
        flush=True,
      )
    return False
  checkpointing.save(mngr, step, state, data_iter, trainer.tree, trainer.record)
  trainer.good_steps.add(step)
  return True


# results.json's "train_rows"; valid_* and test_* are on each split's stream either way.
TRAIN_ROWS = {
  "stream": "stream: windows of seq_len cut from the train split's token stream",
  "packed": (
    "packed: whole documents in order, each seeing only itself (positions from 0; one longer "
    "than a row in row-sized pieces), padding at a row's end out of the loss; tokens_seen counts "
    "the padding too. valid/test: eval_protocol on each split's stream, as for unpacked runs"
  ),
}


def final_results(
  trainer: Trainer, state: TrainState, preemption: guards.Preemption
) -> dict | None:
  """results.json's dict (each split's result kept for a rerun); None where a signal stops it."""
  cfg, corpus, step = trainer.config, trainer.corpus, int(state.step)
  seq_len, stride = cfg.train.seq_len, cfg.eval.final_eval_stride
  results = {
    "steps": step,
    "num_params": count_params(state.params),
    "tokens_seen": step * cfg.train.batch_size * seq_len,
    "unit": corpus.unit,
    "mixing": cfg.model.mixing,
    "skipped_steps": int(state.skipped),
    "train_rows": TRAIN_ROWS["packed" if cfg.data.packing else "stream"],
    # Final and training-time validation may use different protocols: both named.
    "eval_protocol": eval_protocol(seq_len, stride),
    "train_eval_protocol": eval_protocol(seq_len, cfg.eval.eval_stride),
  }
  key = {"step": step, "eval_protocol": results["eval_protocol"]}
  saved = trainer.workdir.read_final_eval() or {}
  done = saved.get("splits", {}) if {k: saved.get(k) for k in key} == key else {}
  stop = lambda i: preemption.should_stop(i, 64, synced=False)  # noqa: E731
  for split, prefix in (("validation", "valid"), ("test", "test")):
    if split not in corpus.splits:
      continue
    ev = done.get(split)
    if ev is None:
      ev = trainer.evaluate(
        state.params, corpus.splits[split], corpus.bos_id, prefix, stride=stride, should_stop=stop
      )
      if ev is None:
        if trainer.is_main:
          print(
            f"\nInterrupted (signal {preemption.signal}) during the final evaluation of the "
            f"{split} split; the splits already scored are kept: run the same command again to "
            "finish.",
            flush=True,
          )
        return None
      done[split] = ev
      if trainer.is_main:
        trainer.workdir.write_final_eval({**key, "splits": done})
    results.update(
      {f"{prefix}_loss": ev["nll"], f"{prefix}_ppl": ev["ppl"], f"{prefix}_tokens": ev["tokens"]}
    )
    if corpus.unit == "byte":
      results[f"{prefix}_bpb"] = ev["nll"] / math.log(2)
      if cfg.data.dataset == "enwik8":
        # The AFT paper's unit: enwik8's "characters" are its bytes.
        results[f"{prefix}_bpc"] = results[f"{prefix}_bpb"]
    elif corpus.num_bytes:  # subwords (and words) of a text whose bytes are known
      bytes_ = corpus.num_bytes[split]
      results[f"{prefix}_bpb"] = bits_per_byte(ev["nll"], ev["tokens"], bytes_)
  results["unigram_valid_ppl"] = unigram_ppl(
    corpus.splits["train"], corpus.splits["validation"], corpus.vocab.size
  )
  return results


def sample(trainer: Trainer, params, writer) -> str | None:
  """The end-of-run sample (``config.sample``), printed and logged by process 0; None if none."""
  cfg = trainer.config.sample
  if cfg.length <= 0:
    return None
  if jax.process_count() > 1:
    # Process 0 samples alone, on every parameter: all processes take part in the gather.
    gathered = multihost_utils.process_allgather(params, tiled=True)
    params = jax.tree_util.tree_map(jnp.asarray, gathered)
  if not trainer.is_main:
    return None
  text = decode_lib.sample_text(
    trainer.model,
    params,
    trainer.corpus.vocab,
    cfg.prompt,
    cfg.length,
    temperature=cfg.temperature,
    top_k=cfg.top_k,
    seed=trainer.config.train.seed,
  )
  print(f"Sample:\n{cfg.prompt}{text}", flush=True)
  writer.write_text("sample", cfg.prompt + text, trainer.config.train.num_train_steps)
  return text


def train_and_evaluate(config, workdir: str, *, allow_config_change: bool = False) -> dict:
  """Trains ``config`` (a tree or a ``RunConfig``) in ``workdir``, resuming what is there;
  results.json's dict, or after SIGTERM / Ctrl-C ``{"interrupted": True, "step": step}``."""
  cfg = config if isinstance(config, RunConfig) else RunConfig.from_tree(config)
  # The lock first: no other trainer may change the workdir between the checks and the writes.
  with guards.hold(Workdir(workdir), enabled=jax.process_index() == 0):
    # Setup: every check passes before anything is written.
    trainer = setup(cfg, workdir, allow_config_change)
    cfg, is_main, corpus = trainer.config, trainer.is_main, trainer.corpus
    train, every = cfg.train, cfg.step_log.log_every_steps
    # The training batches: stream windows, or packed documents (their padding said).
    packed = {}
    if cfg.data.packing:
      packed = dict(document_ends=corpus.documents["train"], bos_id=corpus.bos_id)
    data_iter = data_lib.train_iterator(
      corpus.splits["train"],
      seq_len=train.seq_len,
      global_batch_size=train.batch_size,
      seed=train.seed,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      **packed,
    )
    p = data_iter.packing
    if p and is_main:
      print(
        f"Packing: {p['documents']:,} train documents into {p['rows']:,} rows of "
        f"{train.seq_len}, {100 * p['padding_fraction']:.1f}% padding",
        flush=True,
      )
    mngr = checkpointing.checkpoint_manager(trainer.workdir, cfg.checkpoint)

    # Restore or init.
    state = restore_or_init(trainer, mngr, data_iter)
    step = int(state.step)
    if is_main:
      wandb_run = step_log.start_wandb(cfg.wandb, trainer.tree, trainer.workdir, step > 0)
      writer = step_log.MetricWriter(trainer.workdir, wandb_run)
    else:
      writer = step_log.NoMetrics()
    writer.write_text("config", json.dumps(trainer.tree, indent=2), step)
    writer.write_hparams(flatten(trainer.tree))
    with contextlib.ExitStack() as cleanup:
      # Last to first: the save in flight finished (its failure raised), Orbax closed, metrics.
      cleanup.callback(writer.close)
      cleanup.callback(mngr.close)
      cleanup.callback(checkpointing.finish_saving, mngr)

      # The training loop, to num_train_steps.
      dropout_rng = jax.random.key(train.seed + 1)
      bar = tqdm(
        total=train.num_train_steps,
        initial=step,
        desc="train",
        disable=not is_main,
        dynamic_ncols=True,
      )
      log = step_log.StepLog(trainer, writer, bar, mngr, step)
      profile = cfg.step_log.profile_steps if is_main else ()  # process 0 writes the trace
      profiler = step_log.Profiler(profile, trainer.workdir.tensorboard_dir)
      with bar, guards.Preemption() as preemption, profiler:
        stopped = False
        try:
          while step < train.num_train_steps and not stopped:
            profiler.at(step, state)
            with trainer.on_mesh():
              batch = sharding.put_batch(next(data_iter), trainer.mesh)
              state, metrics = trainer.step(state, batch, dropout_rng)
            step += 1
            log.add(metrics)
            bar.update(1)
            last = step == train.num_train_steps
            if step % every == 0 or last:
              log.flush(state)
            if step % cfg.eval.eval_every_steps == 0 and not last:
              ev = trainer.evaluate(state.params, corpus.splits["validation"], corpus.bos_id)
              log.validation(ev, byte_level=corpus.unit == "byte")
            if step % cfg.checkpoint.checkpoint_every_steps == 0 or last:
              _checkpoint(trainer, log, mngr, step, state, data_iter)
            stopped = preemption.should_stop(step, every)
        except FloatingPointError:  # divergence: the unlogged steps' metrics show how
          if log.pending:
            log.flush(state, check=False)
          raise
        if stopped:  # by a signal: the unlogged metrics and the checkpoint at this step written
          if log.pending:
            log.flush(state)
          saved = mngr.latest_step() == step
          saved = saved or _checkpoint(trainer, log, mngr, step, state, data_iter)
          checkpointing.finish_saving(mngr)
          if is_main:
            what = (
              f"saved the checkpoint at step {step}; run the same command again to resume."
              if saved
              else f"step {step} was not checkpointed; a rerun resumes from the last checkpoint."
            )
            print(f"\nInterrupted (signal {preemption.signal}): {what}", flush=True)
          return {"interrupted": True, "step": step}

      # Final evaluation, once the final checkpoint is on disk.
      checkpointing.finish_saving(mngr)
      with guards.Preemption() as preemption:
        results = final_results(trainer, state, preemption)
      if results is None:  # a signal stopped it
        return {"interrupted": True, "step": step}
      if is_main:
        trainer.workdir.write_results(results)
        protocol = results["eval_protocol"]
        test = f", test perplexity {results['test_ppl']:.3f}" if "test_ppl" in results else ""
        bits = "".join(f", {k} {results[k]:.4f}" for k in ("valid_bpc", "test_bpc") if k in results)
        print(
          f"validation perplexity {results['valid_ppl']:.3f} (unigram baseline "
          f"{results['unigram_valid_ppl']:.3f}){test}{bits} [{protocol['name']}, window "
          f"{protocol['window']}, stride {protocol['stride']}]",
          flush=True,
        )
      scalars = {k: v for k, v in results.items() if isinstance(v, float)}
      writer.write({"step": results["steps"], **scalars})
      sample(trainer, state.params, writer)
  return results
