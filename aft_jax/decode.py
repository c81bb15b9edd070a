"""Sampling from a trained language model with incremental decoding.

Each step feeds one token through the model with ``decode=True``; the layers keep the cache that
follows from their maths (``aft_jax.layers``): AFT-simple an O(d) state, AFT-local that state
plus the last ``window`` keys and values, AFT-full and softmax attention all past keys/values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def sample_logits(rng, logp_BV, temperature: float, top_k: int):
  """Samples token ids ``[B]`` from log-probabilities ``[B, V]`` (greedy if temperature == 0)."""
  if temperature <= 0:
    return jnp.argmax(logp_BV, axis=-1)
  logits = logp_BV / temperature
  if top_k and top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1)


def generate(
  model, params, prompt_BP, length: int, *, rng, temperature: float = 1.0, top_k: int = 0
) -> np.ndarray:
  """Continues ``prompt_BP`` (int ``[B, P]``, P >= 1) by ``length`` tokens: ``[B, length]``."""
  prompt_BP = jnp.asarray(prompt_BP, jnp.int32)
  if prompt_BP.ndim != 2 or prompt_BP.shape[1] < 1:
    raise ValueError(f"generate: prompt must be [B, P] with P >= 1, got {prompt_BP.shape}")
  b, p = prompt_BP.shape
  max_len = model.cfg.max_len
  if p + length - 1 > max_len:  # the last sampled token is never fed back
    raise ValueError(
      f"generate: prompt length {p} + length {length} - 1 exceeds the model's max_len = {max_len}"
    )
  cache = model.init(jax.random.key(0), prompt_BP[:, :1], decode=True)["cache"]

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(cache, tok_B, rng):
    logp, mutated = model.apply(
      {"params": params, "cache": cache}, tok_B[:, None], decode=True, mutable=["cache"]
    )
    return mutated["cache"], sample_logits(rng, logp[:, 0], temperature, top_k)

  out = []
  tok = prompt_BP[:, 0]
  for i in range(p + length - 1):
    rng, sub = jax.random.split(rng)
    cache, nxt = step(cache, tok, sub)
    if i + 1 < p:
      tok = prompt_BP[:, i + 1]  # still reading the prompt
    else:
      tok = nxt
      out.append(nxt)
  return np.asarray(jnp.stack(out, axis=1)) if out else np.zeros((b, 0), np.int32)


def sample_text(
  model,
  params,
  vocab,
  prompt: str,
  length: int,
  *,
  temperature: float = 0.8,
  top_k: int = 0,
  seed: int = 0,
) -> str:
  """Text that continues ``prompt`` (an empty prompt starts after an end-of-sequence token)."""
  ids = list(vocab.encode(prompt)) if prompt else []
  ids = ids or [vocab.eos_id]
  max_len = model.cfg.max_len
  length = min(length, max_len)
  ids = ids[-(max_len + 1 - length) :]  # keep the end of a long prompt
  new = generate(
    model,
    params,
    np.asarray([ids]),
    length,
    rng=jax.random.key(seed),
    temperature=temperature,
    top_k=top_k,
  )
  text = vocab.decode(new[0].tolist())
  return " " + text if vocab.unit == "word" and text else text  # words are space-separated
