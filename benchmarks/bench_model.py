"""One training step (loss, gradient, AdamW; parameters and optimizer state donated, as in
training) of the language model per mixing layer: time, tokens/s, FLOPs, compiled memory and,
on accelerators, MFU (docs/benchmarks.md; RESULTS.md, "Train step").

    python -m benchmarks.bench_model --out benchmarks/results          # CPU: 2 layers, d 256
    python -m benchmarks.bench_model --layers 12 --d_model 512         # the GPU size
    python -m benchmarks.bench_model --quick --out /tmp/bench          # < 1 minute on CPU
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from aft_jax.model import MIXINGS, ModelConfig, TransformerLM
from benchmarks import common

FIELDS = ("time_s", "tokens_per_s", "flops_per_token", "temp_bytes", "argument_bytes")
FIELDS += ("program_bytes",)


def make_step(model, tx):
  def loss_fn(params, tokens, targets):
    return jnp.mean(model.apply({"params": params}, tokens, targets, train=False))

  def step(params, opt_state, tokens, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


class _Chained:
  """The donating step, each call given the state the previous one returned, as in training."""

  def __init__(self, compiled, args):
    self._compiled, self._args = compiled, tuple(args)

  def __call__(self, *unused_args):
    out = self._compiled(*self._args)
    self._args = (out[0], out[1]) + self._args[2:]
    return out

  def __getattr__(self, name):  # cost_analysis, memory_analysis
    return getattr(self._compiled, name)


def config_for(mixing, t_len, a, dtype):
  """The benchmark's model: ``a.layers`` x ``a.d_model``, MLP 4 d_model, no dropout."""
  return ModelConfig(vocab_size=a.vocab, max_len=t_len, num_layers=a.layers, d_model=a.d_model,
                     num_heads=a.heads, mlp_dim=4 * a.d_model, mixing=mixing, window=a.window,
                     kernel_size=a.kernel_size, dropout_rate=0.0, dtype=dtype)  # fmt: skip


def measure_step(
  cfg: ModelConfig, batch: int, t_len: int, repeats: int, min_seconds: float, max_step_s, peak
) -> dict:
  """One jitted AdamW step on random tokens: time, tokens/s, FLOPs, memory, MFU."""
  model = TransformerLM(cfg)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, t_len)), jnp.int32)
  targets = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, t_len)), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), tokens[:, :8])["params"])
  tx = optax.adamw(1e-4, weight_decay=0.1)
  n_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
  args = (params, tx.init(params), tokens, targets)
  step = make_step(model, tx)
  # Parameters and optimizer state donated, as the trainer does: program_bytes counts them once.
  compiled, compile_s = common.compile_fn(step, args, donate_argnums=(0, 1))
  kw = dict(compiled=_Chained(compiled, args), compile_s=compile_s, budget_s=max_step_s)
  m = common.measure(step, args, repeats=repeats, min_seconds=min_seconds, **kw)
  n_tok, flops = batch * t_len, m["flops"]
  mfu = None if (peak is None or flops is None) else flops / m["time_s"] / (peak * 1e12)
  per_token = None if flops is None else flops / n_tok
  return dict(status="ok", **m, tokens_per_s=n_tok / m["time_s"], flops_per_token=per_token,
              params=n_params, mfu=mfu)  # fmt: skip


def run(a, sizes, mixings, dtype, max_step_s, log=print):
  dev = jax.devices()[0]
  peak = common.peaks(dev.device_kind)[0] if dev.platform != "cpu" else None
  records = []
  for mixing in mixings:
    cost = "quadratic" if mixing in ("softmax", "aft_full") else "linear"  # the attention's
    step = lambda t: measure_step(
      config_for(mixing, t, a, dtype), a.batch, t, a.repeats, a.min_seconds, max_step_s, peak
    )
    base = {"mixing": mixing, "batch": a.batch}
    records += common.sweep(sizes, base, cost, max_step_s, "step", step, log)
  return records


def ratios(records, t_len):
  """Each mixing layer's FLOPs, memory and step time as ratios to the softmax Transformer."""
  base = common.find(records, mixing="softmax", T=t_len)
  out = {}
  for r in records:
    if r["T"] != t_len or r.get("status") != "ok" or base is None:
      continue
    mem = lambda x: x["temp_bytes"] + (x["argument_bytes"] or 0)
    ratio = lambda key: r[key] / base[key]
    out[r["mixing"]] = {"flops": ratio("flops_per_token"), "temp_memory": ratio("temp_bytes")}
    out[r["mixing"]].update(total_memory=mem(r) / mem(base), step_time=ratio("time_s"))
  return out


