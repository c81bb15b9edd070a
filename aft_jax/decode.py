"""Sampling from a trained language model: incremental decoding, then a sliding context.

While the sequence fits the model's ``max_len`` positions, each step feeds one token through the
model with ``decode=True`` (a prompt is fed in one parallel pass for AFT-simple, AFT-local and
AFT-conv1d: the chunked prefill of ``model.CHUNKED``; token by token for the others); the layers
keep the cache that follows from their maths
(``aft_jax.layers``): AFT-simple an O(d) state, AFT-local and AFT-conv1d that state plus the last
``window`` keys and values, AFT-full and softmax attention all past keys/values.

Past ``max_len`` the positions run out and the context slides: each further token is predicted
from the last ``max_len`` tokens, re-encoded in one parallel forward pass (the same as
re-encoding the last ``max_len - 1`` tokens into a fresh cache and feeding the newest). The
model's position embeddings are absolute, so no cache can be shifted by one position instead;
each token past ``max_len`` costs one forward pass of ``max_len`` tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from aft_jax.model import CHUNKED
from aft_jax.typed_config import TypedConfig


def sampling_problems(temperature: float, top_k: int, top_p: float) -> list[str]:
  """One line per bad sampling argument, named as the argument ("top_k = -1 must be ...")."""
  errors = []
  if not temperature >= 0:
    errors.append(f"temperature = {temperature} must be >= 0 (0: greedy)")
  if top_k < 0:
    errors.append(f"top_k = {top_k} must be >= 0 (0: all tokens)")
  if not 0 < top_p <= 1:
    errors.append(f"top_p = {top_p} must be in (0, 1] (1: all tokens)")
  return errors


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
  """A one-line ValueError naming the first bad sampling argument."""
  errors = sampling_problems(temperature, top_k, top_p)
  if errors:
    raise ValueError(errors[0])


@dataclasses.dataclass(frozen=True)
class SampleConfig(TypedConfig):
  """``config.sample``: the sample a training run prints at its end (``train_lib.sample``)."""

  WHERE = "sample"

  prompt: str = ""  # text to continue ('' starts after an end-of-line)
  length: int = 200  # tokens to generate (0: no sample)
  temperature: float = 0.8  # 0: greedy
  top_k: int = 0  # sample among the k most likely tokens (0: all)

  def _value_problems(self) -> list[str]:
    errors = [] if self.length >= 0 else [f"{self.key('length')} = {self.length} must be >= 0"]
    return errors + [
      f"config.sample.{e}" for e in sampling_problems(self.temperature, self.top_k, 1)
    ]


def sample_logits(rng, logp_BV, temperature: float, top_k: int = 0, top_p: float = 1.0):
  """Samples token ids ``[B]`` from log-probabilities ``[B, V]`` (greedy if temperature == 0).

  ``top_k`` > 0 keeps the k most likely tokens; ``top_p`` < 1 keeps the fewest most likely
  tokens whose probabilities (after temperature and top-k) sum to at least ``top_p``.
  """
  if temperature <= 0:
    return jnp.argmax(logp_BV, axis=-1)
  # Shifted so that the most likely token's logit is 0 whatever the temperature: a tiny one
  # (1e-45) sends the others to -inf, which is greedy sampling, instead of every logit to -inf.
  logits_BV = (logp_BV - jnp.max(logp_BV, axis=-1, keepdims=True)) / temperature
  if top_k and top_k < logits_BV.shape[-1]:
    kth = jax.lax.top_k(logits_BV, top_k)[0][..., -1:]
    logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
  if top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[..., ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of the more likely tokens
    # The smallest logit still kept: the last one whose predecessors hold < top_p.
    cutoff_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
  return jax.random.categorical(rng, logits_BV, axis=-1)


_sample_jit = jax.jit(sample_logits, static_argnames=("temperature", "top_k", "top_p"))


# Module-level jitted steps (the model is a hashable static argument), so repeated calls on one
# model compile once.
@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _decode_step(model, params, cache, tok_B):
  """(new cache, log-probabilities [B, V] of the next token) after feeding ``tok_B``."""
  logp_B1V, mutated = model.apply(
    {"params": params, "cache": cache}, tok_B[:, None], decode=True, mutable=["cache"]
  )
  return mutated["cache"], logp_B1V[:, 0]


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _prefill(model, params, cache, tokens_BT):
  """The cache after feeding ``tokens_BT`` in one parallel pass (the ``CHUNKED`` mixings)."""
  _, mutated = model.apply(
    {"params": params, "cache": cache}, tokens_BT, decode=True, mutable=["cache"]
  )
  return mutated["cache"]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_cache(model, batch: int):
  """The decoding cache of ``batch`` rows before any token (the parameters are dropped)."""
  tokens_B1 = jnp.zeros((batch, 1), jnp.int32)
  return model.init(jax.random.key(0), tokens_B1, decode=True)["cache"]


@functools.partial(jax.jit, static_argnums=(0,))
def _window_logp(model, params, tokens_BT):
  """Log-probabilities ``[B, V]`` of the token after the window ``tokens_BT``."""
  return model.apply({"params": params}, tokens_BT)[:, -1]


def generate(
  model,
  params,
  prompt_BP,
  length: int,
  *,
  rng,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  stop_id: int | None = None,
) -> np.ndarray:
  """Continues ``prompt_BP`` (int ``[B, P]``, P >= 1) by ``length`` tokens: ``[B, length]``.

  Any P and ``length``: past the model's ``max_len`` the context slides (module docstring).
  ``stop_id``: stop once every row has produced it (the result is then shorter; rows that
  stopped earlier go on sampling, so cut each row at its first ``stop_id``).
  """
  prompt_BP = np.asarray(prompt_BP, np.int32)
  if prompt_BP.ndim != 2 or prompt_BP.shape[1] < 1:
    raise ValueError(f"generate: prompt must be [B, P] with P >= 1, got {prompt_BP.shape}")
  if length < 0:
    raise ValueError(f"generate: length = {length} must be >= 0")
  check_sampling(temperature, top_k, top_p)
  b, p = prompt_BP.shape
  max_len = model.cfg.max_len
  sample = functools.partial(
    _sample_jit, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p)
  )
  step = functools.partial(_decode_step, model)
  window = functools.partial(_window_logp, model)

  seq_BN = prompt_BP
  stopped_B = np.zeros(b, bool)

  def append(logp_BV):
    nonlocal rng, seq_BN, stopped_B
    rng, sub = jax.random.split(rng)
    tok_B = np.asarray(sample(sub, logp_BV), np.int32)
    seq_BN = np.concatenate([seq_BN, tok_B[:, None]], axis=1)
    if stop_id is not None:
      stopped_B = stopped_B | (tok_B == stop_id)

  def done():
    return seq_BN.shape[1] - p >= length or (stop_id is not None and stopped_B.all())

  if p <= max_len and not done():
    # Incremental decoding while token n still has a position: n < max_len.
    cache = _init_cache(model, b)
    if model.cfg.mixing in CHUNKED and p > 1:  # the prompt in one parallel pass
      cache = _prefill(model, params, cache, jnp.asarray(prompt_BP[:, :-1]))
    else:
      for i in range(p - 1):
        cache, _ = step(params, cache, jnp.asarray(prompt_BP[:, i]))
    while not done():
      cache, logp_BV = step(params, cache, jnp.asarray(seq_BN[:, -1]))
      append(logp_BV)
      if seq_BN.shape[1] > max_len:
        break  # the next token has no position left: slide from here
  while not done():
    append(window(params, jnp.asarray(seq_BN[:, -max_len:])))
  return seq_BN[:, p:]


def encode_prompt(vocab, prompt: str) -> tuple[list[int], int]:
  """(ids, number of words mapped to ``<unk>``) of ``prompt``; empty: one end-of-line token.

  Bytes encode any text. A word outside a word vocabulary maps to ``<unk>`` when the
  vocabulary has one (as the corpus maps held-out words) and is a ValueError otherwise.
  """
  from aft_jax.data import vocab as vocab_lib  # pylint: disable=g-import-not-at-top

  if not prompt:
    return [vocab.eos_id], 0
  ids = [int(i) for i in vocab.encode(prompt)]
  unknown = 0
  if isinstance(vocab, vocab_lib.WordVocab):
    known = set(vocab.tokens)
    unknown = sum(t not in known for t in vocab_lib.word_tokens(prompt))
    if not prompt.endswith("\n"):
      ids = ids[:-1]  # the word protocol ends an unterminated line with <eos>: continue the line
  return ids or [vocab.eos_id], unknown


def sample_texts(
  model,
  params,
  vocab,
  prompt: str,
  length: int,
  *,
  num_samples: int = 1,
  stop_at_eos: bool = False,
  seed: int = 0,
  **sampling,
) -> list[str]:
  """``num_samples`` texts (sampled as one batch) that continue ``prompt``, without the prompt.

  ``stop_at_eos`` ends each text at the first end of line (``<eos>`` for words, a newline for
  bytes), which it keeps. ``sampling``: ``temperature`` (default 0.8 here), ``top_k``, ``top_p``
  as in ``generate``.
  """
  if num_samples < 1:
    raise ValueError(f"num_samples = {num_samples} must be >= 1")
  check_batch_fits(model, num_samples)
  ids, _ = encode_prompt(vocab, prompt)
  new_BN = generate(
    model,
    params,
    np.tile(np.asarray([ids]), (num_samples, 1)),
    length,
    rng=jax.random.key(seed),
    **{"temperature": 0.8, **sampling},
    stop_id=vocab.eos_id if stop_at_eos else None,
  )
  return [_text(vocab, row, vocab.eos_id if stop_at_eos else None) for row in new_BN]


def _memory_bytes() -> int:
  """The first device's memory (a GPU's or TPU's limit; on a CPU, the machine's RAM)."""
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_batch_fits(model, batch: int) -> None:
  """A one-line ValueError where ``batch`` sequences decoded at once (``generate``) need more
  memory than the device has: their decoding caches and per-step log-probabilities, estimated
  from one sequence's (the cache's shapes, not allocated)."""
  cache = jax.eval_shape(functools.partial(_init_cache, model, 1))
  per_row = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
  per_row += 3 * 4 * model.cfg.vocab_size  # the step's float32 logits, log-probs and sampling
  need, have = batch * per_row, _memory_bytes()
  if need > have:
    raise ValueError(
      f"num_samples = {batch}: the samples are decoded as one batch, which needs about "
      f"{need / 2**30:,.1f} GiB here, more than the device's {have / 2**30:,.1f} GiB; ask for "
      "fewer"
    )


def _text(vocab, ids: Sequence[int], stop_id: int | None) -> str:
  ids = list(ids)
  if stop_id is not None and stop_id in ids:
    ids = ids[: ids.index(stop_id) + 1]
  text = vocab.decode(ids)
  return " " + text if vocab.unit == "word" and text else text  # words are space-separated


def sample_text(model, params, vocab, prompt: str, length: int, **kwargs) -> str:
  """One text that continues ``prompt`` (keyword arguments as ``sample_texts``)."""
  return sample_texts(model, params, vocab, prompt, length, **kwargs)[0]
