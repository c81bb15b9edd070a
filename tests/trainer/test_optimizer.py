"""The optimizer's weight decay: on every parameter, or on the matrices only (issue 36)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aft_jax.trainer.optimizer import OptimizerConfig, make_optimizer


@pytest.mark.parametrize("decay_on", ["all", "matrices"])
def test_weight_decay_shrinks_the_chosen_parameters(decay_on):
  opt = OptimizerConfig(
    learning_rate=0.1, warmup_steps=0, weight_decay=0.5, weight_decay_on=decay_on
  )
  rng = np.random.default_rng(0)
  params = {"kernel": rng.normal(size=(3, 4)), "bias": rng.normal(size=4), "gain": np.float64(2.0)}
  params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
  tx = make_optimizer(opt, num_train_steps=10)
  zeros = {k: jnp.zeros_like(v) for k, v in params.items()}
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  # Zero gradients: AdamW's step is the decoupled decay alone, -lr * wd * p (lr at step 0 is
  # the peak without warmup).
  for name, p in params.items():
    decayed = decay_on == "all" or np.ndim(p) >= 2
    want = -0.1 * 0.5 * np.asarray(p) if decayed else np.zeros(np.shape(p))
    np.testing.assert_allclose(updates[name], want, rtol=1e-6, err_msg=name)