def markdown(records, sizes, mixings, info):
  head = ("mixing", "T", "step time", "tokens/s", "FLOPs/token", "temp memory", "args memory",
          "program memory", "MFU")  # fmt: skip
  lines = [f"\n**Training step** ({info['layers']} layers, d {info['d_model']}, batch "
           f"{info['batch']}, vocab {info['vocab']}, {info['dtype']})\n",
           *common.table(head, [], "lr" + "r" * 7)]  # fmt: skip
  for mixing in mixings:
    for t_len in sizes:
      r = [x for x in records if x["mixing"] == mixing and x["T"] == t_len][0]
      if r["status"] != "ok":
        lines.append(f"| {mixing} | {t_len} | {r['status']} | | | | | | |")
        continue
      mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
      by = (r.get(k) for k in ("temp_bytes", "argument_bytes", "program_bytes"))
      cells = (common.fmt_time(r["time_s"]), f"{r['tokens_per_s']:.0f}",
               common.fmt_flops(r["flops_per_token"]), *map(common.fmt_bytes, by), mfu)  # fmt: skip
      lines.append(f"| {mixing} | {t_len} | " + " | ".join(cells) + " |")
  for t_len in sizes:
    rat = ratios(records, t_len)
    if not rat:
      continue
    head = ("mixing", "FLOPs/token", "temp memory", "temp + args memory", "step time")
    rows = [(mixing, *(f"{v:.2f}x" for v in x.values())) for mixing, x in rat.items()]
    lines += [f"\n**Ratios to the softmax Transformer at T = {t_len}**\n"]
    lines += common.table(head, rows, "lrrrr")
  return "\n".join(lines) + "\n"


def plot(records, mixings, path):
  def draw(plt, axes):
    for mixing in mixings:
      rs = [r for r in records if r["mixing"] == mixing and r["status"] == "ok"]
      if rs:
        ts = [r["T"] for r in rs]
        axes[0].plot(ts, [r["time_s"] for r in rs], marker="o", label=mixing)
        axes[1].plot(ts, [max(r["temp_bytes"], 1) / 2**20 for r in rs], marker="o", label=mixing)

  ylabels = ("training step time (s)", "XLA temp memory (MiB)")
  common.log_log_figure(2, (11, 4.2), ylabels, path, draw)


def main(argv=None):
  on_cpu = jax.devices()[0].platform == "cpu"
  p = common.parser(__doc__, "tiny model, for tests (< 1 min on CPU)")
  p.add_argument("--sizes", type=int, nargs="+", default=None)
  p.add_argument("--mixings", nargs="+", default=None, choices=MIXINGS)
  p.add_argument("--layers", type=int, default=2 if on_cpu else 12)
  p.add_argument("--d_model", type=int, default=256 if on_cpu else 512)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--vocab", type=int, default=8192 if on_cpu else 32768)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--window", type=int, default=32)
  p.add_argument("--kernel_size", type=int, default=7)
  p.add_argument("--dtype", default="float32" if on_cpu else "bfloat16")
  common.add_timing_args(p, "steps")
  p.add_argument("--max_step_s", type=float, default=None)
  a = p.parse_args(argv)
  if a.quick:
    sizes = a.sizes or [32, 64]
    a.layers, a.d_model, a.heads, a.vocab, a.repeats, a.min_seconds = 1, 32, 4, 128, 2, 0.0
    a.window, a.kernel_size = min(a.window, 16), min(a.kernel_size, 7)
    max_step_s = a.max_step_s or 2.0
  else:
    sizes = a.sizes or [1024, 4096]
    max_step_s = a.max_step_s or (30.0 if on_cpu else 5.0)
  mixings = a.mixings or list(MIXINGS)
  info = common.machine_info("python -m benchmarks.bench_model", argv)
  settings = ("layers", "d_model", "heads", "vocab", "batch", "window", "kernel_size", "dtype")
  info.update({k: getattr(a, k) for k in settings})
  info.update(sizes=sizes, quick=a.quick, max_step_s=max_step_s)
  info["peak_bf16_tflops"] = common.peaks(jax.devices()[0].device_kind)[0]
  records = common.timed_run(info, lambda: run(a, sizes, mixings, jnp.dtype(a.dtype), max_step_s))
  result = dict(machine=info, mixings=mixings, records=records)
  result["ratios_to_softmax"] = {str(t): ratios(records, t) for t in sizes}
  md = markdown(records, sizes, mixings, info)
  common.write_outputs(a.out, "bench_model", result, md, lambda path: plot(records, mixings, path))


if __name__ == "__main__":
  main()
