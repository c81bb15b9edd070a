"""The evaluation protocols: sliding-window scoring against its slow definition."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.support.helpers import tiny_config
from aft_jax import sharding
from aft_jax.trainer import train_lib
from aft_jax.trainer.run_config import RunConfig


@pytest.mark.parametrize("mixing", ["aft_local", "softmax"])
def test_sliding_window_stride_1_is_the_mean_of_one_window_per_token(mixing):
  seq_len, n, vocab, bos = 8, 37, 11, 3
  model = {"model.mixing": mixing, "model.max_len": seq_len, "model.window": 3}
  config = tiny_config(seq_len=seq_len, eval_batch_size=4, **model)  # 37 windows: last padded
  cfg = RunConfig.from_tree(config).with_vocab(vocab)
  trainer = train_lib.Trainer(cfg, sharding.make_mesh(cfg.mesh))
  params = trainer.init_state(0).params
  tokens = np.random.default_rng(0).integers(0, vocab, n).astype(np.uint32)
  fast = trainer.evaluate(params, tokens, bos, stride=1)

  # The slow definition: target t is predicted from the (at most seq_len) tokens just before
  # it, one forward pass per target; the split's first token has `bos` as its context.
  stream = np.concatenate([[bos], tokens]).astype(np.int32)  # stream[t] is target t's input
  windows = [stream[max(0, t + 1 - seq_len) : t + 1] for t in range(n)]
  last_logp = jax.jit(lambda p, x: trainer.model.apply({"params": p}, x)[:, -1])  # [B, V]
  # Targets t < seq_len - 1 see shorter windows, one call each; the full windows of the later
  # targets are stacked into one call (each row is still its own target's window).
  logp = [last_logp(params, jnp.asarray(w[None]))[0] for w in windows[: seq_len - 1]]
  logp += list(last_logp(params, jnp.asarray(np.stack(windows[seq_len - 1 :]))))
  slow = -np.mean([float(lp[tokens[t]]) for t, lp in enumerate(logp)])
  assert fast["tokens"] == n
  np.testing.assert_allclose(fast["nll"], slow, rtol=1e-5)

  # Disjoint windows give every token less context on average, hence a different number.
  disjoint = trainer.evaluate(params, tokens, bos, stride=0)
  assert disjoint["tokens"] == n and disjoint["nll"] != pytest.approx(fast["nll"], rel=1e-6)
